"""The ``mpi`` backend (mpi4py): the MPI library's own Allreduce/Iallreduce.

Which algorithm runs is the MPI library's choice. Open MPI 5 (the PyPI wheel) reduces large
messages with ``coll/tuned``'s decision table (ring or Rabenseifner reduce-scatter + allgather for
large messages, recursive doubling for small ones; ``coll/han`` on top when ranks span nodes);
non-blocking ``MPI_Iallreduce`` comes from ``coll/libnbc``, whose automatic choice for an in-place
buffer is a binomial tree at any size, so this backend sets ``coll_libnbc_iallreduce_algorithm=1``
(ring) unless the environment chose. The job templates force the blocking ring with
``OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=ring`` (see
README, "Gradient synchronisation and scaling").
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch import Tensor

from .base import Communicator, Handle, SideChannel, check_op, launcher_world_size

SIDE_TAG = 0x4C42  # "LB": the watchdog's messages, on a duplicate of COMM_WORLD


class _MPIHandle(Handle):
    """An ``MPI_Iallreduce`` in flight; ``staged`` holds the host copy of a CUDA tensor."""

    def __init__(self, request, tensor: Tensor, staged: Tensor | None):
        self._req, self._tensor, self._staged, self._done = request, tensor, staged, False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            if self._staged is not None:
                self._tensor.copy_(self._staged)

    def wait(self) -> Tensor:
        if not self._done:
            self._req.Wait()
            self._finish()
        return self._tensor

    def test(self) -> bool:
        if not self._done and self._req.Test():
            self._finish()
        return self._done


class _MPISideChannel(SideChannel):
    """Pickled point-to-point messages on a duplicate of COMM_WORLD (never collides with the
    collectives). Needs ``MPI_THREAD_MULTIPLE``: the watchdog thread calls it while another thread
    may be inside a collective."""

    def __init__(self, comm, MPI):
        self._comm, self._MPI, self._sends = comm, MPI, []

    def send(self, obj: Any, dest: int | None = None) -> None:
        self._sends = [r for r in self._sends if not r.Test()]
        dests = [dest] if dest is not None else [r for r in range(self._comm.Get_size())
                                                 if r != self._comm.Get_rank()]
        for d in dests:
            self._sends.append(self._comm.isend(obj, dest=d, tag=SIDE_TAG))

    def poll(self) -> list[tuple[int, Any]]:
        out = []
        status = self._MPI.Status()
        while True:
            msg = self._comm.improbe(source=self._MPI.ANY_SOURCE, tag=SIDE_TAG, status=status)
            if msg is None:
                return out
            out.append((status.Get_source(), msg.recv()))


_BF16_OPS: dict[str, Any] = {}


def _bf16_op(MPI, op: str):
    """A user-defined MPI op reducing bfloat16 (carried as 16-bit integers: MPI has no bf16)."""
    if op not in _BF16_OPS:
        def reduce(inbuf, inoutbuf, datatype, _op=op):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns on read-only memory
                a = torch.frombuffer(inbuf, dtype=torch.bfloat16)
                b = torch.frombuffer(inoutbuf, dtype=torch.bfloat16)
            if _op == "sum":
                b.add_(a)
            elif _op == "max":
                torch.maximum(a, b, out=b)
            else:
                torch.minimum(a, b, out=b)
        _BF16_OPS[op] = MPI.Op.Create(reduce, commute=True)
    return _BF16_OPS[op]


class MPICommunicator(Communicator):
    """COMM_WORLD through mpi4py. CUDA tensors are staged through host memory (after
    synchronising the current stream).

    Raises RuntimeError when the launcher started more ranks than MPI sees (an ``mpirun`` from a
    different MPI than the one mpi4py links: every rank would silently train alone).
    """

    backend = "mpi"
    async_progress = False

    def __init__(self) -> None:
        # Open MPI's libnbc picks a binomial tree for every in-place MPI_Iallreduce (2 log2(p) n
        # bytes per rank instead of the ring's 2n): hpclb's gradient buckets are in place, so
        # ask for the ring unless the user chose. Read at MPI_Init: effective only when this is
        # the first import of mpi4py.MPI (it is, via get_communicator, in `hpclb train`).
        if "mpi4py.MPI" not in sys.modules:
            os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")
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
        self.thread_level = MPI.Query_thread()
        # A communication thread needs at least SERIALIZED; the watchdog's side channel MULTIPLE.
        self.thread_safe = self.thread_level >= MPI.THREAD_SERIALIZED
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._side: _MPISideChannel | None = None

    def _host(self, tensor: Tensor) -> tuple[Tensor, bool]:
        if not tensor.is_contiguous():
            raise ValueError("collectives need a contiguous tensor; call .contiguous() first")
        if tensor.device.type == "cpu":
            return tensor, False
        torch.cuda.current_stream(tensor.device).synchronize()
        return tensor.cpu(), True

    def _buf_op(self, host: Tensor, op: str):
        check_op(op)
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy(), _bf16_op(self._MPI, op)
        return host.numpy(), self._ops[op]

    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        check_op(op)
        host, staged = self._host(tensor)
        buf, mpi_op = self._buf_op(host, op)
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=mpi_op)
        if staged:
            tensor.copy_(host)
        return tensor

    def iallreduce_(self, tensor: Tensor, op: str = "sum", name: str | None = None) -> Handle:
        check_op(op)
        host, staged = self._host(tensor)
        buf, mpi_op = self._buf_op(host, op)
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, buf, op=mpi_op)
        return _MPIHandle(req, tensor, host if staged else None)

    def broadcast_(self, tensor: Tensor, root: int = 0) -> Tensor:
        host, staged = self._host(tensor)
        buf = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
        self._comm.Bcast(buf.numpy(), root=root)
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

    def side_channel(self) -> SideChannel | None:
        if self.world_size == 1 or self.thread_level < self._MPI.THREAD_MULTIPLE:
            return None
        if self._side is None:  # Dup is collective: first called by every rank together
            self._side = _MPISideChannel(self._comm.Dup(), self._MPI)
        return self._side
