"""The training loop, as one rank sees it (docs/design.md, "One training step").

1. :func:`hpclb.train.setup.setup_run` builds or resumes the run: settings, data, out directory and
   checkpoint agreed by all ranks; the model on this rank's device, broadcast from rank 0;
   per-rank random streams; the optimizer wrapped in
   :class:`~hpclb.sync.optimizer.DistributedOptimizer`.
2. Each step (:func:`train_step`), each rank reads its share of the global batch from the
   :class:`~hpclb.tasks.Task` in one call (``Task.micro_batches``, on the device; a
   :class:`~hpclb.data.sampler.GlobalBatchSampler`: no padding, the same global batch at every
   world size; language models: this rank's token streams) and runs forward (in
   ``run.autocast``: bf16/fp16) and backward, as
   ``accumulation_steps`` micro-batches, each part's mean loss weighted by
   ``GradientSync.loss_weight`` so the averaged gradient is the exact mean over the global
   batch, even when the last step's shares are uneven. The gradients are averaged during
   backward (fused buckets); the window's last backward waits for them. Then ONE
   ``DistributedOptimizer.step()`` guards against non-finite values, clips, steps.
3. The LR comes from :mod:`hpclb.schedules` for this global step (LEGW or a baseline), set on the
   optimizer's groups just before its step: a function of the step, no scheduler state.
4. After each step one call, :meth:`StepLog.after_step` (below), logs and shows it: every
   ``log_every`` steps one ``kind: step`` line (loss, LR, gradient norm, trust ratios,
   samples/s, compute vs exposed communication, skipped steps, device memory) goes to
   ``metrics.jsonl`` and TensorBoard (:mod:`hpclb.train.metrics`), statistics staying on the
   device in between; on rank 0 the progress bar or line when due. At each epoch end: metrics
   reduced over ranks, BatchNorm buffers averaged, evaluation, an epoch line, a checkpoint.
   The console lines, ``config.json`` and ``summary.json`` come from :mod:`hpclb.train.report`.

Preemption: SIGUSR2/SIGTERM only set a flag; at the next step the ranks agree (allreduce max),
rank 0 saves that step's checkpoint, and every rank exits with :data:`PREEMPTED_EXIT_CODE`, which
the job scripts use to requeue; ``--resume`` continues the same trajectory bit for bit.
Non-finite steps: a skipped step adds nothing to the epoch's statistics (masked on the device).
Divergence: after ``max_nonfinite_steps`` non-finite steps in a row every rank raises
:class:`Diverged` (exit :data:`DIVERGED_EXIT_CODE`; at once on the host path, at the next step
line or epoch end when the optimizer masks skips on the device, LARS/LAMB), as it does when an
epoch ends with a non-finite metric or a training loss over :data:`EXPLODED_LOSS_FACTOR` times
the first applied step's; the last finite checkpoint is kept and no summary is written.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Any, NamedTuple

import torch

from hpclb._io import write_json
from hpclb.comm.base import Communicator
from hpclb.config import RunConfig, check_checkpoint_interval
from hpclb.config.outputs import RUN_KEPT
from hpclb.errors import PREEMPTED_EXIT_CODE, Diverged, NonFiniteError, Preempted
from hpclb.noise import NoiseScaleEstimator
from hpclb.schedules import set_lr
from hpclb.sync.agree import average_buffers
from hpclb.train import report
from hpclb.train.checkpointer import save_run_checkpoint
from hpclb.train.metrics import RunLogger
from hpclb.train.preemption import PreemptionFlag
from hpclb.train.progress import Progress
from hpclb.train.setup import Run, setup_run

__all__ = ["EXPLODED_LOSS_FACTOR", "StepLog", "StepRead", "train_step", "train"]

# An epoch's training loss this many times the first applied (not skipped) step's (both finite,
# > 0) is a divergence: a cross-entropy that starts at ln(classes) never legitimately grows a
# hundredfold. docs/faults.md states it (tests/test_faults_doc.py).
EXPLODED_LOSS_FACTOR = 1e2
LOSS_SUM, COUNT = 0, 2  # in a task's statistics (Task.loss): the loss sum, samples or tokens


def _set_threads(comm: Communicator) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))


def train_step(run: Run, i: int, sums: torch.Tensor, first: torch.Tensor | None = None) -> bool:
    """Step ``i`` of the current epoch on this rank: its ``accumulation_steps`` micro-batches
    (forward and backward, or a skip for an empty share; the window's last backward waits for
    the gradient allreduce), then one optimizer step at the schedule's LR of this global step
    (set on the optimizer's groups just before it, as nanoGPT's loop does). Adds the task's
    statistics to ``sums`` (on the device), unless the step was skipped as non-finite (masked
    on the device: no host read).
    ``first`` (float64 ``[3]``, zeros until then): receives the statistics of the first step
    that was not skipped (the reference of the explosion check).
    Returns the optimizer's verdict (False: a step skipped on the host)."""
    opt = run.optimizer
    label = run.profiler.label if run.profiler is not None else contextlib.nullcontext
    opt.zero_grad()
    before = sums.clone()
    parts = run.task.micro_batches(i, run.cfg.accumulation_steps, run.device)
    for _ in range(run.cfg.accumulation_steps):
        with label("hpclb/data"):
            n_part, n_global, batch = next(parts)  # on the device
        if not n_part:  # no samples of this micro-batch here: counted in the window, empty
            opt.sync.skip_micro_batch()
            continue
        with label("hpclb/forward_backward"):  # the last one waits for the allreduce at its end
            with run.autocast:
                loss, stats = run.task.loss(run.model, batch)
            weight = opt.sync.loss_weight(n_part, n_global)
            loss = loss if weight == 1 else loss * weight
            (opt.scaler.scale(loss) if opt.scaler is not None else loss).backward()
        sums += stats
    with label("hpclb/optimizer"):
        set_lr(opt, run.schedule.lr(run.pos.global_step))  # the LR is a function of the step
        stepped = opt.step()
    skipped = opt.step_skipped
    if skipped is not None:  # a skipped step adds nothing to the epoch's statistics
        sums.copy_(torch.where(skipped.to(sums.device), before, sums))
        if first is not None:
            first.copy_(torch.where(first[COUNT] > 0, first, sums - before))
    run.pos.global_step += 1
    return stepped


def _finite_or_none(x: float) -> float | None:
    """A skipped (non-finite) step's value is not a metric: None in the step line."""
    return x if math.isfinite(x) else None


class StepRead(NamedTuple):
    """A step line's read (:meth:`StepLog._read`): the first three summed over the ranks, the
    rest the same on every rank (trust: min, median, max, nan: none; last_skipped 1.0/0.0)."""

    loss_sum: float
    count: float
    local_sq: float
    averaged_sq: float
    noise_steps: float
    grad_norm: float
    trust: tuple[float, float, float]
    last_skipped: float


class StepLog:
    """Per-step metrics and the gradient noise scale, read from the device once per log interval.

    Every ``log_every`` optimizer steps (the same global steps on every rank) one allreduce of
    three numbers (loss sum, count, the ranks' local squared gradient norms) turns what
    accumulated on the device into one ``kind: step`` line of ``metrics.jsonl`` (and
    TensorBoard): ``loss`` (mean over the interval's samples or tokens, all ranks; an interval
    spans an epoch's end when ``log_every`` does not divide the epoch: :meth:`end_epoch`), ``lr``,
    ``grad_norm`` (the averaged gradient's L2 norm before clipping, last step),
    ``trust_min/median/max`` (LARS/LAMB adapted layers, last step), ``samples_per_s`` (the
    interval's samples: an epoch's short last step counts its own),
    ``step_time_s`` split into ``comm_wait_s`` (host time waiting for the allreduce:
    communication backward did not hide) and ``compute_s`` (the rest), ``skipped_steps``,
    ``step_skipped`` (the line's own step, the last of the interval, was skipped as non-finite)
    and, on a GPU, ``max_memory_bytes``. Steps that are not logged read nothing from the
    device; a logged one reads its numbers in one copy. A skipped (non-finite) step adds
    nothing: its loss and noise terms are masked on the device, and when the line's step was
    skipped its ``grad_norm`` and trust ratios (never applied: a masked LARS/LAMB step computes
    ratios of 1.0) are written as null.

    Gradient noise scale (``--noise-scale``, world size > 1): McCandlish et al. 2018, App. A,
    from each rank's local gradient (batch B/W, :attr:`GradientSync.local_sq_norm`) and the
    averaged one (batch B), summed on the device and fed to
    :class:`~hpclb.noise.NoiseScaleEstimator` at each log point; its summary is the ``noise``
    field of each epoch line (``hpclb advise`` reads it). Cost: one norm per bucket per step on
    the device and the allreduce above.

    Owned by :func:`train`; ``after_step`` after each step (the step lines, and rank 0's
    ``progress``, a :class:`~hpclb.train.progress.Progress`, when it is due), ``epoch_fields``
    and ``epoch_histograms`` at epoch ends (collective where noted)."""

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
        self.steps, self.samples = 0, 0  # optimizer steps and samples since the last line
        self._last = sums.clone() if sums is not None else None
        # the statistics of earlier epochs' steps since the last line (see end_epoch)
        self._carry = torch.zeros(3, dtype=torch.float64, device=dev)
        # noise-scale sums over the applied steps: local squared norms, averaged ones, count
        self._noise_sums = torch.zeros(3, dtype=torch.float64, device=dev)

    def start_epoch(self, sums: torch.Tensor, resumed: bool) -> None:
        """``sums``: the epoch's running sums, which the next step lines read; ``resumed``: the
        epoch continues from a mid-epoch checkpoint (its lines count from the last log point
        before it), else they count from the epoch's start."""
        base = self._resume_base if resumed else None
        self._resume_base = None
        self._last = torch.zeros_like(sums) if base is None else base.to(sums.device)

    def end_epoch(self, sums: torch.Tensor) -> None:
        """The epoch ended with ``sums``: its steps since the last step line stay in the
        interval, so the next line (in the next epoch) is the mean over all its steps' samples
        (on the device, no read)."""
        self._carry += sums - self._last
        self._last = sums.clone()

    def after_step(self, sums: torch.Tensor, stepped: bool, i: int = 0) -> None:
        """What the run logs and shows after step ``i`` of the epoch (0-based): accumulate it
        (on the device; a skipped step adds nothing); every ``log_every`` global steps, log
        (collective; raises NonFiniteError at the limit of skipped steps in a row); update the
        progress bar or line when it is due (its LR: the step's, from the schedule)."""
        self.steps += 1
        run = self.run  # a short last step of the epoch has fewer samples than the global batch
        self.samples += run.cfg.global_batch_size if i + 1 < run.schedule.steps_per_epoch \
            else run.task.global_size(i)
        opt = run.optimizer
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

    def _read(self, sums: torch.Tensor) -> StepRead:
        """One read from the device (a copy of one vector) and one allreduce of its first
        three numbers (:class:`StepRead`)."""
        d = sums - self._last + self._carry
        opt = self.run.optimizer
        ratios = getattr(opt.optimizer, "trust_ratios", None)
        nan = torch.full((1,), float("nan"), dtype=torch.float64, device=sums.device)
        q = nan.expand(3) if ratios is None or ratios.numel() == 0 else torch.quantile(
            ratios.detach().float(), torch.linspace(0, 1, 3, device=ratios.device)).double()
        norm = nan if opt.grad_norm is None else opt.grad_norm.detach().double().reshape(1)
        found = opt.step_skipped
        last_skipped = nan.new_zeros(1) if found is None else \
            found.detach().to(sums.device).double().reshape(1)
        vec = torch.cat([torch.stack([d[LOSS_SUM], d[COUNT]]).double(), self._noise_sums.double(),
                         norm.to(sums.device), q.to(sums.device), last_skipped]).cpu()
        reduced = torch.stack([vec[0], vec[1], vec[2]])
        if self.run.comm.world_size > 1:
            self.run.comm.allreduce_(reduced)
        averaged_sq, noise_steps, grad_norm, *trust, last_skipped = vec[3:].tolist()
        return StepRead(*reduced.tolist(), averaged_sq, noise_steps, grad_norm, tuple(trust),
                        last_skipped)

    def _update_noise(self, small_sum: float, big_sum: float, n: float) -> None:
        if self.noise is None or not n:
            return
        w, b = self.run.comm.world_size, self.run.cfg.global_batch_size
        self.noise.update(small_sum / (w * n), b // w, big_sum / n, b)

    def _flush(self, sums: torch.Tensor) -> None:
        run, opt = self.run, self.run.optimizer
        dt = time.perf_counter() - self.t0
        skipped = opt.check_nonfinite()   # raises at the limit (the device path's check)
        r = self._read(sums)
        self._update_noise(r.local_sq, r.averaged_sq, r.noise_steps)
        wait = (opt.sync_wait_s - self.sync0) / self.steps
        applied = r.last_skipped != 1.0  # a skipped step's norm and ratios were never applied
        scalars = {"loss": r.loss_sum / r.count if r.count else None,
                   "lr": run.schedule.lr(run.pos.global_step - 1),
                   "grad_norm": _finite_or_none(r.grad_norm) if applied else None,
                   **({} if math.isnan(r.trust[0]) else dict(zip(
                       ("trust_min", "trust_median", "trust_max"),
                       map(_finite_or_none, r.trust) if applied else (None,) * 3))),
                   "step_skipped": not applied,
                   "samples_per_s": self.samples / dt,
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
        running sums at the last log point) and ``log_carry`` (the earlier epochs' statistics
        since it, :meth:`end_epoch`), totals over the ranks; ``noise_sums`` (the
        interval's noise-scale sums, the local squared norms totalled over the ranks) and
        ``noise`` (the estimator's state, or None); plain floats, rank 0's to save."""
        base = torch.zeros(3, dtype=torch.float64) if self._last is None else self._last
        noise = self._noise_sums.double().cpu()
        vec = torch.cat([base.double().cpu(), self._carry.double().cpu(), noise[:1]])
        if self.run.comm.world_size > 1:
            self.run.comm.allreduce_(vec)
        base, carry, local_sq = vec.split([3, 3, 1])
        return {"log_base": base.tolist(), "log_carry": carry.tolist(),
                "noise_sums": [float(local_sq), *noise[1:].tolist()],
                "noise": None if self.noise is None else self.noise.state_dict()}

    def _load_state_dict(self, state: dict | None) -> None:
        """Continue from :meth:`state_dict` (None: a checkpoint written before it existed). The
        totals go to rank 0, the other ranks start from zeros, as the epoch's sums do."""
        if not state:
            return
        rank0 = self.run.comm.rank == 0
        base = torch.tensor(state["log_base"], dtype=torch.float64)
        self._resume_base = base if rank0 else torch.zeros_like(base)  # for a mid-epoch resume
        carry = torch.tensor(state.get("log_carry", [0.0] * 3), dtype=torch.float64)  # older: 0
        self._carry = (carry if rank0 else torch.zeros_like(carry)).to(self.run.device)
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


def _epoch_row(run: Run, epoch: int, sums: torch.Tensor, seconds: float, resumed: bool,
               steplog: StepLog, first: torch.Tensor | None) -> dict:
    comm = run.comm
    skipped = run.optimizer.check_nonfinite()  # raises at the limit of skips in a row
    _resolve_first_loss(run, first)
    sums = sums.to(device="cpu", dtype=torch.float64, copy=True)  # never reduce in place
    if comm.world_size > 1:
        comm.allreduce_(sums)
    train_metrics = run.task.train_metrics(sums, seconds)
    average_buffers(run.model, comm)  # BatchNorm statistics: the same on every rank
    eval_metrics = run.task.evaluate(run.model, comm)
    rates = {k: (None if resumed else v) for k, v in train_metrics.items() if k.endswith("_per_s")}
    row = {"epoch": epoch + 1, "step": run.pos.global_step,
           **{k: v for k, v in train_metrics.items() if not k.endswith("_per_s")},
           **eval_metrics, "lr": run.schedule.lr(run.pos.global_step - 1), **rates,
           "epoch_time_s": seconds, "elapsed_s": run.elapsed_s(),
           "skipped_steps": skipped, **steplog.epoch_fields()}
    _check_diverged(run, epoch, row["train_loss"], eval_metrics)
    return row


def _check_diverged(run: Run, epoch: int, train_loss: float, eval_metrics: dict) -> None:
    """Raise :class:`Diverged` (the same on every rank: the numbers are reduced) when a metric is
    not finite or the training loss exploded relative to step 1's."""
    kept = (f"the last checkpoint, {run.store.latest_path}, is kept" if run.store.exists()
            else "no checkpoint was written before it")
    where = f"global step {run.pos.global_step}, epoch {epoch + 1}; {kept}"
    bad = [m for m, v in {"train_loss": train_loss, **eval_metrics}.items()
           if isinstance(v, float) and not math.isfinite(v)]
    if bad and "train_loss" not in bad and _weights_finite(run):
        raise Diverged(f"non-finite {', '.join(bad)} at the end of the epoch while the training "
                       f"loss ({train_loss:.4g}) and every weight are finite: the evaluation "
                       f"made it, most likely a non-finite value in the test split (check the "
                       f"data) or a metric that overflows, not the training ({where})",
                       step=run.pos.global_step)
    if bad:
        raise Diverged(f"non-finite {', '.join(bad)} at the end of the epoch ({where})",
                       step=run.pos.global_step)
    first = run.pos.first_loss
    if first and first > 0 and train_loss > EXPLODED_LOSS_FACTOR * first:
        raise Diverged(f"the training loss exploded to {train_loss:.3g} from {first:.3g} at step "
                       f"1 (more than {EXPLODED_LOSS_FACTOR:g}x) ({where})",
                       step=run.pos.global_step)


def _weights_finite(run: Run) -> bool:
    """Whether every parameter of the model is finite (one device read; the replicas agree)."""
    params = [p.detach() for p in run.model.parameters()]
    return not params or bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def _resolve_first_loss(run: Run, first: torch.Tensor | None) -> None:
    """Set ``run.pos.first_loss`` from ``first`` (the first applied step's statistics, summed
    over the ranks: a collective, once per epoch end or checkpoint until it is known)."""
    if run.pos.first_loss is not None or first is None:
        return
    t = torch.stack([first[LOSS_SUM], first[COUNT]]).double().cpu()
    if run.comm.world_size > 1:
        run.comm.allreduce_(t)
    if t[1] > 0:
        run.pos.first_loss = float(t[0] / t[1])


def _diverged(run: Run, e: NonFiniteError, where: str) -> Diverged:
    kept = (f"the last finite checkpoint is kept in {run.store.latest_path}"
            if run.store.exists() else "no checkpoint was written before it")
    return Diverged(f"{e} ({where}); {kept}", step=e.step)


def i_first(run: Run, epoch: int, begin: int) -> bool:
    """Whether this epoch's first step is this process's first step of the run."""
    return epoch == run.pos.epoch and begin == (run.pos.step_in_epoch if run.resumed_from
                                                else 0)


def _run_epoch(run: Run, epoch: int, preempt: PreemptionFlag, steplog: StepLog, say,
               progress: Progress) -> dict:
    """One epoch (from the resumed step); returns its row. Raises Preempted, Diverged."""
    task, pos, sched = run.task, run.pos, run.schedule
    task.start_epoch(epoch)
    run.optimizer.sync.reset_epoch()
    spe = sched.steps_per_epoch
    steps = min(spe, sched.total_steps - epoch * spe)
    begin = pos.step_in_epoch if epoch == pos.epoch else 0
    if begin:
        task.load_state_dict(run.resumed_from.get("task"))  # resumed mid-epoch
    sums = (pos.epoch_sums.clone() if begin else torch.zeros(3, dtype=torch.float64)).to(run.device)
    steplog.start_epoch(sums, resumed=bool(begin))
    first = None if pos.first_loss is not None else \
        torch.zeros(3, dtype=torch.float64, device=run.device)
    t_epoch = time.perf_counter()
    progress.start_epoch(epoch, begin, steps, pos.global_step)
    if run.cfg.compile and i_first(run, epoch, begin):
        progress.note(f"compiling the model (torch.compile, mode {run.cfg.compile}): the first "
                      f"steps take longer")
    for i in range(begin, steps):
        at = pos.global_step + 1  # the step raising (the host path) or logging (device path)
        try:
            if run.profiler is not None:
                run.profiler.before_step(pos.global_step)
            stepped = train_step(run, i, sums, first)
            steplog.after_step(sums, stepped, i)  # step lines (a log point checks the skip
            if run.profiler is not None:          # limit) and the progress bar or line
                run.profiler.after_step(pos.global_step)
        except NonFiniteError as e:
            raise _diverged(run, e, f"global step {at}, epoch {epoch + 1}, step {i + 1}/"
                                    f"{steps}") from e
        stop = preempt.agreed(run.comm)  # one allreduce: a signal on any rank, rank 0's clock
        if stop or preempt.checkpoint_now:
            _checkpoint_mid_epoch(run, epoch, i, steps, sums, first, steplog, preempt, say, stop)
    steplog.end_epoch(sums)  # its steps since the last line stay in the next line
    progress.end_epoch()
    try:
        return _epoch_row(run, epoch, sums, time.perf_counter() - t_epoch, bool(begin), steplog,
                          first)
    except NonFiniteError as e:
        raise _diverged(run, e, f"global step {pos.global_step}, end of epoch {epoch + 1}") from e


def _checkpoint_mid_epoch(run: Run, epoch: int, i: int, steps: int, sums: torch.Tensor,
                          first: torch.Tensor | None, steplog: StepLog,
                          preempt: PreemptionFlag, say, stop: bool) -> None:
    """After step ``i``: the checkpoint the ranks agreed on (``preempt.agreed``); with ``stop``
    (a signal on some rank) every rank then raises Preempted."""
    _resolve_first_loss(run, first)
    save_run_checkpoint(run, epoch, i + 1, sums, steplog.state_dict())
    preempt.checkpoint_saved()
    if not stop:
        return
    pos = run.pos
    where = (f"checkpoint of global step {pos.global_step} (epoch {epoch + 1}, step "
             f"{i + 1}/{steps}) saved to {run.store.latest_path}")
    preempt.requested = True  # on every rank, also those the signal missed
    if preempt.interrupted:
        say(f"interrupted (Ctrl-C): {where}; --resume continues from it")
        raise Preempted(pos.global_step, "interrupted")
    say(f"preempted: {where}; exiting with {PREEMPTED_EXIT_CODE} to requeue")
    raise Preempted(pos.global_step)


def train(cfg: RunConfig, comm: Communicator, *, quiet: bool = False,
          checkpoint_interval_s: float | None = None,
          tensorboard: bool | None = None,
          profile: tuple[int, int] | None = None,
          progress_every_s: float | None = 60.0,
          ignore_ctrl_c_when_done: bool = False) -> dict[str, Any]:
    """Run one experiment on this rank; returns the summary (identical on every rank).

    ``checkpoint_interval_s``: also checkpoint mid-epoch when this many seconds (rank 0's clock)
    have passed since the last checkpoint (None/0: at epoch ends and on preemption only).
    ``tensorboard``: False writes no event files (None: when the package is installed).
    ``progress_every_s``: on rank 0, a progress line every this many seconds during an epoch
    when stderr is not a terminal (a bar on a terminal; None/0: no lines;
    :mod:`hpclb.train.progress`).
    ``ignore_ctrl_c_when_done``: ignore SIGINT from the moment training is done (before the
    summary is written) for the rest of the process, as ``hpclb train`` wants: nothing is left
    for a Ctrl-C to interrupt, and a finished run must not exit 130 (CPython keeps an ignored
    signal ignored through its teardown). False (a sweep): the caller's handler is back.
    ``profile``: ``(START, END)`` global steps to trace with torch.profiler into
    ``<out>/profile/rank<r>/`` (:mod:`hpclb.train.profile`; ConfigError when END is past the
    run's last step).

    Raises ConfigError (bad settings, same on every rank), DataError (missing/corrupt data),
    CheckpointError (``--resume`` without a usable checkpoint), :class:`Preempted` after a
    preemption checkpoint, :class:`Diverged` when the run stops on non-finite values.
    """
    check_checkpoint_interval(checkpoint_interval_s)
    say = report.Say(comm.rank == 0 and not quiet)
    _set_threads(comm)
    run = setup_run(cfg, comm, profile=profile)
    # before the header: a Ctrl-C then checkpoints
    preempt = PreemptionFlag(interrupt=True, checkpoint_interval_s=checkpoint_interval_s)
    logger = None
    try:
        report.header(run, say)
        report.write_config(run)
        logger = RunLogger(run.out, enabled=comm.rank == 0, tensorboard=tensorboard,
                           resume_step=run.pos.global_step if run.resumed_from is not None
                           else None)
        _epochs(run, say, logger, preempt, progress_every_s)
    except Diverged as d:  # the run directory says so (`hpclb compare`: diverged, not cut)
        if logger is not None:
            logger.log_diverged(run.pos.global_step if d.step is None else d.step, str(d))
        raise
    finally:
        # After a preemption the flag handlers stay: the job script forwards the scheduler's
        # signal too, and a second USR2/TERM must not kill a rank on its way out with 75.
        if not preempt.requested:
            preempt.restore()
        if logger is not None:
            logger.close()
        run.close()  # hooks, loader workers, the run directory's lock
    if ignore_ctrl_c_when_done:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    summary = report.summary(run)
    if comm.rank == 0:
        write_json(run.out / "summary.json", summary, RUN_KEPT)
    say(report.summary_line(run, summary))
    return summary


def _epochs(run: Run, say: report.Say, logger: RunLogger, preempt: PreemptionFlag,
            progress_every_s: float | None) -> None:
    """Every epoch left: its steps, its line and its checkpoint."""
    cfg, sched = run.cfg, run.schedule
    n_epochs = math.ceil(sched.total_steps / sched.steps_per_epoch)
    shown = n_epochs if float(cfg.epochs).is_integer() else cfg.epochs  # "epoch 1/0.5"
    progress = Progress(say.enabled, n_epochs=shown, total_steps=sched.total_steps,
                        global_batch=cfg.global_batch_size, every_s=progress_every_s)
    steplog = StepLog(run, logger, progress)
    preempt.checkpoint_saved()  # the periodic checkpoints' clock starts with the first epoch
    for epoch in range(run.pos.epoch, n_epochs):
        row = _run_epoch(run, epoch, preempt, steplog, say, progress)
        run.pos.history.append(row)
        logger.log_epoch(row)
        steplog.epoch_histograms()
        say(report.epoch_line(row, shown))
        save_run_checkpoint(run, epoch + 1, 0, torch.zeros(3, dtype=torch.float64),
                            steplog.state_dict())
        preempt.checkpoint_saved()


