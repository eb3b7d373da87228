"""Per-step metrics and the gradient noise scale, read from the device once per log interval.

Every ``log_every`` optimizer steps (the same global steps on every rank) one allreduce of three
numbers (loss sum, count, the ranks' local squared gradient norms) turns what accumulated on the
device into one ``kind: step`` line of ``metrics.jsonl`` (and TensorBoard): ``loss`` (mean over
the interval's samples or tokens, all ranks), ``lr``, ``grad_norm`` (the averaged gradient's L2
norm before clipping, last step), ``trust_min/median/max`` (LARS/LAMB adapted layers, last step),
``samples_per_s``, ``step_time_s`` split into ``comm_wait_s`` (host time waiting for the
allreduce: communication backward did not hide) and ``compute_s`` (the rest), ``skipped_steps``
and, on a GPU, ``max_memory_bytes``. Steps that are not logged read nothing from the device.

Gradient noise scale (``--noise-scale``, world size > 1): McCandlish et al. 2018, App. A, from
each rank's local gradient (batch B/W, :attr:`GradientSync.local_sq_norm`) and the averaged one
(batch B), summed on the device and fed to :class:`~hpclb.noise.NoiseScaleEstimator` at each log
point; its summary is the ``noise`` field of each epoch line (``hpclb advise`` reads it). Cost:
one norm per bucket per step on the device and the allreduce above.
"""
from __future__ import annotations

import time

import torch

from hpclb.noise import NoiseScaleEstimator

__all__ = ["StepLog"]


class StepLog:
    """Owned by :func:`hpclb.train.loop.train`; ``after_step`` after each step, ``epoch_fields`` and
    ``epoch_histograms`` at epoch ends (collective where noted)."""

    def __init__(self, run, logger):
        self.run, self.logger = run, logger
        self.every = run.cfg.log_every
        self.noise = NoiseScaleEstimator() if run.cfg.noise_scale and run.comm.world_size > 1 \
            else None
        self._sums_ref = None
        self._start_interval(None)

    def _start_interval(self, sums) -> None:
        dev = self.run.device
        self.t0, self.sync0 = time.perf_counter(), self.run.optimizer.sync_wait_s
        self.steps = 0
        self._last = sums.clone() if sums is not None else None
        self._small = torch.zeros((), dtype=torch.float64, device=dev)
        self._big = torch.zeros((), dtype=torch.float64, device=dev)
        self._n_noise = 0

    def after_step(self, sums: torch.Tensor, stepped: bool) -> None:
        """Accumulate one step; every ``log_every`` global steps, log (collective)."""
        if sums is not self._sums_ref:  # a new epoch's sums
            self._sums_ref, self._last = sums, torch.zeros_like(sums)
        self.steps += 1
        opt = self.run.optimizer
        if self.noise is not None and stepped and opt.sync.local_sq_norm is not None:
            self._small += opt.sync.local_sq_norm.double()
            self._big += opt.grad_norm.double().square()
            self._n_noise += 1
        if self.every and self.run.pos.global_step % self.every == 0:
            self._flush(sums)

    def _reduce(self, sums: torch.Tensor) -> torch.Tensor:
        d = sums - self._last
        vec = torch.stack([d[0], d[2], self._small]).double().cpu()
        if self.run.comm.world_size > 1:
            self.run.comm.allreduce_(vec)
        return vec

    def _update_noise(self, small_sum: float) -> None:
        if self.noise is None or not self._n_noise:
            return
        w, b = self.run.comm.world_size, self.run.cfg.global_batch_size
        self.noise.update(small_sum / (w * self._n_noise), b // w,
                          float(self._big) / self._n_noise, b)

    def _flush(self, sums: torch.Tensor) -> None:
        run, opt = self.run, self.run.optimizer
        dt = time.perf_counter() - self.t0
        vec = self._reduce(sums)
        self._update_noise(float(vec[2]))
        wait = (opt.sync_wait_s - self.sync0) / self.steps
        scalars = {"loss": float(vec[0] / vec[1]) if vec[1] else None,
                   "lr": run.schedule.lr(run.pos.global_step - 1),
                   "grad_norm": float(opt.grad_norm) if opt.grad_norm is not None else None,
                   **self._trust(), "samples_per_s": self.steps * run.cfg.global_batch_size / dt,
                   "step_time_s": dt / self.steps, "comm_wait_s": wait,
                   "compute_s": dt / self.steps - wait, "skipped_steps": opt.skipped_steps}
        if run.device.type == "cuda":
            scalars["max_memory_bytes"] = torch.cuda.max_memory_allocated(run.device)
        self.logger.log_step(run.pos.global_step, scalars)
        self._start_interval(sums)

    def _trust(self) -> dict:
        ratios = getattr(self.run.optimizer.optimizer, "trust_ratios", None)
        if ratios is None or ratios.numel() == 0:
            return {}
        q = torch.quantile(ratios.detach().float().cpu(), torch.tensor([0.0, 0.5, 1.0]))
        return {"trust_min": float(q[0]), "trust_median": float(q[1]), "trust_max": float(q[2])}

    def epoch_fields(self) -> dict:
        """Collective: ``{"noise": {...}}`` with the estimator's summary over the epoch (steps
        since the last log point included), or ``{}`` without ``--noise-scale``."""
        if self.noise is None:
            return {}
        if self._n_noise:
            vec = torch.stack([self._small.double().cpu()])
            if self.run.comm.world_size > 1:
                self.run.comm.allreduce_(vec)
            self._update_noise(float(vec[0]))
            self._small.zero_()
            self._big.zero_()
            self._n_noise = 0
        out = self.noise.summary()
        self.noise.new_window()
        return {"noise": out}

    def epoch_histograms(self) -> None:
        """TensorBoard histogram of the last step's per-layer trust ratios (rank 0)."""
        ratios = getattr(self.run.optimizer.optimizer, "trust_ratios", None)
        if ratios is not None and ratios.numel():
            self.logger.histogram("trust_ratio", ratios.detach().float().cpu(),
                                  self.run.pos.global_step)
