"""When and how the gradient buckets of :class:`~hpclb.sync.gradients.GradientSync` are reduced:
the accumulation window (:class:`Window`, which counts GradientSync's one accumulation contract:
module docstring there) and the drivers (how a bucket travels).

**The drivers**, one per overlap mode. A driver has three moments: ``launch(bucket)`` (from the
backward hook that completed the bucket), ``progress(buckets)`` (from later hooks, to let a
non-blocking collective advance) and ``wait(bucket)`` (at the end of the window, in bucket
order). Every rank launches the buckets in the same order and with the same kind of call, which
keeps MPI's rule that all ranks enter collectives in the same order (a blocking collective never
matches a non-blocking one).

``BlockingDriver`` (``overlap="none"``)
    everything in ``synchronize()``, one blocking allreduce per bucket (the reference).
``NonblockingDriver`` (``"nonblocking"``)
    the hook starts ``comm.iallreduce_``; later hooks call ``Handle.test()`` where the library
    does not progress on its own threads. The default for Gloo, NCCL and Horovod, and for
    MPI when the gradients make one bucket (nothing to overlap, no thread hand-off).
``ThreadDriver`` (``"thread"``)
    a communication thread owns the collectives; the hook only enqueues the bucket. The thread
    starts the non-blocking allreduce and drives it with ``test()`` every ``poll_s`` seconds,
    sleeping in between, while backward runs (Open MPI spins inside a blocking call and would take
    the core from backward), and blocks in ``wait()`` once ``synchronize()`` waits. The default for
    MPI with more than one bucket: MPI advances a non-blocking collective only inside its calls.

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
from dataclasses import dataclass
from typing import Any

import torch

from hpclb.comm.base import Communicator
from hpclb.comm.streams import TorchCudaAPI

__all__ = ["DRIVERS", "BlockingDriver", "NonblockingDriver", "ThreadDriver", "Window"]


@dataclass
class Window:
    """Where the accumulation window of ``k`` micro-batches stands: what the backward passes and
    the ``synchronize()`` / ``step()`` calls have counted since it began."""

    #: micro-batches per window (``accumulation_steps``)
    k: int
    #: micro-batches counted in the current window (0 at its start; k: it is reduced)
    micro: int = 0
    #: micro-batches ended since the last ``synchronize()``
    passes: int = 0
    #: a window ended (was reduced) and ``synchronize()`` has not reported it yet
    reduced: bool = False
    #: micro-batches in the window last reduced (fewer than k: a short one)
    given: int = 0
    #: a backward ended under ``no_sync()`` since the last window (its gradients are local)
    local: bool = False
    #: ``DistributedOptimizer.synchronize()``'s result, not yet taken by ``step()`` (None: none)
    reported: bool | None = None

    def check_pass(self) -> None:
        """A backward pass begins: RuntimeError when the window was reduced and not yet taken by
        ``synchronize()`` (nothing of this pass has been sent yet)."""
        if self.k > 1 and self.reduced:
            raise RuntimeError(
                f"backward() after the window's accumulation_steps={self.k} backward passes and "
                f"before step(): more than {self.k} backward passes per step() would add this "
                f"one to the reduced mean (Horovod: 'Gradients were computed more than "
                f"backward_passes_per_step times before call to step()'). Call step() (or "
                f"synchronize()) after each window, or raise accumulation_steps / "
                f"backward_passes_per_step")

    def count(self, local: bool) -> bool:
        """A micro-batch ended (``local``: a backward under ``no_sync()``, not counted): True
        when it is the window's k-th, which then ends (the caller reduces it)."""
        if local:
            self.local = True
            return False
        self.passes += 1
        self.micro += 1
        if self.micro < self.k:
            return False
        self.given, self.micro, self.reduced, self.local = self.micro, 0, True, False  # end()
        return True

    def end(self) -> None:
        """The window ends now (is reduced), with the micro-batches counted (k, or fewer)."""
        self.given, self.micro, self.reduced, self.local = self.micro, 0, True, False

    def report(self) -> bool:
        """``synchronize()``: True when a window ended since the last call; the count of passes
        restarts. RuntimeError after a backward under ``no_sync()`` with none outside it."""
        if self.local and not self.reduced:
            raise RuntimeError("step() after a backward under no_sync() with no backward outside "
                               "it: the gradients are this rank's local sums. Run the window's "
                               "last backward outside no_sync(), then step()")
        reduced, self.reduced, self.passes, self.given = self.reduced, False, 0, self.k
        return reduced

    def reset(self) -> int:
        """Start a new window (an epoch boundary); returns the micro-batches dropped."""
        dropped, self.micro, self.passes = self.micro, 0, 0
        return dropped


# -- the drivers: how a bucket travels --------------------------------------------------------
class BlockingDriver:
    """``overlap="none"``: nothing happens before ``synchronize()``."""

    #: the backward hooks call progress() (a non-blocking collective the library does not
    #: advance on its own threads); False spares every hook the call
    needs_progress = False

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

    def __init__(self, comm: Communicator, poll_s: float = 0.0):
        super().__init__(comm, poll_s)
        self.needs_progress = not comm.async_progress

    def launch(self, b) -> None:
        b.handle = self.comm.iallreduce_(b.comm_buffer, "sum", name=f"hpclb.grad.{b.index}",
                                         **(_stream_of(b) if b.comm_buffer.is_cuda else {}))

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
    (module docstring) through ``api`` (default :class:`~hpclb.comm.streams.TorchCudaAPI`;
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
    An error is stored on the bucket and raised by ``synchronize()`` on the main thread."""
    if api is not None:
        api.bind_thread()
    h = None
    while True:
        b = q.get()
        if b is None:
            return
        try:
            if b.ready_event is not None:
                side.wait_event(b.ready_event)
            if comm.async_progress or poll_s <= 0:
                comm.allreduce_(b.comm_buffer, **b.stream)
            else:
                h = comm.iallreduce_(b.comm_buffer, **b.stream)
                while not main_waiting.is_set() and not h.test():
                    main_waiting.wait(poll_s)
                h.wait()
            if b.ready_event is not None:
                b.reduced_event = api.new_event()
                b.reduced_event.record(side)
        except BaseException as e:  # reported by synchronize() on the main thread
            b.error = e
        finally:
            b.done.set()
            b = h = None  # hold no bucket while idle: it keeps its GradientSync alive
