"""Setting up one run on one rank, resuming it, and checkpointing it.

:func:`setup_run` takes every start-up decision that ranks must share so that a disagreement ends
every rank with the message, never a hang: settings, data, the out directory and the checkpoint
are checked inside :func:`agreed` (every rank runs the check, then all compare verdicts), and the
resume-or-start decision is rank 0's, broadcast. Then, in this order: the device is bound (by the
communicator), the model is built on it, checked and broadcast, each rank gets its own random
streams (:mod:`hpclb.train.rng`), the optimizer is wrapped in
:class:`~hpclb.sync.optimizer.DistributedOptimizer`
(its GradientSync's buckets hold the gradients on the device), and a checkpoint, if any, is loaded
onto whatever device this run uses.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpclb.comm.base import Communicator
from hpclb.config import RunConfig
from hpclb.config.agreement import agree_run_settings, run_settings
from hpclb.config.outputs import check_run_dir, clear_run, start_run
from hpclb.errors import CheckpointError, ConfigError
from hpclb.models import build_model
from hpclb.noise import check_world_size
from hpclb.optim import OPTIMIZERS
from hpclb.optim.lr_scheduler import ScheduleLR
from hpclb.plugins import is_plugin
from hpclb.schedules import Schedule
from hpclb.sync.agree import broadcast_parameters, check_model_consistency
from hpclb.sync.optimizer import DistributedOptimizer
from hpclb.tasks import Task, build_task
from hpclb.train.agreed import agreed
from hpclb.train.checkpoint import CheckpointStore
from hpclb.train.checkpointer import restore_state
from hpclb.train.profile import StepProfiler, check_profile_window
from hpclb.train.rng import seed_rank
from hpclb.train.usercode import describe

__all__ = ["LOCK_NAME", "MODEL_FIELDS", "PRECISIONS", "Position", "Run", "build_optimizer",
           "build_recipe_model", "check_model", "check_resumable", "setup_run"]

log = logging.getLogger(__name__)
LOCK_NAME = ".hpclb.lock"
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Position:
    """Where a run is: ``epoch`` and ``step_in_epoch`` (the next step to run), ``global_step``
    (optimizer steps done), ``elapsed_s`` (seconds of earlier attempts), ``epoch_sums`` (this
    epoch's float64 ``[3]`` task sums so far, totals over ranks), ``history`` (epoch rows),
    ``first_loss`` (step 1's training loss, the reference of the divergence check)."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    elapsed_s: float = 0.0
    epoch_sums: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    history: list = field(default_factory=list)
    first_loss: float | None = None  # the mean training loss of global step 1 (all ranks)


@dataclass
class Run:
    """Everything one rank trains with (built by :func:`setup_run`)."""

    cfg: RunConfig
    comm: Communicator
    device: torch.device
    task: Task
    schedule: Schedule
    model: nn.Module
    optimizer: DistributedOptimizer
    scheduler: ScheduleLR
    store: CheckpointStore
    pos: Position
    per_rank_batch: int
    micro_batch: int
    autocast_dtype: torch.dtype | None
    resumed_from: dict | None = None
    resumed_path: str | None = None
    out_lock: Any = None
    profiler: Any = None  # hpclb.train.profile.StepProfiler (--profile), else None
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def out(self) -> Path:
        return self.store.out_dir

    def elapsed_s(self) -> float:
        return self.pos.elapsed_s + time.perf_counter() - self.t_start

    def close(self) -> None:
        """Release the communicator (the optimizer's hooks and thread), the image loader's
        workers and rank 0's lock on the run directory; write an open profiler trace."""
        if self.profiler is not None:
            self.profiler.close()  # a run stopped inside the window: its trace so far
        self.optimizer.close()
        loader = getattr(self.task, "_step_loader", None)
        if loader is not None:
            loader.close()
        if self.out_lock is not None:
            self.out_lock.close()
            self.out_lock = None

    def autocast(self):
        """The forward's precision context (bf16/fp16 autocast; fp32: nothing)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if self.device.type == "cpu" and any(isinstance(m, nn.RNNBase)
                                             for m in self.model.modules()):
            # oneDNN has no low-precision LSTM kernel on CPUs without AVX512-BF16/AMX; PyTorch's
            # own LSTM kernels run bf16/fp16 everywhere
            stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        return stack


def build_optimizer(name: str, model: nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer ``name`` (:data:`hpclb.optim.OPTIMIZERS`) over ``model``'s named parameters
    with the recipe's ``params``.

    Raises ConfigError for an unknown optimizer, or a hyper-parameter it does not take or
    rejects.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}")
    builder = OPTIMIZERS.load(name)
    try:
        return builder(list(model.named_parameters()), **dict(params))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizers.{name}: {e}") from e


def _local_checks(cfg: RunConfig, comm: Communicator, profile: tuple[int, int] | None):
    """Everything a rank checks before any work: batch split, data, schedule, the profiled
    steps."""
    per_rank = cfg.per_rank_batch_size(comm.world_size)
    micro = cfg.micro_batch_size(comm.world_size)  # B % (W * K): fails before any work
    check_world_size(cfg.noise_scale, comm.world_size)  # --noise-scale needs >= 2 ranks
    data = cfg.spec.data
    task = build_task(cfg.spec, cfg.data_dir, train_samples=data.train_samples,
                      test_samples=data.test_samples)
    sched = cfg.schedule(task.num_train_samples)
    check_profile_window(profile, sched.total_steps)  # --profile: inside the run
    check_model(cfg, task.model_kwargs)  # before --overwrite deletes anything
    return per_rank, micro, task, sched


def _lock_out(out: Path):
    """Rank 0's exclusive lock on the run directory for the whole run (``flock`` on
    ``.hpclb.lock``; released by the kernel when the process ends, even killed). Raises
    ConfigError when another run holds it; on a file system without locks, warns and goes on."""
    import fcntl

    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / LOCK_NAME, "a+")
    except OSError as e:  # not a directory, no permission, read-only file system
        raise ConfigError(f"--out {out}: cannot create the run directory or its lock ({e}); "
                          f"choose another --out") from e
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"--out {out}: another hpclb train ({holder}) is writing to this run "
                          f"directory; wait for it, or choose another --out") from None
    except OSError as e:  # e.g. a network file system mounted without locks
        log.warning("--out %s: cannot lock the run directory (%s); make sure no other run "
                    "writes to it", out, e)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def _decide_resume(cfg: RunConfig, comm: Communicator, store: CheckpointStore):
    """Rank 0 locks the run directory and decides (None: start afresh; else the checkpoint's
    path; ``--resume auto``: the newest checkpoint that verifies, else afresh); every rank
    loads it (the decision is broadcast). Returns ``(checkpoint or None, its path, rank 0's
    lock)``."""
    lock = []

    def decide():
        found = check_run_dir(store.out_dir, resume=bool(cfg.resume), overwrite=cfg.overwrite)
        lock.append(_lock_out(store.out_dir))
        path = _resume_path(cfg, store, found) if cfg.resume else None
        if found and not cfg.resume:  # --overwrite: no stale summary, metrics or checkpoint
            log.warning("--overwrite: deleting the run in %s (%s)", store.out_dir,
                        ", ".join(found))
            clear_run(store.out_dir)  # hpclb's files only
        start_run(store.out_dir)  # the marker: what this run writes is hpclb's
        return path
    try:
        return _load_decided(cfg, comm, agreed(comm, "checking --out and the checkpoint",
                                               lambda: decide() if comm.rank == 0 else None),
                             lock[0] if lock else None)
    except BaseException:
        if lock:
            lock[0].close()  # a failed start-up leaves the run directory free
        raise


def _resume_path(cfg: RunConfig, store: CheckpointStore, found: list[str]) -> str | None:
    """Rank 0's ``--resume`` decision: the checkpoint's path (checked against ``cfg``), or None
    (``--resume auto`` without one: start afresh)."""
    loaded = store.latest()
    if loaded is None and cfg.resume == "auto":
        return _start_afresh(store.out_dir, found)
    if loaded is None:  # a usage error, the same for every rank: exit 2
        raise ConfigError(f"--resume: no checkpoint to resume from in {store.out_dir}; "
                          f"drop --resume to start afresh (add --overwrite if the "
                          f"directory holds a run), or use --resume auto")
    for path, why in loaded.skipped:
        log.warning("--resume: skipped damaged checkpoint %s (%s); using %s", path, why,
                    loaded.path)
    check_resumable(cfg, loaded.state, loaded.path.resolve())  # before anything is written
    return str(loaded.path.resolve())


def _start_afresh(out: Path, found: list[str]) -> None:
    """``--resume auto`` without a checkpoint in ``out`` (rank 0): start afresh. The logs of a
    run stopped before its first checkpoint are replaced; a finished run (``summary.json``)
    whose checkpoints are gone is refused (ConfigError naming --overwrite), never deleted."""
    if "summary.json" in found:
        raise ConfigError(f"--resume auto: {out} holds a finished run without a checkpoint; "
                          f"add --overwrite (instead of --resume) to delete it ({', '.join(found)})"
                          f" and start afresh, or choose another --out")
    if found:
        log.warning("--resume auto: no checkpoint in %s, only the logs of a run stopped before "
                    "its first one (%s); starting afresh from step 0", out, ", ".join(found))
        clear_run(out)
    else:
        log.info("--resume auto: no checkpoint in %s; starting afresh", out)
    return None


def _load_decided(cfg: RunConfig, comm: Communicator, path: str | None, held):
    if comm.world_size > 1:
        path = comm.broadcast_object(path, 0)
    if path is None:
        return None, None, held

    def load():
        from hpclb.train.checkpoint import load_checkpoint
        try:
            return load_checkpoint(path)
        except (CheckpointError, OSError) as e:
            raise ConfigError(f"cannot read rank 0's checkpoint {path} ({e}); --out must be on "
                              f"a file system every rank sees") from e
    return agreed(comm, "loading the checkpoint", load), path, held


#: the recipe fields that fix the model's parameters (a checkpoint of others cannot be loaded)
MODEL_FIELDS = ("model", "task", "data.name")


def check_resumable(cfg: RunConfig, ckpt: dict, path) -> None:
    """Refuse (ConfigError) to resume ``cfg`` from the checkpoint ``ckpt`` read from ``path``
    where it was made with other settings (experiment, batch, scaling, optimizer, seed...) or
    another model: a recipe field of :data:`MODEL_FIELDS` (``model.hidden_size``...) other than
    the run's ``config.json`` in ``cfg.out`` records, named with both values, or a
    checkpoint without run settings (written by a library loop's ``hpclb.Checkpointer``)."""
    if not isinstance(ckpt.get("run"), dict):
        raise ConfigError(f"--resume: the checkpoint in {path} was written by a library loop "
                          f"(hpclb.Checkpointer), not by hpclb train: it holds no run settings "
                          f"(experiment, batch, scaling, optimizer, seed) to continue; resume it "
                          f"with that script's hpclb.Checkpointer, or use another --out")
    for key in ("experiment", "global_batch_size", "scaling", "optimizer", "seed", "epochs", "lr"):
        if ckpt["run"][key] != getattr(cfg, key):
            raise ConfigError(f"--resume: the checkpoint in {path} was made with {key}="
                              f"{ckpt['run'][key]!r}, this run has {getattr(cfg, key)!r}; resume "
                              f"with the same settings or use another --out")
    try:  # every start writes config.json after this check: its recipe is the checkpoint's
        saved = json.loads((Path(cfg.out) / "config.json").read_text())["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record: the parameters' shapes are checked when the checkpoint is loaded
    then, now = _model_fields(saved), _model_fields(json.loads(json.dumps(cfg.recipe)))
    for key in sorted(then.keys() | now.keys()):
        if then.get(key, _ABSENT) != now.get(key, _ABSENT):
            raise ConfigError(f"--resume: {key}: {_show(then.get(key, _ABSENT))} in the "
                              f"checkpoint's run, {_show(now.get(key, _ABSENT))} now (recipe "
                              f"{cfg.experiment}); the checkpoint in {path} holds another model: "
                              f"resume with the recipe it was made with, or use another --out")


_ABSENT = object()


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)


def _model_fields(recipe: dict) -> dict[str, Any]:
    """The :data:`MODEL_FIELDS` of ``recipe``, sections flattened to ``model.<field>``."""
    fields = {}
    for name in MODEL_FIELDS:
        section, _, key = name.partition(".")
        value = recipe.get(section)
        if key:
            value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
        if isinstance(value, dict):
            fields.update({f"{name}.{k}": v for k, v in value.items()})
        elif value is not _ABSENT:
            fields[name] = value
    return fields


def build_recipe_model(cfg: RunConfig, model_kwargs: dict[str, Any]) -> nn.Module:
    """``cfg``'s model: the recipe's ``model.name`` built with the recipe's model fields and
    the task's ``model_kwargs`` (set from the data, e.g. ``vocab_size``), on torch's default
    device. Raises ConfigError naming the recipe and ``model.<field>`` where the constructor
    refuses a value (ValueError/TypeError) or a plug-in returns no ``nn.Module``."""
    name = cfg.spec.model.name
    try:
        return build_model(name, **model_kwargs, **cfg.spec.model.kwargs)
    except ConfigError as e:
        cause = e.__cause__
        where = describe(cause) if is_plugin(name) and cause is not None else ""
        raise ConfigError(f"recipe {cfg.experiment}: {e}{where}") from e


def check_model(cfg: RunConfig, model_kwargs: dict[str, Any]) -> None:
    """What the run refuses before training about its model: build it (on the ``meta`` device,
    without memory; on the CPU where a constructor cannot run there) and its optimizer.
    Raises ConfigError as :func:`build_recipe_model` and :func:`build_optimizer` do."""
    try:
        with torch.device("meta"):
            model = build_recipe_model(cfg, model_kwargs)
    except Exception:  # noqa: BLE001 (the verdict of a build as the run's, on the CPU)
        model = build_recipe_model(cfg, model_kwargs)
    build_optimizer(cfg.optimizer, model, cfg.optimizer_params)


def _build_model(cfg: RunConfig, task: Task, device: torch.device) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (then broadcast)
    model = build_recipe_model(cfg, task.model_kwargs).to(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        if any(isinstance(m, nn.Conv2d) for m in model.modules()):
            model = model.to(memory_format=torch.channels_last)
    if cfg.compile:   # in place: the same module, parameters and state_dict keys as eager
        model.compile(mode=cfg.compile)
    return model


def warn_eager_rnns(model: nn.Module) -> None:
    """Warn that torch.compile leaves ``model``'s ``nn.RNNBase`` layers (LSTM, GRU, RNN) eager:
    dynamo's ``allow_rnn`` is off (hpclb leaves it so), the gain is limited to the others."""
    rnns = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if rnns:
        log.warning("--compile: torch.compile leaves the %s layer(s) eager (torch._dynamo's "
                    "allow_rnn is off), so the gain is limited to the other layers",
                    ", ".join(rnns))


def setup_run(cfg: RunConfig, comm: Communicator, device: torch.device | None = None,
              profile: tuple[int, int] | None = None) -> Run:
    """Build (or resume) the run of ``cfg`` on this rank; collective.

    ``device``: where the model, optimizer state and batches live (default the communicator's,
    bound by ``--device``; tests pass ``meta`` for a device dry run). ``profile``: the
    ``--profile`` window, checked against the run's steps with the other settings (then
    ``run.profiler`` traces it: :mod:`hpclb.train.profile`). Raises ConfigError (same on
    every rank), DataError, CheckpointError."""
    device = torch.device(device or getattr(comm, "device", "cpu"))
    agree_run_settings(comm, run_settings(cfg))  # ranks given other settings: all stop, exit 2
    # a run directory that may not be written is refused before any rank loads data
    agreed(comm, "checking --out", lambda: check_run_dir(
        cfg.out, resume=bool(cfg.resume), overwrite=cfg.overwrite) if comm.rank == 0 else None)
    per_rank, micro, task, sched = agreed(comm, "checking settings and data",
                                          lambda: _local_checks(cfg, comm, profile))
    store = CheckpointStore(cfg.out, keep=cfg.keep_checkpoints)
    ckpt, ckpt_path, out_lock = _decide_resume(cfg, comm, store)
    try:
        return _build(cfg, comm, device, task, sched, store, per_rank, micro, ckpt, ckpt_path,
                      out_lock, profile)
    except BaseException:
        if out_lock is not None:
            out_lock.close()
            _forget_empty_start(store.out_dir)
        raise


def _forget_empty_start(out: Path) -> None:
    """After a start-up that failed before the run wrote anything: remove the lock and the
    marker it left, and the directory when that leaves it empty (no ``--out`` holding only
    ``.hpclb.lock``). A directory that holds a run's files keeps them all; other files stay."""
    from hpclb.config.outputs import RUN_MARKER, run_files

    try:
        if not run_files(out):
            for name in (LOCK_NAME, RUN_MARKER):
                (out / name).unlink(missing_ok=True)
            if not any(out.iterdir()):
                out.rmdir()
    except OSError:
        pass  # best effort: the start-up error is what the user needs to see


def prescale_exactly(divisor: int, scaler) -> bool:
    """Whether the loop scales each micro-batch's loss by ``1 / divisor`` (``world_size *
    accumulation_steps``) instead of the GradientSync dividing every gradient after the sum
    (``loss_prescaled``): when ``divisor`` is a power of two above 1, where both are the same
    exact scaling, and without an fp16 loss scaler (whose scale already sits near fp16's
    range)."""
    return divisor > 1 and divisor & (divisor - 1) == 0 and scaler is None


def _build(cfg, comm, device, task, sched, store, per_rank, micro, ckpt, ckpt_path,
           out_lock, profile) -> Run:
    """The model, optimizer, schedule and task of :func:`setup_run`, restored from ``ckpt``."""
    model = _build_model(cfg, task, device)
    if cfg.compile and comm.rank == 0:
        warn_eager_rnns(model)
    check_model_consistency(model, comm)
    broadcast_parameters(model, comm)
    seed_rank(cfg.seed, comm.rank)  # ranks share parameters, never randomness (dropout)
    scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
    inner = build_optimizer(cfg.optimizer, model, cfg.optimizer_params)
    optimizer = DistributedOptimizer(inner, model, comm=comm,
                                     accumulation_steps=cfg.accumulation_steps,
                                     step_after="full_window",  # train_step: K counted
                                     grad_clip_norm=cfg.spec.grad_clip_norm,
                                     max_nonfinite_steps=cfg.max_nonfinite_steps, scaler=scaler,
                                     track_local_norm=cfg.noise_scale and comm.world_size > 1,
                                     loss_prescaled=prescale_exactly(
                                         comm.world_size * cfg.accumulation_steps, scaler))
    scheduler = ScheduleLR(inner, sched)
    task.setup(per_rank_batch=per_rank, global_batch=cfg.global_batch_size, rank=comm.rank,
               world_size=comm.world_size, seed=cfg.seed, steps_per_epoch=sched.steps_per_epoch,
               device=device)
    run = Run(cfg, comm, device, task, sched, model, optimizer, scheduler, store, Position(),
              per_rank, micro, PRECISIONS[cfg.precision])
    run.out_lock, run.resumed_path = out_lock, ckpt_path
    if ckpt is not None:
        _restore(run, ckpt)
    if profile is not None:
        run.profiler = StepProfiler(profile, run.out, comm, device, run.pos.global_step)
    return run


def _check_shapes(run: Run, saved: dict) -> None:
    """ConfigError when the checkpoint's model state ``saved`` does not fit ``run.model`` (a
    parameter or buffer missing or of another shape): a checkpoint of another model."""
    mine = run.model.state_dict()
    for key in sorted(saved.keys() | mine.keys()):
        there, here = _shape(saved, key), _shape(mine, key)
        if there != here:
            raise ConfigError(
                f"--resume: the checkpoint in {run.resumed_path} holds another model than recipe "
                f"{run.cfg.experiment}'s (model.name {run.cfg.spec.model.name!r}): {key} is "
                f"{there} there, {here} in this run's model; resume with the recipe it was made "
                f"with (its model section), or use another --out")


def _shape(state: dict, key: str) -> str:
    value = state.get(key, _ABSENT)
    return "absent" if value is _ABSENT else str(list(getattr(value, "shape", ())))


def _restore(run: Run, ckpt: dict) -> None:
    """Load the checkpoint ``ckpt`` (:mod:`hpclb.train.checkpointer`'s schema) into ``run``:
    model, optimizer, scheduler, position, this rank's RNG streams."""
    _check_shapes(run, ckpt["model"])
    fields = {k: ckpt[k] for k in ("epoch", "step_in_epoch", "elapsed_s", "epoch_sums",
                                   "history")}
    step = restore_state(ckpt, run.model, run.optimizer, run.scheduler, comm=run.comm,
                         seed=run.cfg.seed)
    run.pos = Position(**fields, global_step=step, first_loss=ckpt.get("first_loss"))
    if run.comm.rank != 0:  # the saved sums are already totals over ranks: count them once
        run.pos.epoch_sums = torch.zeros_like(run.pos.epoch_sums)
    run.resumed_from = ckpt
