"""The training loop, as one rank sees it (docs/design.md, "One training step").

1. Each rank reads its shard of the global batch from the :class:`~hpclb.tasks.Task` (images:
   ``DistributedSampler``, reshuffled per epoch from the seed; language models: this rank's
   contiguous token streams). The union of the ranks' shards of step ``s`` is the same global
   batch for every world size.
2. Forward/backward in torch (the task gives the loss); :class:`~hpclb.parallel.GradientSync`
   averages gradients; optional clipping by global norm (recipe ``grad_clip_norm``), after the
   averaging. With ``accumulation_steps`` K > 1 the rank's share is run as K micro-batches of
   ``B / (world_size * K)`` samples, each backward accumulating locally; the allreduce runs once,
   on the last micro-batch, and the step's gradient is the mean over the global batch.
3. The optimizer steps with the LR that :mod:`hpclb.schedules` gives this global step.
4. Loss and the task's metrics (accuracy, perplexity, ...) are reduced across ranks; rank 0
   prints, writes ``metrics.jsonl`` / ``summary.json`` and checkpoints.

Preemption: SIGUSR2/SIGTERM only set a flag; at the next step the ranks agree (allreduce max),
rank 0 saves that step's checkpoint, and every rank exits with :data:`PREEMPTED_EXIT_CODE`, which
the job scripts use to requeue; ``--resume`` continues the same trajectory bit for bit.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .comm import Communicator
from .config import ConfigError, RunConfig, check_checkpoint_interval
from .models import build_model
from .optim import LAMB, LARS
from .parallel import GradientSync, broadcast_parameters, check_model_consistency
from .schedules import ScheduleLR
from .tasks import EVAL_BATCH_SIZE, Task, build_task  # noqa: F401 (EVAL_BATCH_SIZE re-exported)

log = logging.getLogger(__name__)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the job templates requeue on it


class Preempted(Exception):
    """Raised on every rank after the preemption checkpoint is on disk."""


class PreemptionFlag:
    """SIGUSR2/SIGTERM handlers that only set a flag (no I/O in the handler)."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        # Periodic checkpoints ride on the same allreduce: rank 0 sets checkpoint_due when its
        # clock says so, and agreed() leaves checkpoint_now set on every rank.
        self.checkpoint_due = False
        self.checkpoint_now = False
        self._previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        # a signal the CLI recorded before the loop began (hpclb.cli._PendingSignal) counts
        self.requested = self.requested or any(getattr(h, "pending", False)
                                               for h in self._previous.values())

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, comm: Communicator) -> bool:
        """True on every rank when any rank received a signal (one 1-element allreduce); the same
        allreduce sets ``checkpoint_now`` on every rank when rank 0 set ``checkpoint_due``."""
        mine = 2.0 if self.requested else (1.0 if self.checkpoint_due else 0.0)
        if comm.world_size > 1:
            mine = comm.allreduce_(torch.tensor([mine]), op="max").item()
        self.checkpoint_now = mine == 1.0
        return mine == 2.0

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


def build_optimizer(name: str, model: torch.nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``model``'s named parameters with the recipe's ``params``.

    Raises ConfigError for a hyper-parameter the optimizer does not take or rejects.
    """
    named = list(model.named_parameters())
    hp = dict(params)
    try:
        if name == "sgd":
            return torch.optim.SGD(named, **hp)
        if name == "momentum":
            hp.setdefault("momentum", 0.9)
            return torch.optim.SGD(named, **hp)
        if name == "adam":
            return torch.optim.Adam(named, **hp)
        if name == "lars":
            return LARS(named, **hp)
        if name == "lamb":
            return LAMB(named, **hp)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizers.{name}: {e}") from e
    raise ConfigError(f"unknown optimizer {name!r}")


def _better(metric: str) -> str:
    """``"min"`` for losses, perplexities and errors, else ``"max"`` (accuracy, BLEU)."""
    return "min" if any(w in metric for w in ("loss", "perplexity", "error")) else "max"


def _show(metric: str, value: float) -> str:
    if "accuracy" in metric:
        return f"{100 * value:6.2f}%"
    return f"{value:.2f}" if "perplexity" in metric or "bleu" in metric else f"{value:.4f}"


def _set_threads(comm: Communicator) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def train(cfg: RunConfig, comm: Communicator, *, quiet: bool = False,
          checkpoint_interval_s: float | None = None) -> dict[str, Any]:
    """Run one experiment on this rank; returns the summary (identical on every rank).

    ``checkpoint_interval_s``: also checkpoint mid-epoch when this many seconds (rank 0's clock)
    have passed since the last checkpoint (None/0: at epoch ends and on preemption only).

    Raises ConfigError (bad settings, same on every rank), DataError (missing/corrupt data),
    CheckpointError (``--resume`` without a usable checkpoint), :class:`Preempted` after a
    preemption checkpoint.
    """
    t_start = time.perf_counter()
    check_checkpoint_interval(checkpoint_interval_s)
    rank0 = comm.rank == 0
    say = (lambda *a: print(*a, flush=True)) if rank0 and not quiet else (lambda *a: None)
    per_rank_batch = cfg.per_rank_batch_size(comm.world_size)
    n_micro = cfg.accumulation_steps
    micro_batch = cfg.micro_batch_size(comm.world_size)  # B % (W * K): fails before any work
    data = cfg.recipe["data"]
    task = build_task(cfg.recipe, cfg.data_dir, train_samples=data.get("train_samples"),
                      test_samples=data.get("test_samples"))
    sched = cfg.schedule(task.num_train_samples)  # validates warmup < training before any work
    out = Path(cfg.out)
    ckpt_path = out / "checkpoint.pt"
    ckpt = load_checkpoint(ckpt_path) if cfg.resume else None
    summary_path = out / "summary.json"
    if ckpt is None and ckpt_path.exists() and not (
            summary_path.exists() and summary_path.stat().st_mtime >= ckpt_path.stat().st_mtime):
        raise ConfigError(f"{out} holds the checkpoint of an unfinished run; add --resume to "
                          f"continue it, or choose another --out (or delete {ckpt_path}) to start "
                          f"afresh")
    if ckpt is not None:
        for key in ("experiment", "global_batch_size", "scaling", "optimizer", "seed", "epochs",
                    "lr"):
            if ckpt["run"][key] != getattr(cfg, key):
                raise ConfigError(f"--resume: the checkpoint in {ckpt_path} was made with {key}="
                                  f"{ckpt['run'][key]!r}, this run has {getattr(cfg, key)!r}; "
                                  f"resume with the same settings or use another --out")

    _set_threads(comm)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.recipe["model"]["name"], **task.model_kwargs,
                        **{k: v for k, v in cfg.recipe["model"].items() if k != "name"})
    check_model_consistency(model, comm)
    broadcast_parameters(model, comm)
    optimizer = build_optimizer(cfg.optimizer, model, cfg.optimizer_params)
    scheduler = ScheduleLR(optimizer, sched)
    sync = GradientSync(model.parameters(), comm, accumulation_steps=n_micro)
    spe = sched.steps_per_epoch
    task.setup(per_rank_batch=per_rank_batch, global_batch=cfg.global_batch_size, rank=comm.rank,
               world_size=comm.world_size, seed=cfg.seed, steps_per_epoch=spe)
    clip = cfg.recipe.get("grad_clip_norm")
    k = cfg.global_batch_size / cfg.base_batch_size

    pos = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "elapsed_s": 0.0,
           "epoch_sums": torch.zeros(3, dtype=torch.float64), "history": []}
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["rng"])
        pos.update({key: ckpt[key] for key in pos})
        if not rank0:  # the saved sums are already totals over ranks: count them once
            pos["epoch_sums"] = torch.zeros_like(pos["epoch_sums"])
        say(f"resumed from {ckpt_path} at epoch {pos['epoch']} step {pos['global_step']}")

    say(f"hpclb {cfg.experiment}: {comm.world_size} rank(s) [{comm.backend}], global batch "
        f"{cfg.global_batch_size} = {comm.world_size} x {per_rank_batch} (B0 {cfg.base_batch_size}, "
        f"k = {k:g}), accumulation_steps {n_micro} (micro-batch {micro_batch}), scaling "
        f"{cfg.scaling}, optimizer {cfg.optimizer}")
    say(f"  peak LR {sched.peak_lr:.4g} (B0: {cfg.base_lr:.4g}), warmup {sched.warmup_steps} steps "
        f"= {sched.warmup_epochs:.3g} epochs, decay {sched.decay}, {spe} steps/epoch, "
        f"{sched.total_steps} steps in {cfg.epochs:g} epochs, {task.num_train_samples} train / "
        f"{task.num_test_samples} test samples ({task.kind}), gradient buffer {sync.nbytes / 2**20:.2f} MiB")

    last_checkpoint = [time.monotonic()]

    def checkpoint(epoch: int, step_in_epoch: int, epoch_sums: torch.Tensor) -> None:
        task_state = task.state_dict(comm)  # collective: e.g. the LM's carried state, all ranks
        epoch_sums = comm.allreduce_(epoch_sums.clone())  # collective: this epoch's totals so far
        if rank0:
            save_checkpoint(ckpt_path, {
                "run": {k_: v for k_, v in cfg.to_dict().items() if k_ != "recipe"},
                "world_size": comm.world_size, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(), "epoch": epoch, "step_in_epoch": step_in_epoch,
                "global_step": pos["global_step"], "epoch_sums": epoch_sums,
                "elapsed_s": pos["elapsed_s"] + time.perf_counter() - t_start,
                "history": pos["history"], "task": task_state})
        comm.barrier()  # nobody exits or moves on before the checkpoint is on disk
        last_checkpoint[0] = time.monotonic()

    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.json", {**cfg.to_dict(), "world_size": comm.world_size,
                                          "peak_lr": sched.peak_lr,
                                          "warmup_steps": sched.warmup_steps})
    preempt = PreemptionFlag()
    history: list[dict] = pos["history"]
    n_epochs = math.ceil(sched.total_steps / spe)
    try:
        for epoch in range(pos["epoch"], n_epochs):
            task.start_epoch(epoch)
            sync.reset_epoch()  # windows end with each step: nothing to drop, the counter restarts
            steps = min(spe, sched.total_steps - epoch * spe)
            first = pos["step_in_epoch"] if epoch == pos["epoch"] else 0
            if first:
                task.load_state_dict(ckpt.get("task"))  # resumed mid-epoch
            sums = pos["epoch_sums"].clone() if first else torch.zeros(3, dtype=torch.float64)
            t_epoch = time.perf_counter()
            bar = tqdm(range(first, steps), desc=f"epoch {epoch + 1}", leave=False,
                       disable=not (rank0 and not quiet and sys.stderr.isatty()))
            for i in bar:
                optimizer.zero_grad(set_to_none=False)
                for part in range(n_micro):
                    # GradientSync divides the accumulated sum by world_size * K, which is the
                    # mean when the K parts are equal (always, except on a short last step of an
                    # epoch): part j's mean loss is weighted K * n_j / n so that the step's
                    # gradient is the mean over this rank's n samples (weight exactly 1 when
                    # equal, so K = 1 runs as before). An empty part only counts the window.
                    n_part, n_share = task.part_size(i, part, n_micro)
                    if n_part:
                        loss, stats = task.loss(model, task.batch(i, part, n_micro))
                        weight = n_micro * n_part / n_share
                        (loss if weight == 1 else loss * weight).backward()
                        sums += stats
                    sync.synchronize()  # communicates on the last part only
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                scheduler.step()
                pos["global_step"] += 1
                preempt.checkpoint_due = bool(
                    rank0 and checkpoint_interval_s
                    and time.monotonic() - last_checkpoint[0] >= checkpoint_interval_s)
                if preempt.agreed(comm):
                    checkpoint(epoch, i + 1, sums)
                    say(f"preempted: checkpoint of step {pos['global_step']} (epoch {epoch}, "
                        f"step {i + 1}/{steps}) saved to {ckpt_path}; exiting with "
                        f"{PREEMPTED_EXIT_CODE} to requeue")
                    preempt.requested = True  # on every rank, also those the signal missed
                    raise Preempted(pos["global_step"])
                if preempt.checkpoint_now:
                    checkpoint(epoch, i + 1, sums)
            train_time = time.perf_counter() - t_epoch
            comm.allreduce_(sums)
            train_metrics = task.train_metrics(sums, train_time)
            eval_metrics = task.evaluate(model, comm)
            row = {"epoch": epoch + 1, "step": pos["global_step"],
                   **{k_: v for k_, v in train_metrics.items() if not k_.endswith("_per_s")},
                   **eval_metrics, "lr": sched.lr(pos["global_step"] - 1),
                   **{k_: (v if not first else None) for k_, v in train_metrics.items()
                      if k_.endswith("_per_s")},
                   "epoch_time_s": train_time,
                   "elapsed_s": pos["elapsed_s"] + time.perf_counter() - t_start}
            history.append(row)
            sps = f"{row['samples_per_s']:9,.0f}" if row["samples_per_s"] else "   (resumed)"
            shown = "  ".join(f"{m} {_show(m, v)}" for m, v in eval_metrics.items())
            say(f"epoch {epoch + 1:3d}/{n_epochs}  loss {row['train_loss']:.4f}  {shown}  "
                f"lr {row['lr']:.3e}  samples/s {sps}  {train_time:5.1f}s")
            if rank0:
                with open(out / "metrics.jsonl", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in history)
            pos["epoch_sums"] = torch.zeros(3, dtype=torch.float64)
            checkpoint(epoch + 1, 0, pos["epoch_sums"])
    finally:
        # After a preemption the flag handlers stay: the job script forwards the scheduler's
        # signal too, and a second USR2/TERM must not kill a rank on its way out with 75.
        if not preempt.requested:
            preempt.restore()

    wall = pos["elapsed_s"] + time.perf_counter() - t_start
    target = cfg.recipe.get("target") or {}
    metric = target.get("metric")
    mode = target.get("mode") or _better(metric or "")
    reached = [r for r in history if r.get(metric) is not None and
               (r[metric] >= target.get("value", math.inf) if mode == "max"
                else r[metric] <= target.get("value", -math.inf))]
    rates = [r["samples_per_s"] for r in history if r["samples_per_s"]]
    evaluated = [m for m in history[-1] if m.startswith(("valid_", "test_"))]  # e.g. test_accuracy
    summary = {
        "experiment": cfg.experiment, "task": task.kind,
        **({"decoding": task.decoding} if task.decoding else {}),
        **{f"final_{m}": history[-1][m] for m in evaluated},
        **{f"best_{m}": (max if _better(m) == "max" else min)(r[m] for r in history)
           for m in evaluated},
        "metric_name": metric, "global_batch_size": cfg.global_batch_size, "per_rank_batch_size": per_rank_batch,
        "accumulation_steps": n_micro, "micro_batch_size": micro_batch,
        "base_batch_size": cfg.base_batch_size, "batch_ratio_k": k,
        "world_size": comm.world_size, "backend": comm.backend, "epochs": cfg.epochs,
        "steps": pos["global_step"], "steps_per_epoch": spe, "scaling": cfg.scaling,
        "optimizer": cfg.optimizer, "base_lr": cfg.base_lr, "peak_lr": sched.peak_lr,
        "warmup_steps": sched.warmup_steps, "warmup_epochs": sched.warmup_epochs,
        "decay": cfg.recipe["decay"], "seed": cfg.seed, "wall_time_s": wall,
        "mean_samples_per_s": sum(rates) / len(rates) if rates else None,
        "target": target or None,
        "time_to_target_s": reached[0]["elapsed_s"] if reached else None,
        "torch": torch.__version__, "host": socket.gethostname(),
    }
    if rank0:
        _write_json(summary_path, summary)
    shown = metric if metric in evaluated else evaluated[-1]
    how = f" (decoding: {task.decoding})" if task.decoding and "bleu" in shown else ""
    say(f"summary: {cfg.experiment} {cfg.scaling} global batch {cfg.global_batch_size} (k={k:g}) "
        f"on {comm.world_size} rank(s): {shown} {_show(shown, summary['final_' + shown]).strip()}"
        f"{how} "
        f"after {cfg.epochs:g} epochs ({pos['global_step']} steps) in {wall:.1f} s -> "
        f"{out / 'summary.json'}")
    return summary
