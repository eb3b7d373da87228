"""Preemption: the signal flag and the ranks' agreement on it (``hpclb train`` and the library's
:class:`~hpclb.train.checkpointer.Checkpointer`).

SIGUSR2/SIGTERM (what SLURM and PBS send before they preempt a job) only set a flag, since a
signal handler may run between any two bytecodes; :meth:`PreemptionFlag.agreed`, called once per
step on every rank, turns it into one decision with a 1-element allreduce (max), so every rank
checkpoints and stops at the same step. The same allreduce carries rank 0's periodic-checkpoint
clock (``--checkpoint-interval``) and, in ``hpclb train``, a Ctrl-C.
"""
from __future__ import annotations

import signal
import time

import torch

from hpclb.comm.base import Communicator

__all__ = ["PreemptionFlag"]


class PreemptionFlag:
    """SIGUSR2/SIGTERM handlers that only set a flag (no I/O in the handler).

    With ``interrupt`` (``hpclb train``'s loop) SIGINT is handled too: the first Ctrl-C sets
    the flag as USR2 does (a checkpoint at the next step, then the run stops: ``interrupted``
    on every rank), a second one raises KeyboardInterrupt at once."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self, interrupt: bool = False,
                 checkpoint_interval_s: float | None = None) -> None:
        self.requested = False
        self.interrupted = False  # agreed: the stop was asked for by Ctrl-C, not a scheduler
        self._ctrl_c = False
        # Periodic checkpoints ride on the same allreduce: when rank 0's clock says one is due
        # (every checkpoint_interval_s; None/0: never), agreed() sets checkpoint_now on every rank.
        self.checkpoint_now = False
        self.checkpoint_interval_s = checkpoint_interval_s
        self.checkpoint_saved()
        self._previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        if interrupt:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        # a signal the CLI recorded before the loop began (hpclb.cli.common.PendingSignal) counts
        self.requested = self.requested or any(getattr(h, "pending", False)
                                               for h in self._previous.values())

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def _interrupt(self, signum, frame) -> None:
        if self._ctrl_c:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self._ctrl_c = self.requested = True

    def checkpoint_saved(self) -> None:
        """Restart the periodic-checkpoint clock: a checkpoint was just saved (or the run
        starts)."""
        self._last_checkpoint = time.monotonic()

    def agreed(self, comm: Communicator) -> bool:
        """True on every rank when any rank received a signal (one 1-element allreduce); the same
        allreduce sets ``checkpoint_now`` on every rank when rank 0's clock is
        ``checkpoint_interval_s`` past :meth:`checkpoint_saved`, and
        ``interrupted`` when the signal was a Ctrl-C."""
        interval = self.checkpoint_interval_s
        due = bool(interval and comm.rank == 0 and
                   time.monotonic() - self._last_checkpoint >= interval)
        mine = 3.0 if self._ctrl_c else 2.0 if self.requested else (1.0 if due else 0.0)
        if comm.world_size > 1:
            mine = comm.allreduce_(torch.tensor([mine]), op="max").item()
        self.checkpoint_now = mine == 1.0
        self.interrupted = mine == 3.0
        return mine >= 2.0

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
