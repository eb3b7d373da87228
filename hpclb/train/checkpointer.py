"""Checkpointing: the one state schema, written by ``hpclb train`` and by the library's
:class:`Checkpointer`, and restored by both.

A checkpoint is one dict with the keys of :data:`STATE_KEYS` (:func:`checkpoint_state` builds
it, :func:`restore_state` restores what every writer saves), stored as a generation of
:class:`~hpclb.train.checkpoint.CheckpointStore` (atomic, SHA-256 verified, the last ``keep``
kept):

- ``global_step`` (optimizer steps done), ``world_size``, ``model``, ``optimizer`` and
  ``scheduler`` (their ``state_dict``; ``scheduler`` None without one), ``rng`` (every rank's
  random streams, index = rank: :func:`hpclb.train.rng.rng_state`);
- the position inside the run, ``hpclb train``'s (None where the writer has none):
  ``epoch`` and ``step_in_epoch`` (the next step to run), ``epoch_sums`` (the epoch's float64
  ``[3]`` task sums so far, totals over ranks), ``elapsed_s``, ``history`` (epoch rows),
  ``first_loss``;
- ``task`` (the task's carried state, e.g. a language model's hidden state), ``steplog`` (the
  step lines' carried state), ``run`` (``hpclb train``'s settings and recipe, which
  ``--resume`` checks; None for a library loop), ``extra`` (the library user's own dict; ``{}``
  for ``hpclb train``).

Checkpoints written before ``extra`` (``hpclb train``) or before the position and ``run`` keys
(the library) load: a missing key reads as its default.

:class:`Checkpointer` does for a library loop what ``hpclb train`` does: SIGUSR2 or SIGTERM only
sets a flag (:class:`~hpclb.train.preemption.PreemptionFlag`); :meth:`Checkpointer.step_done`,
called once per optimizer step on every rank, agrees on it with one 1-element allreduce, so every
rank sees the request at the same step. Then rank 0 saves a generation and every rank exits with
status 75 (``EX_TEMPFAIL``: the job scripts requeue on it). :meth:`Checkpointer.resume` in the
next job restores all of it, each rank its own RNG streams, so the run continues as if
uninterrupted.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from hpclb.comm.base import Communicator
from hpclb.comm.world import current_communicator
from hpclb.errors import PREEMPTED_EXIT_CODE
from hpclb.sync.agree import average_buffers
from hpclb.train.agreed import agreed
from hpclb.train.checkpoint import CheckpointStore
from hpclb.train.preemption import PreemptionFlag
from hpclb.train.rng import resume_rank_rng, rng_state

__all__ = ["STATE_KEYS", "POSITION_KEYS", "checkpoint_state", "restore_state",
           "save_run_checkpoint", "Checkpointer"]

#: ``hpclb train``'s position inside the run (module docstring); None where a writer has none
POSITION_KEYS = ("epoch", "step_in_epoch", "epoch_sums", "elapsed_s", "history", "first_loss")
#: every key of every checkpoint, in the order written (module docstring)
STATE_KEYS = ("run", "world_size", "model", "optimizer", "scheduler", "rng", "epoch",
              "step_in_epoch", "global_step", "epoch_sums", "elapsed_s", "history", "task",
              "first_loss", "steplog", "extra")


def checkpoint_state(comm: Communicator, model, optimizer, scheduler, global_step: int, *,
                     position: dict[str, Any] | None = None, task: Any = None,
                     steplog: dict | None = None, run: dict | None = None,
                     extra: dict | None = None) -> dict[str, Any] | None:
    """The checkpoint of global step ``global_step`` (the keys of :data:`STATE_KEYS`) on rank
    0, None on the other ranks. Collective: every rank's RNG state is gathered (one allgather
    of Python objects where ``world_size`` > 1).

    ``model``, ``optimizer``: anything with ``state_dict()``; ``scheduler`` too, or None.
    ``position``: values for :data:`POSITION_KEYS` (absent ones are None). ``task``,
    ``steplog``, ``run``: ``hpclb train``'s; ``extra``: a dict of tensors, numbers and
    strings. Raises ValueError naming a key of ``position`` that is not a position key."""
    unknown = sorted(set(position or {}) - set(POSITION_KEYS))
    if unknown:
        raise ValueError(f"checkpoint position: unknown key(s) {unknown}; the position keys "
                         f"are {list(POSITION_KEYS)}")
    rngs = comm.allgather_object(rng_state()) if comm.world_size > 1 else [rng_state()]
    if comm.rank != 0:
        return None
    values = {"run": run, "world_size": comm.world_size, "model": model.state_dict(),
              "optimizer": optimizer.state_dict(),
              "scheduler": scheduler.state_dict() if scheduler is not None else None,
              "rng": rngs, **dict.fromkeys(POSITION_KEYS), **(position or {}),
              "global_step": int(global_step), "task": task, "steplog": steplog,
              "extra": dict(extra or {})}
    return {key: values[key] for key in STATE_KEYS}


def restore_state(state: dict[str, Any], model, optimizer, scheduler, *, comm: Communicator,
                  seed: int) -> int:
    """Load a checkpoint's ``model``, ``optimizer`` and ``scheduler`` (when both the
    checkpoint and the caller have one), then this rank's RNG streams (``state["rng"]
    [rank]``; reseeded with ``seed_rank(seed, rank, step)`` when the checkpoint comes from
    another world size: :func:`hpclb.train.rng.resume_rank_rng`). Returns the global step.
    Raises what ``load_state_dict`` raises for a state of another model or optimizer."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    step = int(state["global_step"])
    resume_rank_rng(state["rng"], seed=seed, rank=comm.rank, world_size=comm.world_size,
                    step=step)
    return step


def save_run_checkpoint(run, epoch: int, step_in_epoch: int, epoch_sums: torch.Tensor,
                        steplog: dict | None = None) -> None:
    """``hpclb train``'s checkpoint of ``run`` (:class:`hpclb.train.setup.Run`) before step
    ``step_in_epoch`` of ``epoch``. Collective: BatchNorm buffers are averaged over ranks, the
    task's carried state, this epoch's ``epoch_sums`` (float64 ``[3]``, this rank's) and every
    rank's RNG state gathered; rank 0 writes a new verified generation (``run.store``); a write
    that fails ends every rank (:func:`~hpclb.train.agreed.agreed`), and nobody moves on before
    it is on disk. ``steplog``: the step lines' carried state
    (:meth:`hpclb.train.loop.StepLog.state_dict`, rank 0's)."""
    comm = run.comm
    average_buffers(run.model, comm)
    task_state = run.task.state_dict(comm)
    # a copy: the running sums stay this rank's (reducing them in place added the other ranks' in)
    sums = epoch_sums.to(device="cpu", dtype=torch.float64, copy=True)
    if comm.world_size > 1:
        comm.allreduce_(sums)
    position = {"epoch": epoch, "step_in_epoch": step_in_epoch, "epoch_sums": sums,
                "elapsed_s": run.elapsed_s(), "history": run.pos.history,
                "first_loss": run.pos.first_loss}
    # with the recipe, the code and the data: what --resume compares
    settings = {**run.cfg.to_dict(), "fingerprint": run.fingerprint}
    state = checkpoint_state(comm, run.model, run.optimizer, None, run.pos.global_step,
                             position=position, task=task_state, steplog=steplog, run=settings)
    if state is not None:  # the LR is the schedule's at the step: ScheduleLR's state, for a
        state["scheduler"] = {"last_epoch": run.pos.global_step}  # library Checkpointer
    agreed(comm, "writing the checkpoint",
           lambda: run.store.save(state) if comm.rank == 0 else None)


class Checkpointer:
    """Preemption-safe checkpointing of a library training loop (module docstring).

    Args:
        out_dir: directory of the checkpoints (``checkpoint.pt`` and ``checkpoints/gen-*``);
            rank 0 writes, rank 0 reads and broadcasts (no shared file system needed).
        model: the ``nn.Module`` (its ``state_dict``: parameters and buffers).
        optimizer: a torch optimizer or :class:`~hpclb.sync.optimizer.DistributedOptimizer`.
        scheduler: an LR scheduler with ``state_dict`` (optional).
        comm: the communicator (default: the one :func:`hpclb.init` made).
        keep: generations kept (int >= 1; default 2).
        seed: reseeds the ranks' streams (``seed_rank(seed, rank, step)``) when a checkpoint
            from another world size is resumed (their RNG states cannot be matched).

    Installs the SIGUSR2/SIGTERM handlers on construction (:meth:`close` restores the previous
    ones). Raises ValueError for ``keep`` < 1.
    """

    def __init__(self, out_dir: str | Path, model, optimizer, scheduler=None, *,
                 comm: Communicator | None = None, keep: int = 2, seed: int = 0):
        self.comm = comm or current_communicator()
        self.store = CheckpointStore(out_dir, keep=keep)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.seed = seed
        self.flag = PreemptionFlag()

    def state(self, step: int, extra: dict | None = None) -> dict[str, Any] | None:
        """The checkpoint of global ``step`` on rank 0 (None elsewhere): the keys of
        :data:`STATE_KEYS`, without a position. Collective: every rank's RNG state is
        gathered (one allgather)."""
        return checkpoint_state(self.comm, self.model, self.optimizer, self.scheduler, step,
                                extra=extra)

    def save(self, step: int, extra: dict | None = None) -> Path | None:
        """Save a generation for global ``step`` (collective; rank 0 writes, returns its path;
        other ranks return None). ``extra``: a dict of tensors, numbers and strings (e.g. the
        epoch) given back by :meth:`resume`. Raises CheckpointError (disk full, ...)."""
        state = self.state(step, extra)
        path = self.store.save(state, step=step) if self.comm.rank == 0 else None
        self.comm.barrier()  # nobody exits before the file is on disk
        return path

    def resume(self) -> tuple[int, dict]:
        """Restore the newest verified checkpoint, if any: model, optimizer, scheduler, this
        rank's RNG streams. Returns ``(global_step, extra)``: ``(0, {})`` when there is none.
        Collective (rank 0 reads and broadcasts). Raises CheckpointError when checkpoints
        exist but none is usable."""
        state = None
        if self.comm.rank == 0:
            loaded = self.store.latest()
            state = loaded.state if loaded is not None else None
        state = self.comm.broadcast_object(state, 0) if self.comm.world_size > 1 else state
        if state is None:
            return 0, {}
        step = restore_state(state, self.model, self.optimizer, self.scheduler, comm=self.comm,
                             seed=self.seed)
        return step, dict(state.get("extra") or {})

    def step_done(self, step: int, extra: dict | None = None) -> None:
        """Call after every optimizer step on every rank, with the global step count so far.
        One 1-element allreduce; when any rank received SIGUSR2/SIGTERM, saves step ``step``
        and exits with status 75 on every rank (``SystemExit(75)``). Inside an accumulation
        window (hpclb's loop: ``step()`` after every micro-batch, the window's gradients not yet
        reduced) it does nothing until the window's last ``step()``: a checkpoint never holds
        half a window, whose gradients it does not save (the ranks' windows are in step, so all
        of them skip the same calls)."""
        if getattr(getattr(self.optimizer, "sync", None), "micro_batches", 0):
            return
        if self.flag.agreed(self.comm):
            path = self.save(step, extra)
            if path is not None:
                print(f"hpclb: preempted: checkpoint of step {step} saved to {path}; exit "
                      f"{PREEMPTED_EXIT_CODE} (requeue, then resume)", file=sys.stderr, flush=True)
            self.close()
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        """Restore the signal handlers that were installed before."""
        self.flag.restore()
