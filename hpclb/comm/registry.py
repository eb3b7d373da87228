"""The communicator backends by name: the one place that lists them (torch-free, so the command
line can offer them as choices without loading torch).

Each backend names its class as ``"module:Class"``, imported only when that backend is created;
the class is built with :meth:`hpclb.comm.base.Communicator.create`.
"""
from __future__ import annotations

import importlib
import importlib.util

from hpclb.comm.env import launcher_kind

__all__ = ["BACKENDS", "BACKEND_CLASSES", "resolve_backend", "backend_available",
           "backend_class"]

# name -> (the communicator class, the library it needs: None for none)
BACKEND_CLASSES: dict[str, tuple[str, str | None]] = {
    "mpi": ("hpclb.comm.mpi:MPICommunicator", "mpi4py"),
    "horovod": ("hpclb.comm.horovod:HorovodCommunicator", "horovod"),
    "torch": ("hpclb.comm.torch_dist:TorchCommunicator", "torch.distributed"),
    "self": ("hpclb.comm.local:SelfCommunicator", None),
}
#: every name ``--backend`` takes: ``auto`` and the backends
BACKENDS = ("auto", *BACKEND_CLASSES)


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
    library = BACKEND_CLASSES[backend][1] if backend in BACKEND_CLASSES else None
    return library is None or importlib.util.find_spec(library) is not None


def backend_class(backend: str) -> type:
    """The communicator class of concrete backend ``backend`` (imported now). Raises KeyError
    for a name that is not a backend (resolve ``auto`` first)."""
    module, _, attr = BACKEND_CLASSES[backend][0].partition(":")
    return getattr(importlib.import_module(module), attr)
