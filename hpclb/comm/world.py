"""This process's communicator: created once by :func:`get_communicator` for the backend asked
for, with this rank's device bound before MPI/NCCL initialise; :func:`current_communicator`
returns it to the library (``hpclb.init``, ``DistributedOptimizer``)."""
from __future__ import annotations

import os
import socket

from hpclb.comm.base import Communicator
from hpclb.comm.device import select_device, share_gpu_requested, visible_gpu_uuids
from hpclb.comm.env import env_local_rank, launcher_kind, launcher_world_size
from hpclb.comm.registry import backend_available, backend_class, resolve_backend
from hpclb.errors import ConfigError

__all__ = ["get_communicator", "current_communicator", "has_communicator", "gpu_peers"]

_world: Communicator | None = None


def get_communicator(backend: str = "auto", *, device: str = "auto",
                     share_gpu: bool = False) -> Communicator:
    """The process's communicator (created once), with ``comm.device`` the device this rank
    trains on.

    backend: see :func:`resolve_backend`. device: ``auto`` (cuda when a GPU is visible),
    ``cpu`` or ``cuda``; share_gpu: allow more ranks than GPUs on a node (tests on one GPU;
    ``$HPCLB_SHARE_GPU=1`` allows it as well, for scripts: :func:`share_gpu_requested`).
    Where the launcher sets a node-local rank (:func:`hpclb.comm.device.env_local_rank`) the GPU is
    bound *before* MPI/NCCL initialise; afterwards the communicator's node-local rank (MPI's
    shared-memory split) must agree with the launcher's, and the device is chosen among the
    ranks of the node that see the same GPUs (so per-task GPU binding, one GPU per rank, is
    not "sharing"). One process without a launcher is local rank 0.

    Raises ValueError for an unknown backend name; ConfigError (a ValueError) for a bad
    ``device``, ``cuda`` without CUDA, more ranks than GPUs without ``share_gpu``, or a
    launcher local rank that disagrees with the communicator's, a bad ``$HPCLB_SHARE_GPU``, or
    ranks of one MPI launch asking for different backends or GPU sharing
    (:func:`_agree_launch`, on every rank); RuntimeError when the
    backend's library is not installed, on a launch that does not match the library in use, or
    when a communicator of another backend already exists in this process.
    """
    global _world
    backend = resolve_backend(backend)
    share_gpu = share_gpu_requested(share_gpu)
    if _world is not None:
        if _world.backend != backend:
            raise RuntimeError(f"communicator already created with backend {_world.backend!r}")
        return _world
    try:
        env_rank, env_error = env_local_rank(), None
    except ConfigError as e:  # raised on every rank after the communicator exists, below
        env_rank, env_error = None, str(e)
    early = None
    if env_rank is not None:  # bind the GPU before MPI/NCCL open a CUDA context
        early = select_device(device, env_rank, 1)
    _agree_launch(backend, share_gpu)
    comm = backend_class(backend).create(early if early is not None else device, share_gpu)
    _check_local_ranks(comm, env_rank, env_error)
    local_rank, local_size = gpu_peers(comm, device)
    comm.device = select_device(device, local_rank, local_size, share_gpu=share_gpu)
    _world = comm
    return _world


def _agree_launch(backend: str, share_gpu: bool) -> None:
    """Under an MPI launcher (mpirun, srun, Hydra) of several ranks, compare every rank's
    concrete ``backend`` and ``share_gpu`` (``--share-gpu`` or ``$HPCLB_SHARE_GPU``: with the
    torch backend on GPUs it picks Gloo or NCCL) through mpi4py (one allgather on
    ``COMM_WORLD``) before any backend starts: ranks that start different libraries or groups
    would otherwise wait for each other forever. Raises the same ConfigError on every rank,
    naming the setting and each rank's choice. Without an MPI launcher, or without mpi4py,
    nothing to compare with."""
    if launcher_kind() != "mpi" or (launcher_world_size() or 1) < 2 \
            or not backend_available("mpi"):
        return
    from hpclb.comm.mpi import import_mpi

    MPI = import_mpi()  # MPI_Init with hpclb's Open MPI settings, as the mpi backend would

    everyone = MPI.COMM_WORLD.allgather((backend, share_gpu))
    differ = [_differing(name, [mine[i] for mine in everyone]) for i, name in enumerate((
        "the communication backend (--backend, or hpclb.init's backend)",
        "--share-gpu (or $HPCLB_SHARE_GPU)"))]
    differ = [d for d in differ if d]
    if differ:
        raise ConfigError(f"the ranks disagree on {'; '.join(differ)}; launch every rank with "
                          f"the same --backend (or none: auto takes mpi under mpirun/srun) and "
                          f"the same --share-gpu and $HPCLB_SHARE_GPU")


def _differing(name: str, values: list) -> str | None:
    """``"<name>: <v> on rank 0 but <w> on ranks 1, 2"``, or None when every rank agrees."""
    by_value: dict = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    if len(by_value) == 1:
        return None
    first, *others = [f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                      for value, r in by_value.items()]
    return f"{name}: {first} but {', '.join(others)}"


def _check_local_ranks(comm: Communicator, env_rank: int | None, env_error: str | None
                       ) -> None:
    """Every rank checks that the launcher's node-local rank (``env_rank``; None without a
    launcher) is the communicator's, or reports why its launcher variables are unusable
    (``env_error``); one allgather, and all ranks raise ConfigError together naming the first
    ranks concerned: a rank raising alone would leave the others in their first collective."""
    mine = None
    if env_error is not None:
        mine = f"rank {comm.rank}: {env_error}"
    elif env_rank is not None and env_rank != comm.local_rank:
        mine = (f"rank {comm.rank}: the launcher says node-local rank {env_rank}, the "
                f"{comm.backend} backend finds {comm.local_rank} (of {comm.local_size})")
    bad = [m for m in comm.allgather_object(mine) if m]
    if bad:
        raise ConfigError(
            f"the launcher's node-local ranks are unusable on {len(bad)} rank(s) "
            f"({'; '.join(bad[:4])}): the launcher's variables were inherited or exported by "
            f"hand; launch with one launcher (mpirun, srun or torchrun) and unset stale "
            f"SLURM_LOCALID/LOCAL_RANK")


def current_communicator() -> Communicator:
    """The communicator :func:`get_communicator` (or :func:`hpclb.init`) made: one per process.
    Raises RuntimeError naming the fix before there is one."""
    if _world is None:
        raise RuntimeError("call hpclb.init() first (it starts the communicator)")
    return _world


def has_communicator() -> bool:
    """Whether :func:`get_communicator` has made this process's communicator."""
    return _world is not None


def gpu_peers(comm: Communicator, device: str) -> tuple[int, int]:
    """``(index, count)`` of this rank among the ranks of its node that see the same GPUs
    (same host and the same GPU UUIDs, :func:`visible_gpu_uuids`; ``CUDA_VISIBLE_DEVICES``
    where torch cannot tell UUIDs): the node-local rank and size, except under per-task GPU
    binding (srun ``--gpus-per-task``, or a cgroup per task that shows every task its GPU as
    "0"), where each rank sees its own GPU(s). One allgather unless the world is one rank, also
    on ``cpu`` (so that ranks whose ``device`` differs, as from a recipe one rank cannot read,
    still reach the settings' agreement in step)."""
    if comm.world_size == 1:
        return comm.local_rank, comm.local_size
    me = None
    if device != "cpu":
        gpus = visible_gpu_uuids()
        me = (socket.gethostname(), gpus if gpus is not None
              else os.environ.get("CUDA_VISIBLE_DEVICES"))
    everyone = comm.allgather_object(me)
    if me is None:
        return comm.local_rank, comm.local_size
    node = [v for v in everyone if v is not None and v[0] == me[0]]
    if len(node) != comm.local_size or len(set(node)) == 1:
        return comm.local_rank, comm.local_size
    same = [r for r, v in enumerate(everyone) if v == me]
    return same.index(comm.rank), len(same)
