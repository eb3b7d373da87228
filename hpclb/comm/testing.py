"""Helpers for tests of collective code: verdicts shared across ranks, and a fake world.

``assert_all`` is how MPI tests fail: every rank contributes its verdict, every rank raises the
same AssertionError naming the ranks that failed, so no rank is left waiting in the next
collective while another has already failed out of the test.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from hpclb.comm.base import Communicator, SideChannel, check_op
from hpclb.comm.local import SelfCommunicator

__all__ = ["assert_all", "ScaledComm"]


def assert_all(comm: Communicator, ok: bool, detail: str = "") -> None:
    """Raise AssertionError on every rank unless ``ok`` holds on every rank (one allgather).
    The message names each failing rank with its ``detail``."""
    verdicts = comm.allgather_object((bool(ok), str(detail)))
    bad = [(r, d) for r, (good, d) in enumerate(verdicts) if not good]
    if bad:
        raise AssertionError("; ".join(f"rank {r}: {d or 'failed'}" for r, d in bad))


class ScaledComm(SelfCommunicator):
    """A pretend world of ``world_size`` identical ranks inside one process: ``allreduce_`` sum
    multiplies by ``world_size`` *in the tensor's dtype* (so fp16 overflows where a real sum
    would), max/min leave the tensor as it is, ``allgather_object`` repeats this rank's object.
    ``side`` is an optional :class:`SideChannel` for watchdog tests.
    """

    backend = "scaled"

    def __init__(self, world_size: int, side: SideChannel | None = None):
        self.rank, self.world_size, self.local_rank, self.local_size = 0, world_size, 0, 1
        self._side = side
        self.calls = 0

    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        check_op(op)
        self.calls += 1
        if op == "sum":
            tensor.mul_(self.world_size)
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)

    def side_channel(self) -> SideChannel | None:
        return self._side
