"""Communicator backends behind one facade: ``get_communicator("auto"|"mpi"|"self")``."""
from __future__ import annotations

from .base import Communicator, launcher_world_size
from .local import SelfCommunicator

BACKENDS = ("auto", "mpi", "self")
_world: Communicator | None = None


def get_communicator(backend: str = "auto") -> Communicator:
    """The process's communicator (created once).

    ``auto`` picks ``mpi`` when an MPI launcher started this process, else ``self``.
    Raises ValueError for an unknown backend name, RuntimeError from the backend on a launch that
    does not match the MPI in use.
    """
    global _world
    if backend not in BACKENDS:
        raise ValueError(f"unknown communication backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = "mpi" if launcher_world_size() is not None else "self"
    if _world is not None:
        if _world.backend != backend:
            raise RuntimeError(f"communicator already created with backend {_world.backend!r}")
        return _world
    if backend == "mpi":
        from .mpi import MPICommunicator
        _world = MPICommunicator()
    else:
        _world = SelfCommunicator()
    return _world


__all__ = ["Communicator", "SelfCommunicator", "get_communicator", "launcher_world_size", "BACKENDS"]
