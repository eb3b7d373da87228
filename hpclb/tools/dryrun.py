"""``hpclb train ... --dry-run``: the plan a run would follow, printed by rank 0, without training.

:func:`plan_run` resolves what :func:`hpclb.train.setup.setup_run` would: the batch split over
the ranks (per-rank batch, micro-batch), the schedule (peak LR, warmup steps and epochs, steps
per epoch, total steps) on the training set's size, the devices and the backend, and what would
happen to ``--out`` (a new run, a resume from the newest checkpoint that verifies, or a refusal).
The training set is sized from the data-set registry where it knows the size (nothing is read);
a plug-in data set, or one without a registered size, is read as the run would read it (the
sizing needs it). The model is built as the run builds it, on the ``meta`` device, and its
optimizer (:func:`hpclb.train.setup.check_model`), so a model the run refuses is refused here
with the same message; a task that sets model arguments from the data (a language model's
``vocab_size``, a translation model's vocabularies) reads the data for them. Nothing is written:
no run directory, no lock.

The LEGW warmup fraction is ``warmup_steps / total_steps``: LEGW's warmup grows as ``W0 * k``
epochs with the batch ratio ``k = B / B0``, so a large batch on a short budget spends most of the
run warming up; :data:`WARMUP_WARN_FRACTION` (half the run) is where the LEGW paper's own
large-batch points (k = 64 on MNIST-LSTM, k = 32 on Fashion-MNIST) stopped reaching the
target, and the plan warns beyond it.
"""
from __future__ import annotations

import sys
from typing import Any

from hpclb.comm.device import device_info
from hpclb.config import RunConfig
from hpclb.config.outputs import check_run_dir, run_files
from hpclb.errors import ConfigError, JobError
from hpclb.noise import check_world_size
from hpclb.plugins import is_plugin
from hpclb.sync.options import SMALL_FUSION_BYTES, small_bucket_warning
from hpclb.tasks import build_task
from hpclb.tasks.registry import TASKS
from hpclb.train.agreed import agreed
from hpclb.train.checkpoint import CheckpointStore
from hpclb.train.profile import check_profile_window
from hpclb.train.rundir import check_resumable
from hpclb.train.setup import check_model

__all__ = ["WARMUP_WARN_FRACTION", "dry_run", "format_plan", "plan_run", "train_set_size_of",
           "warmup_warning"]

WARMUP_WARN_FRACTION = 0.5


def train_set_size_of(cfg: RunConfig) -> tuple[int, str, dict[str, Any]]:
    """(training samples, unit, the model arguments the task sets from the data) of ``cfg``'s
    data: from the data-set registry when it knows the size and the task sets no model
    argument (no read), else by building the task as the run would (reads the data)."""
    from hpclb.tools.jobs import train_set_size

    kind = TASKS[cfg.spec.task]
    if not is_plugin(cfg.spec.data.name) and not kind.model_args:
        try:
            return (*train_set_size(cfg.recipe), {})
        except JobError:
            pass  # no registered size: count it
    data = cfg.spec.data
    task = build_task(cfg.spec, cfg.data_dir, train_samples=data.train_samples,
                      test_samples=data.test_samples)
    return task.num_train_samples, kind.sample_unit, task.model_kwargs


def _out_plan(cfg: RunConfig) -> str:
    """What the run would do with ``--out`` (ConfigError where it would be refused)."""
    found = check_run_dir(cfg.out, resume=bool(cfg.resume), overwrite=cfg.overwrite)
    if cfg.overwrite and found:
        return f"{cfg.out}: holds a run ({', '.join(found)}); --overwrite would delete it"
    if not cfg.resume:
        return f"{cfg.out}: a new run"
    loaded = CheckpointStore(cfg.out, keep=cfg.keep_checkpoints).latest()
    if loaded is not None:
        check_resumable(cfg, loaded.state, loaded.path.resolve())  # the run's words
        if "summary.json" in found:  # as the run: nothing trained, nothing written
            return (f"{cfg.out}: holds a finished run (global step "
                    f"{loaded.state.get('global_step')}): --resume leaves it as it is")
        return (f"{cfg.out}: resumes from {loaded.path} (global step "
                f"{loaded.state.get('global_step')})")
    if cfg.resume != "auto":
        raise ConfigError(f"--resume: no checkpoint to resume from in {cfg.out}; drop --resume "
                          f"to start afresh, or use --resume auto")
    if "summary.json" in run_files(cfg.out):
        raise ConfigError(f"--resume auto: {cfg.out} holds a finished run without a checkpoint;"
                          f" add --overwrite (instead of --resume) to delete it")
    return f"{cfg.out}: no checkpoint; --resume auto starts afresh"


def plan_run(cfg: RunConfig, comm, devices: list[str],
             profile: tuple[int, int] | None = None) -> dict[str, Any]:
    """The plan of ``cfg`` on ``comm``'s ranks (see the module docstring), ``devices`` each
    rank's device: a dict of plain numbers and strings. Raises ConfigError where the run would
    refuse to start."""
    w = comm.world_size
    check_world_size(cfg.noise_scale, w)  # as the run refuses it (fresh-user review)
    per_rank, micro = cfg.per_rank_batch_size(w), cfg.micro_batch_size(w)
    n, unit, model_kwargs = train_set_size_of(cfg)
    sched = cfg.schedule(n)
    check_profile_window(profile, sched.total_steps)
    check_model(cfg, model_kwargs)  # as the run checks it, before --out
    info = device_info(comm.device)
    return {
        "experiment": cfg.experiment, "world_size": w, "backend": comm.backend,
        "devices": devices, "device_name": info.get("name"),
        "global_batch_size": cfg.global_batch_size, "per_rank_batch_size": per_rank,
        "accumulation_steps": cfg.accumulation_steps, "micro_batch_size": micro,
        "base_batch_size": cfg.base_batch_size, "k": cfg.global_batch_size / cfg.base_batch_size,
        "scaling": cfg.scaling, "optimizer": cfg.optimizer, "precision": cfg.precision,
        "base_lr": cfg.base_lr, "peak_lr": sched.peak_lr, "warmup_steps": sched.warmup_steps,
        "warmup_epochs": sched.warmup_epochs, "steps_per_epoch": sched.steps_per_epoch,
        "total_steps": sched.total_steps, "epochs": cfg.epochs, "decay": sched.decay,
        "warmup_fraction": sched.warmup_steps / sched.total_steps if sched.total_steps else 0.0,
        "train_samples": n, "sample_unit": unit, "out": _out_plan(cfg),
        "profile": None if profile is None else f"steps {profile[0] + 1} to {profile[1]} -> "
                                                f"{cfg.out}/profile/rank<r>/",
        "sync": dict(cfg.sync),
    }


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as the lines ``--dry-run`` prints on stdout."""
    p = plan
    lines = [
        f"dry run: hpclb train {p['experiment']} (nothing trained, nothing written)",
        f"  ranks        world size {p['world_size']} [{p['backend']}] on "
        f"{_devices(p['devices'])} ({p['device_name']}), precision {p['precision']}",
        f"  batch        global {p['global_batch_size']} = {p['world_size']} x "
        f"{p['per_rank_batch_size']} per rank (micro-batch {p['micro_batch_size']} x "
        f"{p['accumulation_steps']} accumulation steps); B0 {p['base_batch_size']}, "
        f"k = {p['k']:g}",
        f"  LR           {p['scaling']}: peak {p['peak_lr']:.4g} (B0: {p['base_lr']:.4g}), "
        f"{p['optimizer']}, decay {p['decay']}",
        f"  warmup       {p['warmup_steps']} steps = {p['warmup_epochs']:.4g} epochs "
        f"({100 * p['warmup_fraction']:.1f}% of the run)",
        f"  steps        {p['total_steps']} = {p['epochs']:g} epochs x {p['steps_per_epoch']} "
        f"steps/epoch on {p['train_samples']} {p['sample_unit']}",
        f"  out          {p['out']}",
    ]
    if p.get("sync"):
        s = p["sync"]
        abort = ("no abort" if s["stall_abort_s"] is None else
                 f"abort after {s['stall_abort_s']:g} s")
        nbytes = s["fusion_threshold_bytes"]
        size = f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes} B"
        lines.insert(-1, f"  sync         buckets of {size}, "
                         f"overlap {s['overlap']}, compression {s['compression']}, stall report "
                         f"after {s['stall_timeout_s']:g} s, {abort}")
    if p.get("profile"):
        lines.append(f"  profile      {p['profile']}")
    return "\n".join(lines)


def warmup_warning(plan: dict[str, Any]) -> str | None:
    """The warning when warmup takes more than :data:`WARMUP_WARN_FRACTION` of the run."""
    p = plan
    if p["warmup_fraction"] > WARMUP_WARN_FRACTION:
        return (
            f"warmup takes {100 * p['warmup_fraction']:.0f}% of the run (more than "
            f"half): at k = {p['k']:g} {p['scaling']} warms up for {p['warmup_epochs']:.3g} of "
            f"{p['epochs']:g} epochs; train more epochs (--epochs), use a smaller --batch-size "
            f"or shorten the recipe's warmup_epochs")
    return None


def _devices(devices: list[str]) -> str:
    """``cuda:0, cuda:1`` (rank order), or ``2 x cpu`` when every rank has the same."""
    if len(set(devices)) == 1:
        return devices[0] if len(devices) == 1 else f"{len(devices)} x {devices[0]}"
    return ", ".join(devices)


def dry_run(cfg: RunConfig, comm, profile: tuple[int, int] | None = None) -> int:
    """Plan ``cfg`` on rank 0 (its verdict agreed: a refusal is raised on every rank) and print
    it there; returns 0. Collective. Raises ConfigError where the run would refuse to start."""
    devices = [str(comm.device)]
    if comm.world_size > 1:
        devices = comm.allgather_object(devices[0])
    plan = agreed(comm, "planning the run",
                  lambda: plan_run(cfg, comm, devices, profile) if comm.rank == 0 else None)
    if comm.rank == 0:
        print(format_plan(plan), flush=True)
        for warning in (warmup_warning(plan),
                        small_bucket_warning(cfg.sync.get("fusion_threshold_bytes",
                                                          SMALL_FUSION_BYTES))):
            if warning:
                print(f"hpclb: warning: {warning}", file=sys.stderr, flush=True)
    return 0
