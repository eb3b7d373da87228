"""When and how the gradient buckets of :class:`~hpclb.sync.gradients.GradientSync` are reduced:
the accumulation window (at which backward or ``step()`` a window is reduced) and the drivers
(how a bucket travels).

**The window**: how backward passes and ``synchronize()`` calls (``DistributedOptimizer.step()``)
are counted, so that the two can never disagree silently (``docs/library.md``, "The
accumulation loops").

With ``accumulation_steps`` K > 1 the caller runs one of two loops (``step_after``):

- ``"micro_batch"``, hpclb's loop: ``step()`` after every ``backward()``. A window is K
  ``step()`` calls (a ``step()`` with no backward since the last one is an empty micro-batch:
  a rank without samples in it), the K-th reduces; the others return False. A second
  ``backward()`` before its ``step()`` is refused.
- ``"window"``, Horovod's loop: ``step()`` once after the window's backward passes. Every
  ``step()`` ends the window and re-aligns the count, as Horovod's does: after K passes
  (reduced when the K-th backward returns), or after fewer (a short window, reduced at that
  ``step()``: what is there). Weighting: with hpclb's mean (``divisor`` None) the gradient is
  the mean over the micro-batches given on all ranks: the ranks' sum divided by their number
  (``world_size * K`` for a full window); with a ``divisor`` (:mod:`hpclb.horovod`) the passes
  given are summed and divided by it, as Horovod does.
- ``"full_window"``, ``hpclb train``'s loop: Horovod's, but every rank counts all K
  micro-batches of every window (a backward, or :meth:`~WindowMixin.skip_micro_batch` for an
  empty share), so every window is full on every rank and is the mean over ``world_size * K``
  as it is: no count is exchanged (``"window"`` allreduces one per window). A ``step()`` after
  fewer is refused.
- None (default): the loop is recognised at the first ``synchronize()``, by every rank alike:
  until then backward passes accumulate locally and start no collective (as under
  ``no_sync()``); at that ``synchronize()`` the ranks agree in one allreduce (the most passes
  any rank ran since the start): two or more, ``"window"`` (the first window is reduced there,
  on every rank, weighted as a short one); one or none, ``"micro_batch"``. Ranks whose first
  window's shares are uneven (one pass on one, two on another) read the same loop.

Refused in both, on the backward that would do it, before anything of it is sent: a backward
after the window's K passes and before ``step()`` (Horovod's "Gradients were computed more than
backward_passes_per_step times before call to step()"; it would be added to the reduced mean).

**The drivers**, one per overlap mode. A driver has three moments: ``launch(bucket)`` (from the
backward hook that completed the bucket), ``progress(buckets)`` (from later hooks, to let a
non-blocking collective advance) and ``wait(bucket)`` (from ``synchronize()``, in bucket order).
Every rank launches the buckets in the same order and with the same kind of call, which keeps
MPI's rule that all ranks enter collectives in the same order (a blocking collective never
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

__all__ = ["DRIVERS", "STEP_AFTER", "BlockingDriver", "NonblockingDriver", "ThreadDriver",
           "Window", "WindowMixin", "checked_step_after"]

STEP_AFTER = ("micro_batch", "window", "full_window")


def checked_step_after(step_after: str | None) -> str | None:
    """``step_after`` as given: None, ``"micro_batch"`` or ``"window"``; ValueError naming
    the choices otherwise."""
    if step_after not in (None, *STEP_AFTER):
        raise ValueError(f"step_after={step_after!r}: use 'micro_batch' (step() after every "
                         f"backward, hpclb's loop), 'window' (one step() after the window's "
                         f"backward passes, Horovod's loop), 'full_window' (Horovod's loop with "
                         f"every window's K micro-batches counted on every rank, hpclb train's) "
                         f"or None (recognised at the first step())")
    return step_after


@dataclass
class Window:
    """Where the accumulation window stands, in one place: what the backward passes and the
    ``synchronize()`` / ``step()`` calls have counted since the window began."""

    #: micro-batches counted in the current window (0 at its start; K: it is reduced)
    micro: int = 0
    #: backward passes ended since the last ``synchronize()``
    passes: int = 0
    #: a window ended (was reduced) and ``synchronize()`` has not reported it yet
    reduced: bool = False
    #: micro-batches in the window last reduced (a short window's weighting)
    given: int = 0
    #: a backward ended under ``no_sync()`` since the last window (its gradients are local)
    local: bool = False
    #: ``DistributedOptimizer.synchronize()``'s result, not yet taken by ``step()`` (None: none)
    reported: bool | None = None


class WindowMixin:
    """The counting half of :class:`~hpclb.sync.gradients.GradientSync` (which provides
    ``accumulation_steps``, ``step_after``, ``divisor_is_mean``, ``comm``, ``buckets``, its
    :class:`Window` as ``window``, ``_finish_alone`` and ``_end_window``)."""

    def _check_pass(self) -> None:
        """A backward pass begins (its first gradient hook, or :meth:`mark_all_ready`): raise
        RuntimeError when it would put the passes and the ``synchronize()`` calls out of step.
        Nothing of this pass has been sent yet."""
        k = self.accumulation_steps
        if k == 1:
            return
        if self.step_after == "micro_batch" and self.window.passes and not self._no_sync:
            raise RuntimeError(
                f"a second backward() without step() in hpclb's accumulation loop (step() after "
                f"every backward(), accumulation_steps={k}; recognised at the first step()): "
                f"the window counts one micro-batch per step(). Sum the losses into one "
                f"backward(), or run the extra passes under optimizer.no_sync(); for Horovod's "
                f"loop (the window's backward passes, then one step()) build the optimizer with "
                f"step_after='window' (hpclb.horovod's DistributedOptimizer does)")
        w = self.window
        if w.reduced or (self._recognising and w.micro >= k and not self._no_sync):
            raise RuntimeError(
                f"backward() after the window's accumulation_steps={k} backward passes and "
                f"before step(): more than {k} backward passes per step() would add this one to "
                f"the reduced mean (Horovod: 'Gradients were computed more than "
                f"backward_passes_per_step times before call to step()'). Call step() (or "
                f"synchronize()) after each window, or raise accumulation_steps / "
                f"backward_passes_per_step")

    @torch.no_grad()
    def _end_backward(self) -> None:
        """The end of a backward pass (autograd callback): count the micro-batch; on a window's
        K-th, reduce every bucket and divide, so ``p.grad`` is the global mean on return."""
        self._task = -1
        if self._no_sync:
            self.window.local = True
            return
        self.window.passes += 1
        self.window.micro += 1
        if self.window.micro == self.accumulation_steps:
            if self._recognising:  # K passes with no step(): the loop is known; agree it
                self._recognise_loop()  # first, then reduce (DDP's contract: p.grad is the
            else:                       # global mean when the window's last backward returns)
                self._end_window()

    def skip_micro_batch(self) -> None:
        """This rank has no samples in the current micro-batch (an uneven last step): count it
        in the window as an empty one, so every rank counts the same micro-batches; on the
        window's last, reduce every bucket now, as the end of a backward does."""
        if self._hooks:  # else (one process, K = 1) synchronize() ends every window
            self._check_pass()
            self._end_backward()

    def synchronize(self) -> bool:
        """Call once per optimizer step, after backward. True when a window ended (and was
        reduced: every ``p.grad`` is the mean over ranks and micro-batches) since the last
        call: after its K-th micro-batch, or, in Horovod's loop (``step_after="window"``),
        at every call (a short window: what is there, weighted as the module docstring says).
        False inside a window of hpclb's loop. A call there with no backward since the last
        one (a rank with no samples in this micro-batch, or a backward that reached no
        parameter) ends a micro-batch here, as :meth:`mark_all_ready` does, so every rank
        counts the same windows.

        Raises RuntimeError after :meth:`close` (at every world size: at 2 ranks it would wait
        for hooks that are gone), and after a backward under :meth:`no_sync` that no backward
        outside it followed (the gradients are this rank's own).
        """
        if not self._open:
            raise RuntimeError(f"{self!r} was closed: its hooks are removed and nothing is "
                               f"averaged; build a new DistributedOptimizer / GradientSync "
                               f"(or refresh_parameters()) instead of stepping a closed one")
        if not self._hooks:  # one process, no accumulation: every backward is a window
            self.window.passes = 0
            self.steps += 1
            self._finish_alone()
            return True
        if self._recognising:
            self._recognise_loop()
        if self.window.local and not self.window.reduced:
            raise RuntimeError("step() after a backward under no_sync() with no backward outside "
                               "it: the gradients are this rank's local sums. Run the window's "
                               "last backward outside no_sync(), then step()")
        if not self.window.reduced:
            if self.step_after == "window":
                self._end_window()  # a short window: what is there
            elif self.step_after == "full_window":
                raise RuntimeError(
                    f"step() after {self.window.micro} of the window's accumulation_steps="
                    f"{self.accumulation_steps} micro-batches with step_after='full_window' "
                    f"(every rank counts K per window): count an empty share with "
                    f"skip_micro_batch(), or build the optimizer with step_after='window' "
                    f"for short windows")
            elif not self.window.passes:
                self._end_backward()  # an empty micro-batch
        if self.window.reduced and self.step_after == "window" and self.divisor_is_mean:
            self._weigh_window()
        w = self.window
        reduced, w.reduced, w.passes, w.given = w.reduced, False, 0, self.accumulation_steps
        return reduced

    def _recognise_loop(self) -> None:
        """With ``step_after`` None, at the first window's K-th backward or the first
        ``synchronize()``, whichever comes first on this rank: every rank takes the same loop
        from the most backward passes any rank ran (one allreduce, before any bucket of the
        run's gradients is sent, on every rank: the ranks meet in it whichever of the two calls
        each is in). A full first window is reduced here (at its K-th backward, so ``p.grad``
        is the global mean when it returns); a short one by ``synchronize()``, as every short
        window."""
        passes = torch.tensor([float(self.window.passes)], dtype=torch.float64)
        if self.comm.world_size > 1:
            self.comm.allreduce_(passes, op="max")
        self.step_after = "window" if passes.item() > 1 else "micro_batch"
        self._recognising = False
        if self.window.micro == self.accumulation_steps:
            self._end_window()

    @torch.no_grad()
    def _weigh_window(self) -> None:
        """Horovod's loop with hpclb's mean: the buckets were divided by ``world_size * K``;
        make them the mean over the micro-batches given on all ranks (one allreduce of a
        count; a window with none on any rank stays as it is: zeros after ``zero_grad()``)."""
        given = torch.tensor([float(self.window.given)], dtype=torch.float64)
        if self.comm.world_size > 1:
            self.comm.allreduce_(given, op="sum")
        n, full = int(given.item()), self.comm.world_size * self.accumulation_steps
        if 0 < n < full:
            for b in self.buckets:
                b.buffer.mul_(full / n)

    @property
    def backward_pending(self) -> bool:
        """A backward ended since the last :meth:`synchronize` (``zero_grad()`` then would drop
        its gradients from the window)."""
        return self.window.passes > 0

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated so far in the current window (0 at a window's start)."""
        return self.window.micro

    def reset_epoch(self) -> int:
        """Start a new accumulation window at an epoch boundary; returns how many micro-batches
        of an unfinished window are dropped (their gradients stay local: zero them)."""
        w = self.window
        dropped, w.micro, w.passes = w.micro, 0, 0
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
