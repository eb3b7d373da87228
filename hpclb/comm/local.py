"""The ``self`` backend: one process, every collective is the identity."""
from __future__ import annotations

import os
from typing import Any

from torch import Tensor

from hpclb.comm.base import Communicator, check_collective

__all__ = ["SelfCommunicator"]


class SelfCommunicator(Communicator):
    """World of one rank (used when not launched under MPI)."""

    backend = "self"

    def __init__(self) -> None:
        self.rank, self.world_size, self.local_rank, self.local_size = 0, 1, 0, 1

    def allreduce_(self, tensor: Tensor, op: str = "sum", *, stream: Any = None) -> Tensor:
        check_collective(tensor, op)
        return tensor

    def broadcast_(self, tensor: Tensor, root: int = 0, *, stream: Any = None) -> Tensor:
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        os._exit(code)
