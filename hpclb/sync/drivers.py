"""How a gradient bucket travels: one driver per overlap mode of
:class:`hpclb.sync.gradients.GradientSync`.

A driver has three moments: ``launch(bucket)`` (from the backward hook that completed the
bucket), ``progress(buckets)`` (from later hooks, to let a non-blocking collective advance) and
``wait(bucket)`` (from ``synchronize()``, in bucket order). Every rank launches the buckets in the
same order and with the same kind of call, which keeps MPI's rule that all ranks enter
collectives in the same order (a blocking collective never matches a non-blocking one).

``BlockingDriver`` (``overlap="none"``)
    everything in ``synchronize()``, one blocking allreduce per bucket (the reference).
``NonblockingDriver`` (``"nonblocking"``)
    the hook starts ``comm.iallreduce_``; later hooks call ``Handle.test()`` where the library
    does not progress on its own threads. The default for Gloo, NCCL and Horovod.
``ThreadDriver`` (``"thread"``)
    a communication thread owns the collectives; the hook only enqueues the bucket. The thread
    starts each queued bucket's non-blocking allreduce at once (several in flight, in bucket
    order, pipelined) and drives the oldest with ``test()`` every ``poll_s`` seconds, sleeping in
    between, while backward runs (Open MPI spins inside a blocking call and would take the core
    from backward), and blocks in ``wait()`` once ``synchronize()`` waits. A CPU bucket is
    unpacked (divided by ``world_size`` times the accumulation count) by the thread as soon as its
    allreduce completes, while the bucket is still in cache and the later buckets travel. The
    default for MPI, which advances a non-blocking collective only inside MPI calls.

    CUDA buckets: the thread first makes the gradients' device current (else its first CUDA call
    opens a context on GPU 0, from every rank of a multi-GPU node). The hook records a CUDA event
    on the training stream *when the bucket is complete*; the thread hands the backend a side
    stream that waits on that event only, so the backend's copy or collective does not also wait
    for the backward kernels enqueued between the hook and the moment the thread dequeues the
    bucket. After the collective the thread records an event on the side stream, and ``wait()``
    orders the training thread's current stream (the optimizer's) after it.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import torch

from hpclb.dist.base import Communicator
from hpclb.dist.streams import TorchCudaAPI

__all__ = ["DRIVERS", "SEGMENT_BYTES", "BlockingDriver", "NonblockingDriver", "ThreadDriver"]

SEGMENT_BYTES = 4 * 2 ** 20  # a CPU bucket's non-blocking allreduce travels in pieces this big


class BlockingDriver:
    """``overlap="none"``: nothing happens before ``synchronize()``."""

    def __init__(self, comm: Communicator, poll_s: float = 0.0):
        self.comm = comm

    def launch(self, b) -> None:
        pass

    def progress(self, launched) -> None:
        pass

    def wait(self, b) -> None:
        self.comm.allreduce_(b.comm_buffer)

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass


class NonblockingDriver(BlockingDriver):
    """``overlap="nonblocking"``: ``iallreduce_`` from the hook, ``Handle.wait()`` at the end."""

    def launch(self, b) -> None:
        b.handle = self.comm.iallreduce_(b.comm_buffer, "sum", name=f"hpclb.grad.{b.index}",
                                         **_stream_of(b))

    def progress(self, launched) -> None:
        if self.comm.async_progress:
            return
        for b in launched:
            if b.handle is not None:
                b.handle.test()

    def wait(self, b) -> None:
        b.handle.wait()
        b.handle = None


class ThreadDriver(BlockingDriver):
    """``overlap="thread"``: a daemon thread runs the collectives in bucket order. ``owner`` is
    the object whose garbage collection stops the thread (the GradientSync). ``device``: the
    gradients' device; for a CUDA device the thread binds it and buckets are ordered by events
    (module docstring) through ``api`` (default :class:`~hpclb.dist.streams.TorchCudaAPI`;
    tests pass a stand-in)."""

    def __init__(self, comm: Communicator, poll_s: float, owner=None, *,
                 device: torch.device | None = None, api: Any = None):
        super().__init__(comm)
        if api is None and device is not None and torch.device(device).type == "cuda":
            api = TorchCudaAPI(torch.device(device))
        self.api = api
        self._side = api.new_stream() if api is not None else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._main_waiting = threading.Event()
        self._thread = threading.Thread(
            target=_comm_loop, name="hpclb-comm", daemon=True,
            args=(self._queue, comm, self._main_waiting, poll_s, api, self._side))
        self._thread.start()
        if owner is not None:
            weakref.finalize(owner, self._queue.put, None)

    def _on_device(self, b) -> bool:
        return self.api is not None and b.comm_buffer.device == self.api.device

    def launch(self, b) -> None:
        b.done.clear()
        b.reduced_event = None
        if self._on_device(b):  # recorded now, in the hook: after this bucket's last gradient
            b.ready_event = self.api.new_event()
            b.ready_event.record(self.api.current_stream())
            b.stream = {"stream": self._side}
        else:
            b.ready_event, b.stream = None, _stream_of(b)
        b.unpack_in_thread = b.ready_event is None and b.comm_buffer.device.type == "cpu"
        self._queue.put(b)

    def wait(self, b) -> None:
        self._main_waiting.set()
        b.done.wait()
        if b.reduced_event is not None:  # the optimizer's stream reads the result after it
            self.api.current_stream().wait_event(b.reduced_event)
            b.reduced_event = None

    def end_step(self) -> None:
        self._main_waiting.clear()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None


def _stream_of(b) -> dict:
    """``{"stream": s}`` with the calling thread's current CUDA stream for a CUDA bucket (the
    stream that produced its gradients and reads the result), else ``{}``."""
    if b.comm_buffer.is_cuda:
        import torch

        return {"stream": torch.cuda.current_stream(b.comm_buffer.device)}
    return {}


DRIVERS = {"none": BlockingDriver, "nonblocking": NonblockingDriver, "thread": ThreadDriver}


def _comm_loop(q: queue.SimpleQueue, comm: Communicator, main_waiting: threading.Event,
               poll_s: float, api: Any = None, side: Any = None) -> None:
    """The communication thread: the only thread that runs gradient collectives while it lives.
    Every queued bucket's non-blocking allreduces start as soon as it is dequeued (a CPU bucket
    in pieces of at most :data:`SEGMENT_BYTES`; several in flight at once, in order); the oldest
    piece is tested every ``poll_s`` seconds (any MPI call progresses all) and waited for once the
    main thread waits, and a CPU bucket's piece is unpacked as soon as it completes. An error is
    stored on the bucket and raised by ``synchronize()`` on the main thread."""
    if api is not None:
        api.bind_thread()
    flight: list = []  # [bucket, [(lo, hi, handle), ...]] started, not yet finished, in order
    blocking = comm.async_progress or poll_s <= 0
    while True:
        try:
            b = q.get() if not flight else q.get_nowait()
        except queue.Empty:
            _advance(flight, main_waiting, poll_s, api, side)
            continue
        if b is None:
            while flight:  # closing: let the collectives already started end
                _advance(flight, main_waiting, 0.0, api, side, block=True)
            return
        pieces = _start(b, comm, side, blocking)
        if pieces:
            flight.append((b, pieces))
        else:
            _finish(b, api, side, unpack=blocking)
        b = pieces = None  # hold no bucket while idle: it keeps its GradientSync alive


def _segments(b) -> list[tuple[int, int]]:
    """Element ranges ``b`` travels in: pieces of at most :data:`SEGMENT_BYTES` for a bucket
    the thread unpacks (CPU), else the whole bucket. Every rank cuts the same bucket alike."""
    n = b.comm_buffer.numel()
    step = max(1, SEGMENT_BYTES // b.comm_buffer.element_size()) if b.unpack_in_thread else n
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, n)]


def _start(b, comm: Communicator, side: Any, blocking: bool) -> list:
    """Start ``b``'s allreduce (run it to the end when ``blocking``): ``[(lo, hi, handle)]``
    per piece in flight, or [] when done or failed (the error on ``b``)."""
    try:
        if b.ready_event is not None:
            side.wait_event(b.ready_event)
        if blocking:
            comm.allreduce_(b.comm_buffer, **b.stream)
            return []
        return [(lo, hi, comm.iallreduce_(b.comm_buffer[lo:hi], **b.stream))
                for lo, hi in _segments(b)]
    except BaseException as e:  # reported by synchronize() on the main thread
        b.error = e
        return []


def _advance(flight: list, main_waiting: threading.Event, poll_s: float, api: Any, side: Any,
             block: bool = False) -> None:
    """Progress the oldest piece in flight: wait for it when the main thread waits (or
    ``block``), else test it and sleep ``poll_s`` seconds unless it completed; a completed
    piece of a CPU bucket is unpacked, and a bucket whose last piece completed is finished."""
    b, pieces = flight[0]
    lo, hi, h = pieces[0]
    try:
        if not (block or main_waiting.is_set()) and not h.test():
            main_waiting.wait(poll_s)
            return
        h.wait()
        if b.error is None and b.unpack_in_thread:  # divide while the piece is in cache
            b.unpack(lo, hi)
    except BaseException as e:  # reported by synchronize() on the main thread
        b.error = e
    pieces.pop(0)
    if not pieces:
        flight.pop(0)
        _finish(b, api, side, unpack=False)


def _finish(b, api: Any, side: Any, unpack: bool) -> None:
    """After ``b``'s collective: unpack a CPU bucket (``unpack``: not yet done piece by piece),
    record the side stream's event for a CUDA one, and tell the main thread."""
    try:
        if b.error is None and unpack and b.unpack_in_thread:
            b.unpack()
        if b.error is None and b.ready_event is not None:
            b.reduced_event = api.new_event()
            b.reduced_event.record(side)
    except BaseException as e:  # reported by synchronize() on the main thread
        b.error = e
    finally:
        b.done.set()
