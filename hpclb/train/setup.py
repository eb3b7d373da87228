"""Building one run on one rank from the start it is handed.

:func:`setup_run` takes every start-up decision that ranks must share so that a disagreement ends
every rank with the message, never a hang: settings and data are checked inside :func:`agreed`
(every rank runs the check, then all compare verdicts); the run directory and the
resume-or-start decision are :mod:`hpclb.train.rundir`'s (rank 0's, broadcast), after the ranks
agree on the code and data they train with (:func:`~hpclb.config.agreement.run_fingerprint`,
compared with the checkpoint's on ``--resume``). Then, from that
:class:`~hpclb.train.rundir.Decision`, in this order: the device is bound (by the
communicator), the model is built on it, checked and broadcast, each rank gets its own random
streams (:mod:`hpclb.train.rng`), the optimizer is wrapped in
:class:`~hpclb.sync.optimizer.DistributedOptimizer`
(its GradientSync's buckets hold the gradients on the device), and a checkpoint, if any, is loaded
onto whatever device this run uses.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpclb.comm.base import Communicator
from hpclb.comm.device import select_device
from hpclb.config import RunConfig
from hpclb.config.agreement import (
    agree_fingerprint,
    agree_run_settings,
    run_fingerprint,
    run_settings,
)
from hpclb.errors import ConfigError
from hpclb.models import build_model
from hpclb.noise import check_world_size
from hpclb.optim import OPTIMIZERS
from hpclb.plugins import is_plugin
from hpclb.schedules import Schedule
from hpclb.sync.agree import broadcast_parameters, check_model_consistency
from hpclb.sync.optimizer import DistributedOptimizer
from hpclb.sync.options import shares_per_step
from hpclb.tasks import Task, build_task
from hpclb.train.agreed import agreed
from hpclb.train.checkpoint import CheckpointStore
from hpclb.train.checkpointer import restore_state
from hpclb.train.profile import StepProfiler, check_profile_window
from hpclb.train.rng import seed_rank
from hpclb.train.rundir import Decision, check_out, decide
from hpclb.train.usercode import describe

__all__ = ["PRECISIONS", "Position", "Run", "build_optimizer", "build_recipe_model",
           "check_model", "setup_run"]

log = logging.getLogger(__name__)
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
    store: CheckpointStore
    pos: Position
    per_rank_batch: int
    micro_batch: int
    autocast: Any  # the forward's precision context (:func:`forward_context`), reusable
    resumed_from: dict | None = None
    resumed_path: str | None = None
    out_lock: Any = None
    profiler: Any = None  # hpclb.train.profile.StepProfiler (--profile), else None
    fingerprint: dict = field(default_factory=dict)  # the code and data (run_fingerprint)
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


class _CpuRnnAutocast:
    """``torch.autocast`` with oneDNN off, reusable: oneDNN has no low-precision LSTM kernel on
    CPUs without AVX512-BF16/AMX, while PyTorch's own LSTM kernels run bf16/fp16 everywhere."""

    def __init__(self, dtype: torch.dtype):
        self.autocast, self.flags = torch.autocast("cpu", dtype=dtype), None

    def __enter__(self):
        self.flags = torch.backends.mkldnn.flags(enabled=False)
        self.flags.__enter__()
        self.autocast.__enter__()

    def __exit__(self, *exc):
        self.autocast.__exit__(*exc)
        self.flags.__exit__(*exc)


def forward_context(precision: str, device: torch.device, model: nn.Module):
    """The forward's precision context for a run, built once and entered at every forward:
    bf16/fp16 ``torch.autocast`` (with oneDNN off around a CPU RNN), nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    if device.type == "cpu" and any(isinstance(m, nn.RNNBase) for m in model.modules()):
        return _CpuRnnAutocast(dtype)
    return torch.autocast(device.type, dtype=dtype)


def _sync_options(sync: dict) -> dict:
    """``cfg.sync`` (resolved once, with ``$HPCLB_*`` applied) as GradientSync's arguments:
    ``stall_abort_s`` None (never) is ``"never"`` there (None would mean "the default")."""
    if not sync:
        return {}
    return {**sync, "stall_abort_s": sync["stall_abort_s"] or "never"}


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
    steps; then the code and data it trains with, by content (:func:`run_fingerprint`)."""
    per_rank = cfg.per_rank_batch_size(comm.world_size)
    micro = cfg.micro_batch_size(comm.world_size)  # B % (W * K): fails before any work
    check_world_size(cfg.noise_scale, comm.world_size)  # --noise-scale needs >= 2 ranks
    data = cfg.spec.data
    task = build_task(cfg.spec, cfg.data_dir, train_samples=data.train_samples,
                      test_samples=data.test_samples)
    sched = cfg.schedule(task.num_train_samples)
    check_profile_window(profile, sched.total_steps)  # --profile: inside the run
    check_model(cfg, task.model_kwargs)  # before --overwrite deletes anything
    return per_rank, micro, task, sched, run_fingerprint(cfg)  # the plug-ins imported by now


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


def run_device(cfg: RunConfig, comm: Communicator) -> torch.device:
    """The device this rank trains on: the communicator's when one was bound (``hpclb train``,
    ``hpclb.init`` and ``get_communicator`` bind it from ``--device``), else ``cfg.device``
    bound now the way ``hpclb train`` binds it (:func:`hpclb.comm.device.select_device` with
    the communicator's local rank; a bare ``SelfCommunicator`` in ``hpclb sweep`` or a user's
    script; the communicator stays unbound, so a later run of ``auto`` on it picks again).

    Raises ConfigError when ``cfg.device`` asks for ``cpu`` or ``cuda`` and the communicator
    was bound to the other (a run that asked for a GPU never trains on the CPU unasked), and
    select_device's errors (``cuda`` without a visible GPU, naming the fix)."""
    bound = vars(comm).get("device")
    if bound is None:
        return select_device(cfg.device, comm.local_rank, comm.local_size)
    bound = torch.device(bound)
    if cfg.device in ("cpu", "cuda") and bound.type != cfg.device:
        raise ConfigError(
            f"device {cfg.device!r} (--device or the recipe's device), but this process's "
            f"communicator was bound to {bound}: create it with the same device "
            f"(hpclb.init(device=...) / get_communicator(..., device=...)) or change the "
            f"setting")
    return bound


def setup_run(cfg: RunConfig, comm: Communicator, device: torch.device | None = None,
              profile: tuple[int, int] | None = None) -> Run:
    """Build (or resume) the run of ``cfg`` on this rank; collective.

    ``device``: where the model, optimizer state and batches live (default
    :func:`run_device`: the communicator's, else ``cfg.device`` bound now; tests pass ``meta``
    for a device dry run). ``profile``: the
    ``--profile`` window, checked against the run's steps with the other settings (then
    ``run.profiler`` traces it: :mod:`hpclb.train.profile`). Raises ConfigError (same on
    every rank), DataError, CheckpointError."""
    agree_run_settings(comm, run_settings(cfg))  # ranks given other settings: all stop, exit 2
    device = torch.device(device) if device is not None else agreed(
        comm, "binding the device", lambda: run_device(cfg, comm))
    check_out(cfg, comm)  # a run directory that may not be written: refused before any data
    per_rank, micro, task, sched, fingerprint = agreed(
        comm, "checking settings and data", lambda: _local_checks(cfg, comm, profile))
    agree_fingerprint(comm, fingerprint)  # other code or data on a rank: all stop, exit 2
    store = CheckpointStore(cfg.out, keep=cfg.keep_checkpoints)
    start = decide(cfg, comm, store, fingerprint)  # rank 0 locks --out; resume or start
    try:
        run = _build(cfg, comm, device, task, sched, store, per_rank, micro, start, profile)
        run.fingerprint = fingerprint
        return run
    except BaseException:
        start.abandon(store.out_dir)
        raise


def prescale_exactly(divisor: int, scaler) -> bool:
    """Whether the loop scales each micro-batch's loss by ``1 / divisor`` (``world_size *
    accumulation_steps``) instead of the GradientSync dividing every gradient after the sum
    (``loss_prescaled``): when ``divisor`` is a power of two above 1, where both are the same
    exact scaling, and without an fp16 loss scaler (whose scale already sits near fp16's
    range)."""
    return divisor > 1 and divisor & (divisor - 1) == 0 and scaler is None


def _build(cfg, comm, device, task, sched, store, per_rank, micro, start: Decision,
           profile) -> Run:
    """The model, optimizer, schedule and task of :func:`setup_run`, restored from ``start``'s
    checkpoint, if any."""
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
                                     grad_clip_norm=cfg.spec.grad_clip_norm,
                                     max_nonfinite_steps=cfg.max_nonfinite_steps, scaler=scaler,
                                     track_local_norm=cfg.noise_scale and comm.world_size > 1,
                                     loss_prescaled=prescale_exactly(shares_per_step(
                                         comm.world_size, cfg.accumulation_steps), scaler),
                                     **_sync_options(cfg.sync))
    task.setup(per_rank_batch=per_rank, global_batch=cfg.global_batch_size, rank=comm.rank,
               world_size=comm.world_size, seed=cfg.seed, steps_per_epoch=sched.steps_per_epoch,
               device=device)
    run = Run(cfg, comm, device, task, sched, model, optimizer, store, Position(),
              per_rank, micro, forward_context(cfg.precision, device, model))
    run.out_lock, run.resumed_path = start.lock, start.path
    if start.checkpoint is not None:
        _restore(run, start.checkpoint)
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
    return str(list(getattr(state[key], "shape", ()))) if key in state else "absent"


def _restore(run: Run, ckpt: dict) -> None:
    """Load the checkpoint ``ckpt`` (:mod:`hpclb.train.checkpointer`'s schema) into ``run``:
    model, optimizer, position, this rank's RNG streams (the LR is the schedule's at the
    restored global step: the loop sets it before each step)."""
    _check_shapes(run, ckpt["model"])
    fields = {k: ckpt[k] for k in ("epoch", "step_in_epoch", "elapsed_s", "epoch_sums",
                                   "history")}
    step = restore_state(ckpt, run.model, run.optimizer, None, comm=run.comm,
                         seed=run.cfg.seed)
    run.pos = Position(**fields, global_step=step, first_loss=ckpt.get("first_loss"))
    if run.comm.rank != 0:  # the saved sums are already totals over ranks: count them once
        run.pos.epoch_sums = torch.zeros_like(run.pos.epoch_sums)
    run.resumed_from = ckpt
