"""What a run reports besides its metrics: rank 0's console lines (:class:`Say`, :func:`header`,
:func:`epoch_line`, :func:`summary_line`), ``config.json`` (:func:`write_config`: the settings,
the schedule, the gradient-sync settings in force) and ``summary.json`` (:func:`summary`).
Called by :func:`hpclb.train.loop.train`; none of it is on the step's path."""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
from typing import Any

import torch

from hpclb._io import write_json
from hpclb.config import RunConfig
from hpclb.config.outputs import RUN_KEPT
from hpclb.data.paths import data_dir
from hpclb.tasks.spec import metric_mode, show_metric
from hpclb.train.rundir import fingerprint_changes
from hpclb.train.setup import Run

__all__ = ["Say", "epoch_line", "header", "schedule_columns", "summary", "summary_line",
           "write_config"]


class Say:
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


def header(run: Run, say: Say) -> None:
    """The run's first lines (rank 0): where it resumed, the ranks, device, batch (global, per
    rank, B0, k), accumulation, scaling, optimizer; the schedule (peak LR, warmup steps and
    epochs, decay, steps) and the data."""
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


def _sync_settings(run: Run) -> dict:
    """The gradient-sync settings in force (config.json's ``sync``), with ``overlap_setting``:
    the overlap asked for (``auto`` unless ``$HPCLB_OVERLAP`` set one) beside ``overlap``, the
    mode in force."""
    sync = run.optimizer.sync
    return {**sync.settings(), "overlap_setting": sync.options.overlap}


def _trust_backend() -> str:
    """``$HPCLB_TRUST_BACKEND`` in force (``auto`` when unset): recorded in config.json."""
    return os.environ.get("HPCLB_TRUST_BACKEND", "auto").strip() or "auto"


def epoch_line(row: dict, n_epochs: float) -> str:
    """One epoch's console line from its row (``metrics.jsonl``'s ``kind: epoch``)."""
    evaluated = {m: v for m, v in row.items() if m.startswith(("valid_", "test_"))}
    shown = "  ".join(f"{m} {show_metric(m, v)}" for m, v in evaluated.items())
    sps = f"{row['samples_per_s']:9,.0f}" if row.get("samples_per_s") else "   (resumed)"
    skipped = f"  skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
    return (f"epoch {row['epoch']:3d}/{n_epochs:g}  loss {row['train_loss']:.4f}  {shown}  "
            f"lr {row['lr']:.3e}  samples/s {sps}  {row['epoch_time_s']:5.1f}s{skipped}")


def summary(run: Run) -> dict:
    """``summary.json``: the final and best of each evaluated metric, the batch and schedule,
    time to the recipe's target (s, None when not reached), throughput, wall time (s), the
    software and host; identical on every rank (its numbers are reduced)."""
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


def schedule_columns(cfg: RunConfig, sched) -> dict[str, Any]:
    """The schedule of a run, known before its first step (in ``config.json``, where a sweep
    reads it for a point that diverged): ``batch_ratio_k``, ``base_lr``, ``peak_lr``,
    ``warmup_steps``, ``warmup_epochs``, ``warmup_start_lr``, ``decay`` (the recipe's),
    ``steps_per_epoch``."""
    return {"batch_ratio_k": cfg.global_batch_size / cfg.base_batch_size,
            "base_lr": cfg.base_lr, "peak_lr": sched.peak_lr, "warmup_steps": sched.warmup_steps,
            "warmup_epochs": sched.warmup_epochs, "warmup_start_lr": sched.warmup_start_lr,
            "decay": cfg.recipe["decay"], "steps_per_epoch": sched.steps_per_epoch}


def summary_line(run: Run, summary: dict) -> str:
    """The run's last console line: the headline metric, steps, wall time, where the summary is."""
    cfg, task = run.cfg, run.task
    metric = summary["metric_name"]
    evaluated = [m[len("final_"):] for m in summary if m.startswith("final_")]
    shown = metric if metric in evaluated else evaluated[-1]
    how = f" (decoding: {task.decoding})" if task.decoding and "bleu" in shown else ""
    target = summary.get("target") or {}
    if target.get("metric") == shown and summary.get("time_to_target_s") is None:
        how += f" (target {show_metric(shown, target['value']).strip()} not reached)"
    return (f"summary: {cfg.experiment} {cfg.scaling} global batch {cfg.global_batch_size} "
            f"(k={summary['batch_ratio_k']:g}) on {run.comm.world_size} rank(s): {shown} "
            f"{show_metric(shown, summary['final_' + shown]).strip()}{how} after "
            f"{cfg.epochs:g} epochs ({run.pos.global_step} steps) in "
            f"{summary['wall_time_s']:.1f} s -> {run.out / 'summary.json'}")


def write_config(run: Run) -> None:
    """Rank 0 writes ``<out>/config.json``: every run setting (``RunConfig.to_dict``), the world
    size, the data root, the schedule (:func:`schedule_columns`), ``sync`` (the gradient-sync
    settings in force), ``trust_backend``, ``fingerprint`` (the code and data, by content:
    :func:`~hpclb.config.agreement.run_fingerprint`) and ``resumed_with_changes``
    (:func:`_resumed_with_changes`). Other ranks write nothing."""
    if run.comm.rank != 0:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    write_json(run.out / "config.json", {
        **run.cfg.to_dict(), "world_size": run.comm.world_size,
        "data_root": str(data_dir(run.cfg.data_dir).resolve()),
        **schedule_columns(run.cfg, run.schedule),
        "sync": _sync_settings(run), "trust_backend": _trust_backend(),
        "fingerprint": run.fingerprint, "resumed_with_changes": _resumed_with_changes(run)},
        RUN_KEPT)


def _resumed_with_changes(run: Run) -> list[dict]:
    """Each resume of the run that continued with other code or data than its checkpoint's
    (``--resume-changed``): its global step and what changed; the earlier ones as the
    ``config.json`` in the run directory records them, then this start's."""
    if run.resumed_from is None:
        return []
    try:
        earlier = json.loads((run.out / "config.json").read_text())["resumed_with_changes"]
    except (OSError, ValueError, KeyError, TypeError):
        earlier = []
    then = run.resumed_from["run"].get("fingerprint")
    changes = fingerprint_changes(then, run.fingerprint) if then is not None else {}
    entry = {"global_step": run.pos.global_step, **changes}
    return [*earlier, entry] if changes and entry not in earlier else earlier
