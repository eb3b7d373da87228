"""The Communicator facade: one object answers rank/size questions and runs the collectives.

Every backend (``mpi``, ``horovod``, ``torch``, ``self``) implements this interface, so training
code never imports a communication library. Tensors are reduced in place; every rank must enter
every collective in the same order with the same sizes.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "REDUCE_OPS", "Communicator", "CompletedHandle", "Handle", "SideChannel", "check_collective",
    "check_op", "on_stream"]

REDUCE_OPS = ("sum", "max", "min")


class Handle:
    """A collective that has been started and may still be running (from ``iallreduce_``).

    ``wait()`` blocks until it is complete and returns the reduced tensor; ``test()`` returns
    True once it is complete (for MPI it also drives the library's progress engine, so calling
    it now and then lets a non-blocking collective advance while the caller computes).
    """

    def wait(self) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def test(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class CompletedHandle(Handle):
    """The handle of a collective that ran to completion before it was returned."""

    def __init__(self, tensor: Tensor):
        self._tensor = tensor

    def wait(self) -> Tensor:
        return self._tensor

    def test(self) -> bool:
        return True


class SideChannel(ABC):
    """Small out-of-band messages between ranks, independent of the collectives in flight.

    The stall watchdog uses it to ask peers where they are while this rank waits in a collective
    that may never complete. Messages are picklable objects; delivery is asynchronous and
    unordered across senders. Only one thread (the watchdog's) calls it.
    """

    @abstractmethod
    def send(self, obj: Any, dest: int | None = None) -> None:
        """Post ``obj`` to rank ``dest`` (None: every other rank) without blocking."""

    @abstractmethod
    def poll(self) -> list[tuple[int, Any]]:
        """Messages that have arrived since the last call, as ``(source rank, obj)``; never
        blocks."""


class Communicator(ABC):
    """Rank/size facts and collectives for one process of a job.

    Attributes: ``backend`` (name), ``rank`` and ``world_size`` (in the job), ``local_rank`` and
    ``local_size`` (on this node), ``async_progress`` (True when the library advances
    non-blocking collectives on its own threads, as gloo, NCCL and Horovod do; False for MPI,
    whose non-blocking collectives advance only inside MPI calls such as ``Handle.test()``),
    ``thread_safe`` (True when collectives may be called from a thread other than the one that
    created the communicator), ``device`` (the ``torch.device`` this rank trains on, set by
    ``get_communicator``; cpu unless a GPU was selected: docs/gpus.md).

    CUDA tensors: ``allreduce_``/``iallreduce_``/``broadcast_`` of the ``mpi``, ``torch`` and
    ``horovod`` backends take a keyword ``stream``, the CUDA stream that produced the tensor and
    will read the result (the optimizer's); None means the calling thread's current stream,
    which is right only when the caller is the thread that produced the tensor. Pass it from a
    communication thread, and only for CUDA tensors.
    """

    backend: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: torch.device = torch.device("cpu")
    #: seconds a collective may wait before the job ends when neither an argument nor
    #: ``$HPCLB_STALL_ABORT_S`` says (None: never); :func:`hpclb.init` sets it
    stall_abort_s: float | None = None
    async_progress: bool = False
    thread_safe: bool = True

    @classmethod
    def create(cls, device: str | torch.device = "auto", share_gpu: bool = False) -> Communicator:
        """Start this backend for the process (the registry's way to build one): ``device`` is
        the device asked for (a name, or the one already bound from the launcher's local rank),
        ``share_gpu`` whether ranks may share a GPU. Backends that take neither ignore them."""
        return cls()

    @abstractmethod
    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """Reduce ``tensor`` (contiguous; any shape; fp16/bf16/fp32/fp64/int) across ranks, in
        place.

        ``op``: ``"sum"``, ``"max"`` or ``"min"``. Returns ``tensor``. Raises ValueError for an
        unknown op or a non-contiguous tensor.
        """

    def iallreduce_(self, tensor: Tensor, op: str = "sum", name: str | None = None, *,
                    stream: Any = None) -> Handle:
        """Start reducing ``tensor`` in place across ranks; returns a :class:`Handle`.

        ``tensor`` must not be read or written until ``handle.wait()`` returns. ``name``
        identifies the collective where the library matches by name (Horovod; stable names let
        it cache the negotiation) and is ignored elsewhere. ``stream``: see the class
        docstring (CUDA tensors only). The base implementation runs the blocking
        :meth:`allreduce_` and returns a completed handle.
        """
        if stream is None:
            self.allreduce_(tensor, op)
        else:
            self.allreduce_(tensor, op, stream=stream)  # type: ignore[call-arg]
        return CompletedHandle(tensor)

    def iallreduce(self, tensor: Tensor, op: str = "sum", name: str | None = None, *,
                   stream: Any = None) -> Handle:
        """Alias of :meth:`iallreduce_` (the reduction is in place either way)."""
        if stream is None:
            return self.iallreduce_(tensor, op, name)
        return self.iallreduce_(tensor, op, name, stream=stream)

    @abstractmethod
    def broadcast_(self, tensor: Tensor, root: int = 0) -> Tensor:
        """Overwrite ``tensor`` on every rank with ``root``'s, in place. Returns ``tensor``."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank."""

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s picklable ``obj`` on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has entered."""

    @abstractmethod
    def abort(self, code: int = 1) -> None:
        """End every rank of the job now with exit status ``code`` (does not return)."""

    def register_buckets(self, tensors: list[Tensor]) -> None:
        """The gradient buckets (device tensors reduced every step at fixed addresses) of the one
        GradientSync this communicator carries, replacing any earlier set (``[]`` on close).
        Backends that stage device memory through host buffers keep a pinned buffer for each
        of these and use transient ones for any other tensor; the others ignore it."""

    def side_channel(self) -> SideChannel | None:
        """The out-of-band channel for the stall watchdog, or None where there is none (one
        process, or an MPI without ``MPI_THREAD_MULTIPLE``). Created on first use by a call
        that every rank makes at the same point (GradientSync's constructor)."""
        return None


def check_op(op: str) -> None:
    """Raise ValueError unless ``op`` is one of :data:`REDUCE_OPS`."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; use sum, max or min")


def check_collective(tensor: Tensor, op: str = "sum") -> None:
    """:func:`check_op`, then ValueError unless ``tensor`` is contiguous: every backend checks
    the same (``self`` too), so code that runs on one runs on the others."""
    check_op(op)
    if not tensor.is_contiguous():
        raise ValueError("collectives need a contiguous tensor; call .contiguous() first")


def on_stream(stream):
    """``torch.cuda.stream(stream)``, or a no-op context for ``None``."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

