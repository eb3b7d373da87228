"""Communicator backends behind one facade: ``get_communicator("auto"|"mpi"|"horovod"|"torch"|
"self")``."""
from __future__ import annotations

import importlib.util

from .base import (REDUCE_OPS, CompletedHandle, Communicator, Handle, SideChannel, launcher_kind,
                   launcher_world_size)
from .local import SelfCommunicator

BACKENDS = ("auto", "mpi", "horovod", "torch", "self")
_world: Communicator | None = None


def resolve_backend(backend: str = "auto") -> str:
    """The concrete backend ``backend`` names. ``auto`` follows the launcher: ``horovod`` under
    horovodrun, ``torch`` under torchrun, ``mpi`` under mpirun/srun (also when Horovod is
    installed: Horovod is chosen by name), ``self`` without a launcher.

    Raises ValueError for an unknown name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown communication backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    return launcher_kind() or "self"


def backend_available(backend: str) -> bool:
    """Whether ``backend``'s library can be imported here (no import side effects)."""
    mod = {"mpi": "mpi4py", "horovod": "horovod", "torch": "torch.distributed"}.get(backend)
    return mod is None or importlib.util.find_spec(mod) is not None


def get_communicator(backend: str = "auto") -> Communicator:
    """The process's communicator (created once).

    Raises ValueError for an unknown backend name; RuntimeError when the backend's library is not
    installed, on a launch that does not match the library in use, or when a communicator of
    another backend already exists in this process.
    """
    global _world
    backend = resolve_backend(backend)
    if _world is not None:
        if _world.backend != backend:
            raise RuntimeError(f"communicator already created with backend {_world.backend!r}")
        return _world
    if backend == "mpi":
        from .mpi import MPICommunicator
        _world = MPICommunicator()
    elif backend == "horovod":
        from .horovod import HorovodCommunicator
        try:
            _world = HorovodCommunicator()
        except ImportError as e:
            raise RuntimeError(str(e)) from e
    elif backend == "torch":
        from .torch_dist import TorchCommunicator
        _world = TorchCommunicator()
    else:
        _world = SelfCommunicator()
    return _world


__all__ = ["Communicator", "SelfCommunicator", "Handle", "CompletedHandle", "SideChannel",
           "get_communicator", "resolve_backend", "backend_available", "launcher_world_size",
           "launcher_kind", "BACKENDS", "REDUCE_OPS"]
