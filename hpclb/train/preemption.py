"""Preemption-safe checkpoints for library users: what ``hpclb train`` does, for one's own loop.

SIGUSR2 or SIGTERM (what SLURM and PBS send before they preempt a job) only sets a flag
(:class:`~hpclb.train.loop.PreemptionFlag`); :meth:`Checkpointer.step_done`, called once per
optimizer step on every rank, agrees on it with one 1-element allreduce, so every rank sees the
request at the same step. Then rank 0 saves a generation (:class:`~hpclb.train.checkpoint.
CheckpointStore`: atomic, SHA-256 verified, the last ``keep`` kept) holding the model, the
optimizer, the scheduler, every rank's RNG state and ``extra``, and every rank exits with status
75 (``EX_TEMPFAIL``: the job scripts requeue on it). :meth:`Checkpointer.resume` in the next job
restores all of it, each rank its own RNG streams, so the run continues as if uninterrupted.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpclb.comm.base import Communicator
from hpclb.comm.world import current_communicator
from hpclb.errors import PREEMPTED_EXIT_CODE
from hpclb.train.checkpoint import CheckpointStore
from hpclb.train.loop import PreemptionFlag
from hpclb.train.rng import resume_rank_rng, rng_state

__all__ = ["Checkpointer"]


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
        """The checkpoint of global ``step`` on rank 0 (None elsewhere). Collective: every
        rank's RNG state is gathered (one allgather)."""
        rngs = self.comm.allgather_object(rng_state())
        if self.comm.rank != 0:
            return None
        return {"global_step": int(step), "world_size": self.comm.world_size,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "rng": rngs, "extra": extra or {}}

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
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        step = int(state["global_step"])
        resume_rank_rng(state["rng"], seed=self.seed, rank=self.comm.rank,
                        world_size=self.comm.world_size, step=step)
        return step, dict(state.get("extra") or {})

    def step_done(self, step: int, extra: dict | None = None) -> None:
        """Call after every optimizer step on every rank, with the global step count so far.
        One 1-element allreduce; when any rank received SIGUSR2/SIGTERM, saves step ``step``
        and exits with status 75 on every rank (``SystemExit(75)``)."""
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
