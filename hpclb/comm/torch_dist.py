"""The ``torch`` backend: ``torch.distributed`` with Gloo on CPU, NCCL on GPU.

Rendezvous: under ``torchrun`` the usual ``env://`` variables; under ``mpirun``/``srun`` rank 0
opens a ``TCPStore`` on a free port and tells the others its address through mpi4py (one
broadcast at start-up), so no ``MASTER_ADDR``/``MASTER_PORT`` is needed. NCCL picks its ring/tree
algorithm itself; ``NCCL_ALGO=Ring`` forces the ring (README, "Gradient synchronisation and
scaling").
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .base import Communicator, Handle, SideChannel, check_op, launcher_world_size

STORE_TIMEOUT_S = 300.0


class _TorchHandle(Handle):
    def __init__(self, work, tensor: Tensor):
        self._work, self._tensor = work, tensor

    def wait(self) -> Tensor:
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
    ``(store, rank)``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != world_size:
        raise RuntimeError(f"the launcher started {world_size} ranks but MPI reports "
                           f"{comm.Get_size()}: use the mpirun of the MPI mpi4py was built with")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    single_node = node.Get_size() == world_size
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
    return store, rank


def _default_store(dist):
    """The default group's key-value store (for the side channel), or None where torch keeps
    it private."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class TorchCommunicator(Communicator):
    """The default ``torch.distributed`` process group (created here unless one exists).

    ``device``: ``"cpu"`` (Gloo) or ``"cuda"`` (NCCL; tensors must live on this rank's GPU);
    default ``cuda`` when a GPU is visible. Raises RuntimeError when neither torchrun's variables
    nor an MPI launcher tell the ranks how to meet.
    """

    backend = "torch"
    async_progress = True

    def __init__(self, device: str | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        pg_backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._store = None
        if not dist.is_initialized():
            launched = launcher_world_size()
            if all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                               "MASTER_PORT")):
                dist.init_process_group(pg_backend, init_method="env://",
                                        timeout=timedelta(seconds=STORE_TIMEOUT_S))
                self._store = _default_store(dist)
            elif launched is not None:
                self._store, rank = _mpi_rendezvous(launched)
                dist.init_process_group(pg_backend, store=dist.PrefixStore("pg", self._store),
                                        rank=rank, world_size=launched)
            else:
                self._store = dist.HashStore()
                dist.init_process_group(pg_backend, store=dist.PrefixStore("pg", self._store),
                                        rank=0, world_size=1)
        else:
            self._store = _default_store(dist)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK",
                                             os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE",
                                             os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN}
        self._side: _StoreSideChannel | None = None

    def _check(self, tensor: Tensor, op: str = "sum") -> None:
        check_op(op)
        if not tensor.is_contiguous():
            raise ValueError("collectives need a contiguous tensor; call .contiguous() first")

    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        self._check(tensor, op)
        self._dist.all_reduce(tensor, op=self._ops[op])
        return tensor

    def iallreduce_(self, tensor: Tensor, op: str = "sum", name: str | None = None) -> Handle:
        self._check(tensor, op)
        return _TorchHandle(self._dist.all_reduce(tensor, op=self._ops[op], async_op=True),
                            tensor)

    def broadcast_(self, tensor: Tensor, root: int = 0) -> Tensor:
        self._check(tensor)
        self._dist.broadcast(tensor, src=root)
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=root)
        return box[0]

    def barrier(self) -> None:
        # A zero-byte allreduce, not dist.barrier(): NCCL's barrier guesses a device.
        self._dist.all_reduce(torch.zeros(1, device=self.device))

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
