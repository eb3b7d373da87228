"""The ``torch`` backend: ``torch.distributed`` with Gloo on CPU, NCCL on GPU.

On a GPU the default group is NCCL and carries the CUDA tensors (gradient buckets, parameter
broadcast); a second, Gloo group carries the CPU tensors and the pickled objects (agreement
checks, the preemption flag, metrics), so each call is routed by its tensor's device. When ranks
share a GPU (``--share-gpu``; NCCL refuses two ranks on one device) Gloo carries everything,
CUDA tensors included.

Rendezvous: under ``torchrun`` the usual ``env://`` variables; under ``mpirun``/``srun`` rank 0
opens a ``TCPStore`` on a free port and tells the others its address through mpi4py (one
broadcast at start-up), so no ``MASTER_ADDR``/``MASTER_PORT`` is needed. NCCL picks its ring/tree
algorithm itself; ``NCCL_ALGO=Ring`` forces the ring (docs/gradient-sync.md,
"Which algorithm runs").
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from hpclb.comm.base import Communicator, Handle, SideChannel, check_collective, on_stream
from hpclb.comm.device import bind_local_gpu
from hpclb.comm.env import (
    env_local_rank,
    launcher_world_size,
    local_size,
    node_split_key,
    torchrun_started,
)

__all__ = ["STORE_TIMEOUT_S", "TorchCommunicator"]

STORE_TIMEOUT_S = 300.0


def _destroy_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, before it finalizes (a
    group hpclb created; one the script made itself is left to it). Left alive, Gloo's worker
    threads drop their last reference to a collective's tensor while Python shuts down, and the
    process aborts (SIGABRT, "terminate called without an active exception") after its work is
    done: a run that succeeded exited 134. Registered once; ``abort`` (``os._exit``) skips it."""
    global _EXIT_HOOKED
    if _EXIT_HOOKED:
        return
    _EXIT_HOOKED = True

    def destroy() -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


_EXIT_HOOKED = False


class _TorchHandle(Handle):
    """A ``torch.distributed`` work; ``wait()`` orders ``stream`` (the consumer, for CUDA
    tensors) after the collective, whichever thread calls it."""

    def __init__(self, work, tensor: Tensor, stream=None):
        self._work, self._tensor, self._stream = work, tensor, stream

    def wait(self) -> Tensor:
        with on_stream(self._stream):
            self._work.wait()
        return self._tensor

    def test(self) -> bool:
        return self._work.is_completed()


class _StoreSideChannel(SideChannel):
    """Messages through the rendezvous key-value store: each rank's inbox is a key holding the
    list of messages not yet read; a counter key tells pollers when anything changed."""

    PREFIX = "hpclb/side"

    def __init__(self, store, rank: int, world_size: int):
        self._store, self._rank, self._size, self._seen = store, rank, world_size, -1

    def send(self, obj: Any, dest: int | None = None) -> None:
        dests = [dest] if dest is not None else [r for r in range(self._size) if r != self._rank]
        for d in dests:
            n = self._store.add(f"{self.PREFIX}/{d}/n", 1)
            self._store.set(f"{self.PREFIX}/{d}/{n}", pickle.dumps((self._rank, obj)))

    def poll(self) -> list[tuple[int, Any]]:
        n = self._store.add(f"{self.PREFIX}/{self._rank}/n", 0)
        out = []
        start = max(self._seen, 0) + 1
        for i in range(start, n + 1):
            key = f"{self.PREFIX}/{self._rank}/{i}"
            if not self._store.check([key]):
                return out  # written on the next poll
            out.append(pickle.loads(self._store.get(key)))
            self._store.delete_key(key)
            self._seen = i
        return out


def _mpi_rendezvous(world_size: int):
    """Rank 0 serves a TCPStore on a free port; mpi4py tells the others where. Returns
    ``(store, rank, local_rank, local_size)`` (node-local: MPI's shared-memory split)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != world_size:
        raise RuntimeError(f"the launcher started {world_size} ranks but MPI reports "
                           f"{comm.Get_size()}: use the mpirun of the MPI mpi4py was built with")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=node_split_key(rank))
    local_rank, local_size = node.Get_rank(), node.Get_size()
    single_node = local_size == world_size
    node.Free()
    store = None
    if rank == 0:
        host = "127.0.0.1" if single_node else os.environ.get("MASTER_ADDR",
                                                              socket.gethostname())
        store = torch.distributed.TCPStore(host, 0, world_size, is_master=True,
                                           timeout=timedelta(seconds=STORE_TIMEOUT_S),
                                           wait_for_workers=False)
        where = (host, store.port)
    else:
        where = None
    host, port = comm.bcast(where, root=0)
    if rank != 0:
        store = torch.distributed.TCPStore(host, port, world_size, is_master=False,
                                           timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return store, rank, local_rank, local_size


def init_default_group(comm: Communicator) -> None:
    """Give a script that calls ``torch.distributed`` directly (``DistributedSampler(ds)``
    without arguments, ``dist.all_reduce`` of a metric) a default process group over Gloo whose
    ranks are ``comm``'s (e.g. MPI's under ``mpirun``): rank 0 serves a TCPStore on a free port
    (127.0.0.1 when every rank is on one node, else ``$MASTER_ADDR`` or its host name) and
    ``comm`` tells the others where; ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` are exported as torchrun does (:func:`set_torchrun_variables`).
    Collective. A group that exists already is kept when its
    rank and size are ``comm``'s (under torchrun it is the communicator's own); RuntimeError
    otherwise."""
    import torch.distributed as dist

    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (comm.rank, comm.world_size):
            raise RuntimeError(f"torch.distributed is already initialised as rank "
                               f"{dist.get_rank()} of {dist.get_world_size()}, but this "
                               f"process is rank {comm.rank} of {comm.world_size}")
        return
    if comm.world_size == 1:
        store = dist.HashStore()
    else:
        where = None
        if comm.rank == 0:
            host = "127.0.0.1" if comm.local_size == comm.world_size else \
                os.environ.get("MASTER_ADDR", socket.gethostname())
            store = dist.TCPStore(host, 0, comm.world_size, is_master=True,
                                  timeout=timedelta(seconds=STORE_TIMEOUT_S),
                                  wait_for_workers=False)
            where = (host, store.port)
        host, port = comm.broadcast_object(where, 0)
        if comm.rank != 0:
            store = dist.TCPStore(host, port, comm.world_size, is_master=False,
                                  timeout=timedelta(seconds=STORE_TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore("hpclb.default", store),
                            rank=comm.rank, world_size=comm.world_size,
                            timeout=timedelta(seconds=STORE_TIMEOUT_S))
    _destroy_at_exit()
    set_torchrun_variables(comm)


def set_torchrun_variables(comm: Communicator) -> None:
    """Export what torchrun gives a script — ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` — from ``comm``, so code that reads them (``int(os.environ[
    "LOCAL_RANK"])``) works under ``mpirun`` too. A variable already set to another value is
    left alone (the launcher's word stands; the start-up check compares them)."""
    for name, value in (("RANK", comm.rank), ("WORLD_SIZE", comm.world_size),
                        ("LOCAL_RANK", comm.local_rank), ("LOCAL_WORLD_SIZE", comm.local_size)):
        os.environ.setdefault(name, str(value))


def _default_store(dist):
    """The default group's key-value store (for the side channel), or None where torch keeps
    it private."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class TorchCommunicator(Communicator):
    """The default ``torch.distributed`` process group (created here unless one exists).

    device: ``"cpu"`` (Gloo), ``"cuda"``/``"cuda:N"`` (NCCL for CUDA tensors and a Gloo group
    for CPU tensors and objects; ``cuda`` alone takes GPU ``local_rank % visible GPUs``) or
    ``"auto"``/None (cuda when a GPU is visible). share_gpu: ranks of a node share GPUs, so
    CUDA tensors go through Gloo too. Raises RuntimeError when neither torchrun's variables
    nor an MPI launcher tell the ranks how to meet.
    """

    backend = "torch"
    async_progress = True

    @classmethod
    def create(cls, device: str | torch.device = "auto",
               share_gpu: bool = False) -> TorchCommunicator:
        """Start torch.distributed on ``device`` (NCCL for CUDA unless ranks share a GPU)."""
        return cls(device=device, share_gpu=share_gpu)

    def __init__(self, device: str | torch.device | None = None, *,
                 share_gpu: bool = False) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._store, self._cpu_group = None, None
        if dist.is_initialized():
            self._store = _default_store(dist)
            self.local_rank, self.local_size = env_local_rank() or 0, local_size()
            self.device = bind_local_gpu(device, self.local_rank)
            if self.device.type == "cuda" and "nccl" in str(dist.get_backend()):
                self._cpu_group = dist.new_group(backend="gloo")
        else:
            self._init_group(device, share_gpu)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN}
        self._side: _StoreSideChannel | None = None

    def _init_group(self, device, share_gpu: bool) -> None:
        dist = self._dist
        launched, torchrun = launcher_world_size(), torchrun_started()
        if torchrun:
            self.local_rank, self.local_size = env_local_rank() or 0, local_size()
        elif launched is not None:
            store, rank, self.local_rank, self.local_size = _mpi_rendezvous(launched)
        else:
            self.local_rank, self.local_size = 0, 1
        self.device = bind_local_gpu(device, self.local_rank)  # before NCCL initialises
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        nccl = self.device.type == "cuda" and not (share_gpu and self.local_size > gpus)
        pg_backend = "nccl" if nccl else "gloo"
        if torchrun:
            dist.init_process_group(pg_backend, init_method="env://",
                                    timeout=timedelta(seconds=STORE_TIMEOUT_S))
            self._store = _default_store(dist)
        elif launched is not None:
            self._store = store
            dist.init_process_group(pg_backend, store=dist.PrefixStore("pg", store),
                                    rank=rank, world_size=launched)
        else:
            self._store = dist.HashStore()
            dist.init_process_group(pg_backend, store=dist.PrefixStore("pg", self._store),
                                    rank=0, world_size=1)
        _destroy_at_exit()
        if nccl:  # every rank creates it at the same point (new_group is collective)
            self._cpu_group = dist.new_group(backend="gloo")

    def _group(self, tensor: Tensor):
        """The group for ``tensor``: Gloo for CPU tensors beside an NCCL default group."""
        return self._cpu_group if tensor.device.type == "cpu" else None

    def allreduce_(self, tensor: Tensor, op: str = "sum", *, stream: Any = None) -> Tensor:
        check_collective(tensor, op)
        with on_stream(stream):
            self._dist.all_reduce(tensor, op=self._ops[op], group=self._group(tensor))
        return tensor

    def iallreduce_(self, tensor: Tensor, op: str = "sum", name: str | None = None, *,
                    stream: Any = None) -> Handle:
        check_collective(tensor, op)
        with on_stream(stream):
            work = self._dist.all_reduce(tensor, op=self._ops[op], group=self._group(tensor),
                                         async_op=True)
        return _TorchHandle(work, tensor, stream)

    def broadcast_(self, tensor: Tensor, root: int = 0, *, stream: Any = None) -> Tensor:
        check_collective(tensor)
        with on_stream(stream):
            self._dist.broadcast(tensor, src=root, group=self._group(tensor))
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._cpu_group)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=root, group=self._cpu_group)
        return box[0]

    def barrier(self) -> None:
        # A one-element CPU allreduce through Gloo, not dist.barrier() (NCCL's guesses a device)
        # nor an NCCL allreduce (it returns before the peers arrive).
        t = torch.zeros(1)
        self._dist.all_reduce(t, group=self._cpu_group)

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # peers' next collective fails on the closed connection; mpirun ends all

    def side_channel(self) -> SideChannel | None:
        if self.world_size == 1 or self._store is None:
            return None
        if self._side is None:
            self._side = _StoreSideChannel(self._store, self.rank, self.world_size)
        return self._side
