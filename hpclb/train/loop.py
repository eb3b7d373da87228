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
4. After each step one call, ``StepLog.after_step``, logs and shows it: every ``log_every``
   steps one ``kind: step`` line (loss, LR, gradient norm, trust ratios, samples/s, compute vs
   exposed communication, skipped steps, device memory) goes to ``metrics.jsonl`` and
   TensorBoard (:mod:`hpclb.train.metrics`), statistics staying on the device in between; on
   rank 0 the progress bar or line when due. At each epoch end: metrics reduced over ranks,
   BatchNorm buffers averaged, evaluation,
   an epoch line, a checkpoint.

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
import socket
import sys
import time
from typing import Any

import torch

from hpclb._io import write_json
from hpclb.comm.base import Communicator
from hpclb.config import RunConfig, check_checkpoint_interval
from hpclb.data.paths import data_dir
from hpclb.errors import PREEMPTED_EXIT_CODE, Diverged, NonFiniteError, Preempted
from hpclb.schedules import set_lr
from hpclb.sync.agree import average_buffers
from hpclb.tasks.spec import metric_mode
from hpclb.train.checkpointer import save_run_checkpoint
from hpclb.train.metrics import RunLogger
from hpclb.train.preemption import PreemptionFlag
from hpclb.train.progress import Progress
from hpclb.train.setup import Run, setup_run
from hpclb.train.steplog import StepLog

__all__ = ["EXPLODED_LOSS_FACTOR", "train_step", "train"]

# An epoch's training loss this many times the first applied (not skipped) step's (both finite,
# > 0) is a divergence: a cross-entropy that starts at ln(classes) never legitimately grows a
# hundredfold. docs/faults.md states it (tests/test_faults_doc.py).
EXPLODED_LOSS_FACTOR = 1e2


def _show(metric: str, value: float) -> str:
    if "accuracy" in metric:
        return f"{100 * value:6.2f}%"
    return f"{value:.2f}" if "perplexity" in metric or "bleu" in metric else f"{value:.4f}"


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
            first.copy_(torch.where(first[2] > 0, first, sums - before))
    run.pos.global_step += 1
    return stepped


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
    t = torch.stack([first[0], first[2]]).double().cpu()
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


class _Say:
    """Rank 0's console lines (nothing elsewhere, or when quiet). A closed standard output
    (``hpclb train ... | head``) ends the lines, not the run: stdout then goes to /dev/null."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, *args) -> None:
        if not self.enabled:
            return
        try:
            print(*args, flush=True)
        except (BrokenPipeError, ValueError):
            self.enabled = False
            devnull = os.open(os.devnull, os.O_WRONLY)
            with contextlib.suppress(OSError, ValueError):
                os.dup2(devnull, sys.stdout.fileno())  # the exit's flush must not fail either
            os.close(devnull)


def _header(run: Run, say: _Say) -> None:
    from hpclb.comm.device import device_info

    cfg, comm, sched = run.cfg, run.comm, run.schedule
    info = device_info(run.device)
    k = cfg.global_batch_size / cfg.base_batch_size
    if run.resumed_from is not None:
        say(f"resumed from {run.resumed_path} at global step {run.pos.global_step} (epoch "
            f"{run.pos.epoch + 1}, step {run.pos.step_in_epoch} of it)")
    mem = f", {info['memory_bytes'] / 2**30:.0f} GiB" if info.get("memory_bytes") else ""
    say(f"hpclb {cfg.experiment}: {comm.world_size} rank(s) [{comm.backend}] on {info['device']} "
        f"({info['name']}{mem}), precision {cfg.precision}, global batch {cfg.global_batch_size} "
        f"= {comm.world_size} x {run.per_rank_batch} (B0 {cfg.base_batch_size}, k = {k:g}), "
        f"accumulation_steps {cfg.accumulation_steps} (micro-batch {run.micro_batch}), scaling "
        f"{cfg.scaling}, optimizer {cfg.optimizer}, compile {cfg.compile or 'off (eager)'}")
    say(f"  peak LR {sched.peak_lr:.4g} (B0: {cfg.base_lr:.4g}), warmup {sched.warmup_steps} steps "
        f"= {sched.warmup_epochs:.3g} epochs, decay {sched.decay}, {sched.steps_per_epoch} "
        f"steps/epoch, {sched.total_steps} steps in {cfg.epochs:g} epochs, "
        f"{run.task.num_train_samples} train / {run.task.num_test_samples} test samples "
        f"({run.task.kind}), gradient buffer {run.optimizer.sync.nbytes / 2**20:.2f} MiB")


def train(cfg: RunConfig, comm: Communicator, *, quiet: bool = False,
          checkpoint_interval_s: float | None = None,
          tensorboard: bool | None = None,
          profile: tuple[int, int] | None = None,
          progress_every_s: float | None = 60.0) -> dict[str, Any]:
    """Run one experiment on this rank; returns the summary (identical on every rank).

    ``checkpoint_interval_s``: also checkpoint mid-epoch when this many seconds (rank 0's clock)
    have passed since the last checkpoint (None/0: at epoch ends and on preemption only).
    ``tensorboard``: False writes no event files (None: when the package is installed).
    ``progress_every_s``: on rank 0, a progress line every this many seconds during an epoch
    when stderr is not a terminal (a bar on a terminal; None/0: no lines;
    :mod:`hpclb.train.progress`).
    ``profile``: ``(START, END)`` global steps to trace with torch.profiler into
    ``<out>/profile/rank<r>/`` (:mod:`hpclb.train.profile`; ConfigError when END is past the
    run's last step).

    Raises ConfigError (bad settings, same on every rank), DataError (missing/corrupt data),
    CheckpointError (``--resume`` without a usable checkpoint), :class:`Preempted` after a
    preemption checkpoint, :class:`Diverged` when the run stops on non-finite values.
    """
    check_checkpoint_interval(checkpoint_interval_s)
    say = _Say(comm.rank == 0 and not quiet)
    _set_threads(comm)
    run = setup_run(cfg, comm, profile=profile)
    # before the header: a Ctrl-C then checkpoints
    preempt = PreemptionFlag(interrupt=True, checkpoint_interval_s=checkpoint_interval_s)
    logger = None
    try:
        _header(run, say)
        if comm.rank == 0:
            run.out.mkdir(parents=True, exist_ok=True)
            write_json(run.out / "config.json", {
                **cfg.to_dict(), "world_size": comm.world_size,
                "data_root": str(data_dir(cfg.data_dir).resolve()),
                **_schedule_columns(cfg, run.schedule),
                "sync": _sync_settings(run), "trust_backend": _trust_backend()})
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
    summary = _summary(run)
    if comm.rank == 0:
        write_json(run.out / "summary.json", summary)
    say(_summary_line(run, summary))
    return summary


def _sync_settings(run: Run) -> dict:
    """The gradient-sync settings in force (config.json's ``sync``), with ``overlap_setting``:
    the overlap asked for (``auto`` unless ``$HPCLB_OVERLAP`` set one) beside ``overlap``, the
    mode in force."""
    sync = run.optimizer.sync
    return {**sync.settings(), "overlap_setting": sync.options.overlap}


def _trust_backend() -> str:
    """``$HPCLB_TRUST_BACKEND`` in force (``auto`` when unset): recorded in config.json."""
    return os.environ.get("HPCLB_TRUST_BACKEND", "auto").strip() or "auto"


def _epochs(run: Run, say: _Say, logger: RunLogger, preempt: PreemptionFlag,
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
        say(_epoch_line(row, shown))
        save_run_checkpoint(run, epoch + 1, 0, torch.zeros(3, dtype=torch.float64),
                            steplog.state_dict())
        preempt.checkpoint_saved()


def _epoch_line(row: dict, n_epochs: float) -> str:
    evaluated = {m: v for m, v in row.items() if m.startswith(("valid_", "test_"))}
    shown = "  ".join(f"{m} {_show(m, v)}" for m, v in evaluated.items())
    sps = f"{row['samples_per_s']:9,.0f}" if row.get("samples_per_s") else "   (resumed)"
    skipped = f"  skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
    return (f"epoch {row['epoch']:3d}/{n_epochs:g}  loss {row['train_loss']:.4f}  {shown}  "
            f"lr {row['lr']:.3e}  samples/s {sps}  {row['epoch_time_s']:5.1f}s{skipped}")


def _summary(run: Run) -> dict:
    from hpclb.comm.device import device_info

    cfg, history, sched = run.cfg, run.pos.history, run.schedule
    target = cfg.spec.target
    metric = target.metric if target else None
    mode = (target.mode if target else None) or metric_mode(metric or "")
    value = target.value if target and target.value is not None else \
        (math.inf if mode == "max" else -math.inf)
    reached = [r for r in history if r.get(metric) is not None and
               (r[metric] >= value if mode == "max" else r[metric] <= value)]
    rates = [r["samples_per_s"] for r in history if r.get("samples_per_s")]
    evaluated = [m for m in history[-1] if m.startswith(("valid_", "test_"))]
    task = run.task
    return {
        "experiment": cfg.experiment, "task": task.kind,
        **({"decoding": task.decoding} if task.decoding else {}),
        **{f"final_{m}": history[-1][m] for m in evaluated},
        **{f"best_{m}": (max if metric_mode(m, cfg.spec) == "max" else min)(r[m] for r in history)
           for m in evaluated},
        "metric_name": metric, "global_batch_size": cfg.global_batch_size,
        "per_rank_batch_size": run.per_rank_batch,
        "accumulation_steps": cfg.accumulation_steps, "micro_batch_size": run.micro_batch,
        "base_batch_size": cfg.base_batch_size,
        "batch_ratio_k": cfg.global_batch_size / cfg.base_batch_size,
        "world_size": run.comm.world_size, "backend": run.comm.backend,
        "device": device_info(run.device), "precision": cfg.precision, "epochs": cfg.epochs,
        "steps": run.pos.global_step, "steps_per_epoch": sched.steps_per_epoch,
        "skipped_steps": run.optimizer.skipped_steps, "scaling": cfg.scaling,
        "optimizer": cfg.optimizer, "base_lr": cfg.base_lr, "peak_lr": sched.peak_lr,
        "warmup_steps": sched.warmup_steps, "warmup_epochs": sched.warmup_epochs,
        "warmup_start_lr": sched.warmup_start_lr, "decay": cfg.recipe["decay"],
        "seed": cfg.seed, "wall_time_s": run.elapsed_s(),
        "mean_samples_per_s": sum(rates) / len(rates) if rates else None,
        "target": cfg.recipe.get("target") or None,
        "time_to_target_s": reached[0]["elapsed_s"] if reached else None,
        "torch": torch.__version__, "host": socket.gethostname(),
    }


def _schedule_columns(cfg: RunConfig, sched) -> dict[str, Any]:
    """The schedule of a run, known before its first step (in ``config.json``, where a sweep
    reads it for a point that diverged): ``batch_ratio_k``, ``base_lr``, ``peak_lr``,
    ``warmup_steps``, ``warmup_epochs``, ``warmup_start_lr``, ``decay`` (the recipe's),
    ``steps_per_epoch``."""
    return {"batch_ratio_k": cfg.global_batch_size / cfg.base_batch_size,
            "base_lr": cfg.base_lr, "peak_lr": sched.peak_lr, "warmup_steps": sched.warmup_steps,
            "warmup_epochs": sched.warmup_epochs, "warmup_start_lr": sched.warmup_start_lr,
            "decay": cfg.recipe["decay"], "steps_per_epoch": sched.steps_per_epoch}


def _summary_line(run: Run, summary: dict) -> str:
    cfg, task = run.cfg, run.task
    metric = summary["metric_name"]
    evaluated = [m[len("final_"):] for m in summary if m.startswith("final_")]
    shown = metric if metric in evaluated else evaluated[-1]
    how = f" (decoding: {task.decoding})" if task.decoding and "bleu" in shown else ""
    target = summary.get("target") or {}
    if target.get("metric") == shown and summary.get("time_to_target_s") is None:
        how += f" (target {_show(shown, target['value']).strip()} not reached)"
    return (f"summary: {cfg.experiment} {cfg.scaling} global batch {cfg.global_batch_size} "
            f"(k={summary['batch_ratio_k']:g}) on {run.comm.world_size} rank(s): {shown} "
            f"{_show(shown, summary['final_' + shown]).strip()}{how} after {cfg.epochs:g} epochs "
            f"({run.pos.global_step} steps) in {summary['wall_time_s']:.1f} s -> "
            f"{run.out / 'summary.json'}")
