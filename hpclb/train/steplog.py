"""Per-step metrics and the gradient noise scale, read from the device once per log interval.

Every ``log_every`` optimizer steps (the same global steps on every rank) one allreduce of three
numbers (loss sum, count, the ranks' local squared gradient norms) turns what accumulated on the
device into one ``kind: step`` line of ``metrics.jsonl`` (and TensorBoard): ``loss`` (mean over
the interval's samples or tokens, all ranks), ``lr``, ``grad_norm`` (the averaged gradient's L2
norm before clipping, last step), ``trust_min/median/max`` (LARS/LAMB adapted layers, last step),
``samples_per_s``, ``step_time_s`` split into ``comm_wait_s`` (host time waiting for the
allreduce: communication backward did not hide) and ``compute_s`` (the rest), ``skipped_steps``
``step_skipped`` (the line's own step, the last of the interval, was skipped as non-finite)
and, on a GPU, ``max_memory_bytes``. Steps that are not logged read nothing from the device;
a logged one reads its numbers in one copy. A skipped (non-finite) step adds nothing: its loss
and noise terms are masked on the device, and when the line's step was skipped its
``grad_norm`` and trust ratios (never applied: a masked LARS/LAMB step computes ratios of 1.0)
are written as null.

Gradient noise scale (``--noise-scale``, world size > 1): McCandlish et al. 2018, App. A, from
each rank's local gradient (batch B/W, :attr:`GradientSync.local_sq_norm`) and the averaged one
(batch B), summed on the device and fed to :class:`~hpclb.noise.NoiseScaleEstimator` at each log
point; its summary is the ``noise`` field of each epoch line (``hpclb advise`` reads it). Cost:
one norm per bucket per step on the device and the allreduce above.
"""
from __future__ import annotations

import math
import time

import torch

from hpclb.noise import NoiseScaleEstimator

__all__ = ["StepLog"]


def _finite_or_none(x: float) -> float | None:
    """A skipped (non-finite) step's value is not a metric: None in the step line."""
    return x if math.isfinite(x) else None


class StepLog:
    """Owned by :func:`hpclb.train.loop.train`; ``after_step`` after each step (the step lines,
    and rank 0's ``progress``, a :class:`~hpclb.train.progress.Progress`, when it is due),
    ``epoch_fields`` and ``epoch_histograms`` at epoch ends (collective where noted)."""

    def __init__(self, run, logger, progress=None):
        self.run, self.logger, self.progress = run, logger, progress
        self.every = run.cfg.log_every
        self.noise = NoiseScaleEstimator() if run.cfg.noise_scale and run.comm.world_size > 1 \
            else None
        self._resume_base: torch.Tensor | None = None
        self.last: dict | None = None  # the last step line's scalars (what progress shows)
        self._start_interval(None)
        if run.resumed_from is not None:
            self._load_state_dict(run.resumed_from.get("steplog"))

    def _start_interval(self, sums) -> None:
        dev = self.run.device
        self.t0, self.sync0 = time.perf_counter(), self.run.optimizer.sync_wait_s
        self.steps = 0
        self._last = sums.clone() if sums is not None else None
        # noise-scale sums over the applied steps: local squared norms, averaged ones, count
        self._noise_sums = torch.zeros(3, dtype=torch.float64, device=dev)

    def start_epoch(self, sums: torch.Tensor, resumed: bool) -> None:
        """``sums``: the epoch's running sums, which the next step lines read; ``resumed``: the
        epoch continues from a mid-epoch checkpoint (its lines count from the last log point
        before it), else they count from the epoch's start."""
        base = self._resume_base if resumed else None
        self._resume_base = None
        self._last = torch.zeros_like(sums) if base is None else base.to(sums.device)

    def after_step(self, sums: torch.Tensor, stepped: bool, i: int = 0) -> None:
        """What the run logs and shows after step ``i`` of the epoch (0-based): accumulate it
        (on the device; a skipped step adds nothing); every ``log_every`` global steps, log
        (collective; raises NonFiniteError at the limit of skipped steps in a row); update the
        progress bar or line when it is due (its LR: the step's, from the schedule)."""
        self.steps += 1
        opt = self.run.optimizer
        if self.noise is not None and stepped and opt.sync.local_sq_norm is not None:
            one = torch.stack([opt.sync.local_sq_norm.double().reshape(()),
                               opt.grad_norm.double().square(),
                               torch.ones((), dtype=torch.float64, device=sums.device)])
            skipped = opt.step_skipped
            self._noise_sums += one if skipped is None else torch.where(skipped, 0.0, one)
        step = self.run.pos.global_step
        if self.every and step % self.every == 0:
            self._flush(sums)
        if self.progress is not None and time.monotonic() >= self.progress.due_at:
            self.progress.update(i, step, self.run.schedule.lr(step - 1), self.last)

    def _read(self, sums: torch.Tensor) -> tuple[list[float], list[float]]:
        """One read from the device: ``[loss sum, count, local squared norms]`` of the interval
        summed over the ranks (one allreduce) and this rank's ``[averaged squared norms, noise
        steps, grad_norm, trust min, median, max, last step skipped (1.0/0.0)]`` (the same on
        every rank)."""
        d = sums - self._last
        opt = self.run.optimizer
        ratios = getattr(opt.optimizer, "trust_ratios", None)
        nan = torch.full((1,), float("nan"), dtype=torch.float64, device=sums.device)
        q = nan.expand(3) if ratios is None or ratios.numel() == 0 else torch.quantile(
            ratios.detach().float(), torch.linspace(0, 1, 3, device=ratios.device)).double()
        norm = nan if opt.grad_norm is None else opt.grad_norm.detach().double().reshape(1)
        found = opt.step_skipped
        last_skipped = nan.new_zeros(1) if found is None else \
            found.detach().to(sums.device).double().reshape(1)
        vec = torch.cat([torch.stack([d[0], d[2]]).double(), self._noise_sums.double(),
                         norm.to(sums.device), q.to(sums.device), last_skipped]).cpu()
        reduced = torch.stack([vec[0], vec[1], vec[2]])
        if self.run.comm.world_size > 1:
            self.run.comm.allreduce_(reduced)
        return reduced.tolist(), vec[3:].tolist()

    def _update_noise(self, small_sum: float, big_sum: float, n: float) -> None:
        if self.noise is None or not n:
            return
        w, b = self.run.comm.world_size, self.run.cfg.global_batch_size
        self.noise.update(small_sum / (w * n), b // w, big_sum / n, b)

    def _flush(self, sums: torch.Tensor) -> None:
        run, opt = self.run, self.run.optimizer
        dt = time.perf_counter() - self.t0
        skipped = opt.check_nonfinite()   # raises at the limit (the device path's check)
        (loss, count, small), (big, n, norm, *trust, last_skipped) = self._read(sums)
        self._update_noise(small, big, n)
        wait = (opt.sync_wait_s - self.sync0) / self.steps
        applied = last_skipped != 1.0  # a skipped step's norm and ratios were never applied
        scalars = {"loss": loss / count if count else None,
                   "lr": run.schedule.lr(run.pos.global_step - 1),
                   "grad_norm": _finite_or_none(norm) if applied else None,
                   **({} if math.isnan(trust[0]) else dict(zip(
                       ("trust_min", "trust_median", "trust_max"),
                       map(_finite_or_none, trust) if applied else (None,) * 3))),
                   "step_skipped": not applied,
                   "samples_per_s": self.steps * run.cfg.global_batch_size / dt,
                   "step_time_s": dt / self.steps, "comm_wait_s": wait,
                   "compute_s": dt / self.steps - wait, "skipped_steps": skipped}
        if run.device.type == "cuda":
            scalars["max_memory_bytes"] = torch.cuda.max_memory_allocated(run.device)
        self.logger.log_step(run.pos.global_step, scalars)
        self.last = {**scalars, "step": run.pos.global_step}
        self._start_interval(sums)

    def state_dict(self) -> dict:
        """Collective (one allreduce): what a run resumed from this point needs for its step
        lines and ``noise`` fields to equal an uninterrupted run's: ``log_base`` (the epoch's
        running sums at the last log point, totals over the ranks), ``noise_sums`` (the
        interval's noise-scale sums, the local squared norms totalled over the ranks) and
        ``noise`` (the estimator's state, or None); plain floats, rank 0's to save."""
        base = torch.zeros(3, dtype=torch.float64) if self._last is None else self._last
        noise = self._noise_sums.double().cpu()
        vec = torch.cat([base.double().cpu(), noise[:1]])
        if self.run.comm.world_size > 1:
            self.run.comm.allreduce_(vec)
        return {"log_base": vec[:3].tolist(), "noise_sums": [float(vec[3]), *noise[1:].tolist()],
                "noise": None if self.noise is None else self.noise.state_dict()}

    def _load_state_dict(self, state: dict | None) -> None:
        """Continue from :meth:`state_dict` (None: a checkpoint written before it existed). The
        totals go to rank 0, the other ranks start from zeros, as the epoch's sums do."""
        if not state:
            return
        rank0 = self.run.comm.rank == 0
        base = torch.tensor(state["log_base"], dtype=torch.float64)
        self._resume_base = base if rank0 else torch.zeros_like(base)  # for a mid-epoch resume
        small, big, n = state["noise_sums"]
        self._noise_sums = torch.tensor([small if rank0 else 0.0, big, n], dtype=torch.float64,
                                        device=self.run.device)
        if self.noise is not None and state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])

    def epoch_fields(self) -> dict:
        """Collective: ``{"noise": {...}}`` with the estimator's summary over the epoch (steps
        since the last log point included), or ``{}`` without ``--noise-scale``."""
        if self.noise is None:
            return {}
        small, big, n = self._noise_sums.double().cpu().tolist()
        if n:
            vec = torch.tensor([small], dtype=torch.float64)
            if self.run.comm.world_size > 1:
                self.run.comm.allreduce_(vec)
            self._update_noise(float(vec[0]), big, n)
            self._noise_sums.zero_()
        out = self.noise.summary()
        self.noise.new_window()
        return {"noise": out}

    def epoch_histograms(self) -> None:
        """TensorBoard histogram of the last step's per-layer trust ratios (rank 0; none when
        that step was skipped: its ratios were never applied)."""
        ratios = getattr(self.run.optimizer.optimizer, "trust_ratios", None)
        found = self.run.optimizer.step_skipped
        if not self.logger.enabled or (found is not None and bool(found)):
            return
        if ratios is not None and ratios.numel():
            self.logger.histogram("trust_ratio", ratios.detach().float().cpu(),
                                  self.run.pos.global_step)
