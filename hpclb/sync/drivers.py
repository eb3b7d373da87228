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
    starts the non-blocking allreduce and drives it with ``test()`` every ``poll_s`` seconds,
    sleeping in between, while backward runs (Open MPI spins inside a blocking call and would take
    the core from backward), and blocks in ``wait()`` once ``synchronize()`` waits. The default for
    MPI, which advances a non-blocking collective only inside MPI calls.
"""
from __future__ import annotations

import queue
import threading
import weakref

from hpclb.dist.base import Communicator

__all__ = ["DRIVERS", "BlockingDriver", "NonblockingDriver", "ThreadDriver"]


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
    the object whose garbage collection stops the thread (the GradientSync)."""

    def __init__(self, comm: Communicator, poll_s: float, owner=None):
        super().__init__(comm)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._main_waiting = threading.Event()
        self._thread = threading.Thread(target=_comm_loop, name="hpclb-comm", daemon=True,
                                        args=(self._queue, comm, self._main_waiting, poll_s))
        self._thread.start()
        if owner is not None:
            weakref.finalize(owner, self._queue.put, None)

    def launch(self, b) -> None:
        b.done.clear()
        b.stream = _stream_of(b)  # captured on the training thread, whose stream made the grads
        self._queue.put(b)

    def wait(self, b) -> None:
        self._main_waiting.set()
        b.done.wait()

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
               poll_s: float) -> None:
    """The communication thread: the only thread that runs gradient collectives while it lives.
    An error is stored on the bucket and raised by ``synchronize()`` on the main thread."""
    h = None
    while True:
        b = q.get()
        if b is None:
            return
        try:
            if comm.async_progress or poll_s <= 0:
                comm.allreduce_(b.comm_buffer, **b.stream)
            else:
                h = comm.iallreduce_(b.comm_buffer, **b.stream)
                while not main_waiting.is_set() and not h.test():
                    main_waiting.wait(poll_s)
                h.wait()
        except BaseException as e:  # reported by synchronize() on the main thread
            b.error = e
        finally:
            b.done.set()
            b = h = None  # hold no bucket while idle: it keeps its GradientSync alive
