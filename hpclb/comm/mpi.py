"""The ``mpi`` backend (mpi4py): the MPI library's own Allreduce/Iallreduce.

Which algorithm runs is the MPI library's choice. Open MPI 5 (the PyPI wheel) reduces large
messages with ``coll/tuned``'s decision table (ring or Rabenseifner reduce-scatter + allgather for
large messages, recursive doubling for small ones; ``coll/han`` on top when ranks span nodes);
non-blocking ``MPI_Iallreduce`` comes from ``coll/libnbc``, whose automatic choice for an in-place
buffer is a binomial tree at any size, so this backend sets ``coll_libnbc_iallreduce_algorithm=1``
(ring) unless the environment chose. The job templates force the blocking ring with
``OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=ring`` (see
docs/gradient-sync.md).

CUDA tensors (docs/gpus.md): with a CUDA-aware MPI (:func:`cuda_aware_mpi`) the device buffer
goes to MPI directly, once the stream that produced it has finished writing it; otherwise each
bucket is staged through a pinned host buffer on a dedicated copy stream (:class:`HostStaging`),
ordered after the producer stream by a CUDA event, and the copy back is ordered before the
consumer stream (the optimizer's) by another event.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings
from typing import Any

import torch
from torch import Tensor

from hpclb.comm.base import Communicator, Handle, SideChannel, check_op
from hpclb.comm.env import launcher_world_size, node_split_key
from hpclb.comm.streams import TorchCudaAPI

__all__ = [
    "CUDA_AWARE_ENV", "SIDE_TAG", "HostStaging", "MPICommunicator", "MPISideChannel",
    "TorchCudaAPI", "cuda_aware_mpi", "import_mpi"]

SIDE_TAG = 0x4C42  # "LB": the watchdog's messages, on a duplicate of COMM_WORLD
#: Open MPI's libnbc picks a binomial tree for every in-place MPI_Iallreduce (2 log2(p) n bytes
#: per rank instead of the ring's 2n): hpclb's gradient buckets are in place, so the ring (1) is
#: asked for unless the environment chose. MPI_Init reads it, at the first import of mpi4py.MPI.
LIBNBC_IALLREDUCE = ("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")


def import_mpi():
    """``mpi4py.MPI``, imported (so MPI initialised) with :data:`LIBNBC_IALLREDUCE` in the
    environment unless it was imported before. Every import of ``mpi4py.MPI`` in hpclb that can
    be the process's first goes through here: the launch check of
    :func:`hpclb.comm.world.get_communicator` runs before this backend starts, and while it
    imported mpi4py.MPI itself (1a21082, 2026-12-03) MPI_Init ran without the ring: in-place
    MPI_Iallreduce took libnbc's binomial tree (slower, and at 3 ranks or more it sums the
    ranks' gradients in another order: other fp32 bits; 2 ranks add the same two numbers)."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(*LIBNBC_IALLREDUCE)
    from mpi4py import MPI

    return MPI


class _MPIHandle(Handle):
    """An ``MPI_Iallreduce`` in flight; ``finish`` (if any) runs once it completes (the copy
    back of a staged CUDA tensor, or ordering the consumer stream)."""

    def __init__(self, request, tensor: Tensor, finish=None):
        self._req, self._tensor, self._finish_cb, self._done = request, tensor, finish, False

    def wait(self) -> Tensor:
        if not self._done:
            self._req.Wait()
            self._done = True
            if self._finish_cb is not None:
                self._finish_cb()
        return self._tensor

    def test(self) -> bool:
        if not self._done and self._req.Test():
            self._done = True
            if self._finish_cb is not None:
                self._finish_cb()
        return self._done


class MPISideChannel(SideChannel):
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


CUDA_AWARE_ENV = "HPCLB_CUDA_AWARE_MPI"


def _ctypes_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library (Open MPI, MPICH), or None where
    no loaded library has it."""
    import ctypes
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = sorted({line.split()[-1] for line in f if "libmpi" in line.split()[-1]})
    except OSError:
        libs = []
    for path in libs:
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return None


def cuda_aware_mpi(MPI=None) -> bool:
    """Whether MPI can read and write CUDA device memory.

    ``$HPCLB_CUDA_AWARE_MPI`` (0 or 1) decides when set; else mpi4py 4's
    ``MPI.Query_cuda_support()`` where the MPI provides it; else ``MPIX_Query_cuda_support``
    of the loaded MPI library through ctypes (Open MPI, MPICH); else False (stage through host
    memory, always correct). Raises ValueError for another value of the variable.
    """
    raw = os.environ.get(CUDA_AWARE_ENV)
    if raw is not None and raw.strip() != "":
        if raw.strip() not in ("0", "1"):
            raise ValueError(f"{CUDA_AWARE_ENV}={raw!r}: use 1 (MPI reads device memory), 0 "
                             f"(stage through pinned host buffers) or leave it unset (detect)")
        return raw.strip() == "1"
    if MPI is None:
        from mpi4py import MPI
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - NotImplementedError / MPI.Exception by build
            pass
    return bool(_ctypes_cuda_support())


class HostStaging:
    """Pinned host buffers for CUDA buckets, and the stream ordering around them, for an MPI
    that cannot read device memory.

    ``to_host(tensor, producer)``: an event recorded on ``producer`` (the stream that wrote the
    gradients, passed explicitly) is waited on by the copy stream, which then copies the bucket
    into its pinned buffer; the host waits for that copy only (not for the whole device).
    ``to_device(host, tensor, consumer)``: the copy back runs on the copy stream and
    ``consumer`` (the optimizer's) waits on an event recorded after it.

    Buffers: the tensors named by :meth:`keep` (the gradient buckets, which travel every step at
    fixed addresses) each keep one pinned buffer, keyed by address, dtype and size; the copy
    stream orders a bucket's next device->host copy after its last host->device copy. Any other
    tensor (a parameter broadcast, a metrics vector) gets a transient pinned buffer, dropped
    once its collective has finished (torch's pinned-memory cache reuses it; a copy still
    reading it holds it), so one-off collectives pin at most their largest tensor, not a
    model's worth of memory per rank. ``api``: a
    :class:`~hpclb.comm.streams.TorchCudaAPI` (tests: a stand-in recording calls).
    """

    def __init__(self, api):
        self.api = api
        self.copy_stream = api.new_stream()
        self._kept: set[tuple] = set()
        self._buffers: dict[tuple, Tensor] = {}

    @staticmethod
    def _key(tensor: Tensor) -> tuple:
        return tensor.data_ptr(), tensor.dtype, tensor.numel()

    def keep(self, tensors: list[Tensor]) -> None:
        """Keep one pinned buffer for each of ``tensors`` (replacing the previous set; buffers
        of tensors no longer named are released)."""
        self._kept = {self._key(t) for t in tensors}
        self._buffers = {k: v for k, v in self._buffers.items() if k in self._kept}

    @property
    def cached_bytes(self) -> int:
        """Bytes of pinned host memory held between collectives."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer(self, tensor: Tensor) -> Tensor:
        """A pinned host buffer for ``tensor`` (1-D, same dtype and numel): its own, kept, for
        a tensor named by :meth:`keep`; else a new one."""
        key = self._key(tensor)
        if key not in self._kept:
            return self.api.pinned(tensor.numel(), tensor.dtype)
        if key not in self._buffers:
            self._buffers[key] = self.api.pinned(tensor.numel(), tensor.dtype)
        return self._buffers[key]

    def to_host(self, tensor: Tensor, producer) -> Tensor:
        """The bucket's host buffer holding ``tensor`` once ``producer`` has written it."""
        ready = self.api.new_event()
        ready.record(producer)
        self.copy_stream.wait_event(ready)
        host = self.buffer(tensor)
        self.api.copy(host, tensor.reshape(-1), self.copy_stream)
        self.api.record_stream(tensor, self.copy_stream)
        copied = self.api.new_event()
        copied.record(self.copy_stream)
        copied.synchronize()  # MPI reads host memory from the CPU
        return host

    def to_device(self, host: Tensor, tensor: Tensor, consumer) -> None:
        """Copy the reduced ``host`` back into ``tensor``, ordered before ``consumer``'s next
        work."""
        self.api.copy(tensor.reshape(-1), host, self.copy_stream)
        back = self.api.new_event()
        back.record(self.copy_stream)
        consumer.wait_event(back)


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


class _DeviceBuffer:
    """A CUDA tensor as a buffer for a CUDA-aware MPI (``__cuda_array_interface__`` v3, no
    stream: the caller has synchronised the producer). Raises TypeError for dtypes MPI has no
    type for (bfloat16 is staged instead)."""

    TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2",
               torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1",
               torch.uint8: "|u1", torch.bool: "|b1"}

    def __init__(self, tensor: Tensor):
        if tensor.dtype not in self.TYPESTR:
            raise TypeError(f"cannot hand a {tensor.dtype} tensor to MPI")
        self.tensor = tensor
        self.__cuda_array_interface__ = {
            "shape": (tensor.numel(),), "typestr": self.TYPESTR[tensor.dtype],
            "data": (tensor.data_ptr(), False), "strides": None, "version": 3,
            "stream": None}


class MPICommunicator(Communicator):
    """COMM_WORLD through mpi4py. CUDA tensors go to a CUDA-aware MPI as device buffers, else
    through pinned host buffers (:class:`HostStaging`).

    Raises RuntimeError when the launcher started more ranks than MPI sees (an ``mpirun`` from a
    different MPI than the one mpi4py links: every rank would silently train alone).
    """

    backend = "mpi"
    async_progress = False

    def __init__(self) -> None:
        MPI = import_mpi()  # the libnbc ring for in-place Iallreduce (LIBNBC_IALLREDUCE)
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=node_split_key(self.rank))
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
        self._side: MPISideChannel | None = None
        self._stagings: dict[torch.device, HostStaging] = {}
        self._cuda_aware: bool | None = None  # decided at the first CUDA tensor

    def register_buckets(self, tensors: list[Tensor]) -> None:
        """See :meth:`Communicator.register_buckets`: CUDA buckets staged through the host each
        keep one pinned buffer; every other tensor is staged through a transient one."""
        by_device: dict[torch.device, list[Tensor]] = {d: [] for d in self._stagings}
        for t in tensors:
            if self._is_device_tensor(t):
                by_device.setdefault(t.device, []).append(t)
        for device, ts in by_device.items():
            self._stager(device).keep(ts)

    def _stager(self, device: torch.device) -> HostStaging:
        """The device's :class:`HostStaging` (one copy stream and buffer set per device)."""
        if device not in self._stagings:
            self._stagings[device] = HostStaging(self._cuda_api(device))
        return self._stagings[device]

    def _cuda_api(self, device: torch.device):
        return TorchCudaAPI(device)

    def _is_device_tensor(self, tensor: Tensor) -> bool:
        return tensor.device.type != "cpu"

    def _buf_op(self, host: Tensor, op: str):
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy(), _bf16_op(self._MPI, op)
        return host.numpy(), self._ops[op]

    def _prepare(self, tensor: Tensor, op: str, stream):
        """``(buffer for MPI, MPI op, finish)``: ``finish()`` (or None) must run once MPI has
        completed, before anything reads ``tensor``."""
        mpi_op = self._ops.get(op)
        if mpi_op is None:
            check_op(op)  # raises, naming the choices
        if not tensor.is_contiguous():
            raise ValueError("collectives need a contiguous tensor; call .contiguous() first")
        if not self._is_device_tensor(tensor):
            if tensor.dtype == torch.bfloat16:
                return (*self._buf_op(tensor, op), None)
            return tensor.numpy(), mpi_op, None
        stager = self._stager(tensor.device)
        if stream is None:
            stream = stager.api.current_stream()
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi(self._MPI)
        if self._cuda_aware and tensor.dtype != torch.bfloat16:  # bf16's op runs on the host
            done = stager.api.new_event()
            done.record(stream)
            done.synchronize()  # MPI reads the buffer once the producer has written it
            return _DeviceBuffer(tensor), mpi_op, None
        host = stager.to_host(tensor, stream)
        buf, mpi_op = self._buf_op(host, op)
        return buf, mpi_op, lambda: stager.to_device(host, tensor, stream)

    def allreduce_(self, tensor: Tensor, op: str = "sum", *, stream: Any = None) -> Tensor:
        """See :meth:`Communicator.allreduce_`; ``stream``: the CUDA stream that produced
        ``tensor`` and reads the result (CUDA tensors only; default the calling thread's
        current stream)."""
        buf, mpi_op, finish = self._prepare(tensor, op, stream)
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=mpi_op)
        if finish is not None:
            finish()
        return tensor

    def iallreduce_(self, tensor: Tensor, op: str = "sum", name: str | None = None, *,
                    stream: Any = None) -> Handle:
        buf, mpi_op, finish = self._prepare(tensor, op, stream)
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, buf, op=mpi_op)
        return _MPIHandle(req, tensor, finish)

    def broadcast_(self, tensor: Tensor, root: int = 0, *, stream: Any = None) -> Tensor:
        buf, _, finish = self._prepare(tensor, "sum", stream)
        self._comm.Bcast(buf, root=root)
        if finish is not None:
            finish()
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

    def dup(self) -> "MPICommunicator":
        """The same ranks and device over a duplicated MPI communicator (``MPI_Comm_dup``:
        collective, every rank calls it together). Collectives on the copy never match those on
        ``self``, so each may carry its own GradientSync (benchmarks timing several side by
        side)."""
        twin = copy.copy(self)
        twin._comm = self._comm.Dup()
        twin._side, twin._stagings = None, {}
        return twin

    def side_channel(self) -> SideChannel | None:
        if self.world_size == 1 or self.thread_level < self._MPI.THREAD_MULTIPLE:
            return None
        if self._side is None:  # Dup is collective: first called by every rank together
            self._side = MPISideChannel(self._comm.Dup(), self._MPI)
        return self._side
