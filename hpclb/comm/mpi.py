"""The ``mpi`` backend (mpi4py): the MPI library's own Allreduce (ring/recursive algorithms are
chosen by the MPI's tuned collectives; see the job templates for forcing ring)."""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from .base import Communicator, launcher_world_size


class MPICommunicator(Communicator):
    """COMM_WORLD through mpi4py. CUDA tensors are staged through host memory.

    Raises RuntimeError when the launcher started more ranks than MPI sees (an ``mpirun`` from a
    different MPI than the one mpi4py links: every rank would silently train alone).
    """

    backend = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        launched = launcher_world_size()
        if launched is not None and launched != self.world_size:
            raise RuntimeError(
                f"the launcher started {launched} ranks but MPI reports world size "
                f"{self.world_size}: the mpirun/srun used belongs to a different MPI than the one "
                f"mpi4py was built with ({MPI.Get_library_version().splitlines()[0].strip()}). "
                f"Launch with that MPI's mpirun (in the venv: .venv/bin/mpirun, or `make train "
                f"NP=N`), or install mpi4py against your cluster's MPI.")
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def _host(self, tensor: Tensor) -> tuple[Tensor, bool]:
        if not tensor.is_contiguous():
            raise ValueError("collectives need a contiguous tensor; call .contiguous() first")
        if tensor.device.type == "cpu":
            return tensor, False
        torch.cuda.current_stream(tensor.device).synchronize()
        return tensor.cpu(), True

    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        if op not in self._ops:
            raise ValueError(f"unknown reduction {op!r}; use sum, max or min")
        host, staged = self._host(tensor)
        self._comm.Allreduce(self._MPI.IN_PLACE, host.numpy(), op=self._ops[op])
        if staged:
            tensor.copy_(host)
        return tensor

    def broadcast_(self, tensor: Tensor, root: int = 0) -> Tensor:
        host, staged = self._host(tensor)
        self._comm.Bcast(host.numpy(), root=root)
        if staged:
            tensor.copy_(host)
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._comm.Abort(code)
