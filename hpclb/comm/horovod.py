"""The ``horovod`` backend: ``horovod.torch`` (0.28.1; built by ``make install-horovod``).

Horovod runs every collective on its own background thread, which negotiates (by tensor name)
which tensors all ranks have submitted and then reduces them with MPI, Gloo or NCCL. Launch with
``mpirun`` (``horovodrun`` is rejected by Open MPI 5's launcher). Horovod 0.28.1 cannot reduce
bfloat16 tensors; ``allreduce_`` raises TypeError for them.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import Tensor

from hpclb.comm.base import Communicator, Handle, SideChannel, check_collective, on_stream
from hpclb.comm.device import bind_local_gpu

__all__ = ["HorovodCommunicator"]


class _HorovodHandle(Handle):
    def __init__(self, hvd, handle, tensor: Tensor):
        self._hvd, self._handle, self._tensor, self._done = hvd, handle, tensor, False

    def wait(self) -> Tensor:
        if not self._done:
            self._hvd.synchronize(self._handle)
            self._done = True
        return self._tensor

    def test(self) -> bool:
        if not self._done and self._hvd.poll(self._handle):
            self.wait()
        return self._done


class HorovodCommunicator(Communicator):
    """Horovod's world (``hvd.init()`` once per process).

    device: ``"auto"``/None (cuda when a GPU is visible), ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"``. On CUDA the rank binds GPU ``hvd.local_rank() % visible GPUs`` (or ``N``)
    with ``torch.cuda.set_device`` right after ``hvd.init()``, as Horovod requires; Horovod
    then reduces CUDA tensors with NCCL when it was built with it (``make install-horovod`` on
    a CUDA machine), else through host memory. Raises ImportError (with the build recipe) when
    ``horovod.torch`` is not installed.
    """

    backend = "horovod"
    async_progress = True

    @classmethod
    def create(cls, device: str | torch.device = "auto",
               share_gpu: bool = False) -> HorovodCommunicator:
        """Start Horovod on ``device``; RuntimeError when horovod.torch cannot be imported."""
        try:
            return cls(device=device)
        except ImportError as e:
            raise RuntimeError(str(e)) from e

    def __init__(self, device: str | torch.device | None = None) -> None:
        try:
            import horovod.torch as hvd
        except ImportError as e:
            raise ImportError(
                "the horovod backend needs horovod.torch; build it with `make install-horovod` "
                f"(Horovod 0.28.1 against this torch and the venv's Open MPI): {e}") from e
        self._hvd = hvd
        hvd.init()
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.device = bind_local_gpu(device, self.local_rank)
        self._ops = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
        self._side: SideChannel | None = None
        self._n = 0

    def _check(self, tensor: Tensor, op: str) -> None:
        check_collective(tensor, op)
        if tensor.dtype == torch.bfloat16:
            raise TypeError("Horovod 0.28.1 cannot reduce bfloat16 tensors; use fp16 "
                            "compression or the mpi/torch backend")

    def allreduce_(self, tensor: Tensor, op: str = "sum", *, stream: Any = None) -> Tensor:
        self._check(tensor, op)
        with on_stream(stream):  # Horovod orders CUDA work after the current stream's
            self._hvd.allreduce_(tensor, op=self._ops[op])
        return tensor

    def iallreduce_(self, tensor: Tensor, op: str = "sum", name: str | None = None, *,
                    stream: Any = None) -> Handle:
        self._check(tensor, op)
        if name is None:  # Horovod matches collectives across ranks by name
            self._n += 1
            name = f"hpclb.iallreduce.{self._n}"
        with on_stream(stream):
            handle = self._hvd.allreduce_async_(tensor, op=self._ops[op], name=name)
        return _HorovodHandle(self._hvd, handle, tensor)

    def broadcast_(self, tensor: Tensor, root: int = 0, *, stream: Any = None) -> Tensor:
        with on_stream(stream):
            self._hvd.broadcast_(tensor, root_rank=root)
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._hvd.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=root)

    def barrier(self) -> None:
        self._hvd.barrier()

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self._hvd.mpi_enabled():
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(code)
        os._exit(code)

    def side_channel(self) -> SideChannel | None:
        """MPI point-to-point on a duplicate of COMM_WORLD when Horovod runs on MPI (mpi4py
        joins the MPI Horovod initialised); None under Gloo."""
        if self.world_size == 1 or not self._hvd.mpi_enabled():
            return None
        if self._side is None:
            from mpi4py import MPI

            from hpclb.comm.mpi import MPISideChannel
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                return None
            self._side = MPISideChannel(MPI.COMM_WORLD.Dup(), MPI)
        return self._side
