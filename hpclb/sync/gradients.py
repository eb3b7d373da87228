"""Gradient synchronisation across ranks.

:class:`GradientSync` packs gradients into buckets of at most ``fusion_threshold_bytes`` bytes
(the first, reduced first, small), makes every ``p.grad`` a view into its bucket so nothing is
copied (each view starts at a 16-byte aligned offset, so vectorised kernels such as the fused
trust-ratio kernel take their fast path), and starts a bucket's allreduce from the
post-accumulate-grad hook of its last gradient, so communication overlaps the rest of backward.
DDP's contract: at the end of the backward that ends an accumulation window (an autograd
callback the first hook of each backward queues, as DDP's reducer does) every bucket is waited
for and divided by ``world_size`` (times the accumulation count) exactly once, so when
``loss.backward()`` returns every ``p.grad`` holds the global mean; ``synchronize()`` then only
reports it. Every rank starts the buckets in the same order (bucket ``i`` only after
bucket ``i-1``), which keeps the MPI rule that all ranks enter collectives in the same order; for
the same reason one communicator carries one GradientSync at a time.

**The accumulation contract** (``accumulation_steps`` K; ``hpclb train``'s loop), one for every
caller: every rank counts K micro-batches per window, a backward each, or
:meth:`~GradientSync.skip_micro_batch` for a rank's empty share; the K-th is reduced when it ends
(``p.grad`` is the global mean when its backward returns), and :meth:`~GradientSync.synchronize`
after the window reports it (True; a call inside a window returns False and changes nothing).
A backward after the window's K and before ``synchronize()`` is refused before anything of it is
sent (Horovod's "Gradients were computed more than backward_passes_per_step times before call to
step()"; it would be added to the reduced mean). With K == 1 every backward is a window, and a
``synchronize()`` with no backward since the last is an empty one. The loops built on it:
``hpclb.DistributedOptimizer``'s ``step()`` after every backward (:mod:`hpclb.sync.optimizer`),
Horovod's short windows (:meth:`~GradientSync.end_window`, :mod:`hpclb.horovod`) and DDP's
:meth:`~GradientSync.no_sync`.

Bucket planning and layout: :mod:`hpclb.sync.buckets`; the start-up checks that make ranks agree
(model, parameters, buffers, step counts): :mod:`hpclb.sync.agree`.
Settings: :mod:`hpclb.sync.options` (arguments and ``HPCLB_*`` variables, one place).
How buckets travel (``overlap=thread|nonblocking|none``): :mod:`hpclb.sync.reduction`; the
measurements behind the defaults are in ``docs/gradient-sync.md``.
"""
from __future__ import annotations

import gc
import operator
import time
import weakref
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
from torch import Tensor, nn

from hpclb.comm.base import Communicator
from hpclb.comm.watchdog import StallReport, watchdog_for
from hpclb.sync import options
from hpclb.sync.agree import check_sync_agreement
from hpclb.sync.buckets import Bucket, make_bucket, plan_buckets
from hpclb.sync.reduction import DRIVERS, Window

__all__ = ["GradientSync"]

# id(parameter) -> the GradientSync that owns it. Kept here, not on the parameter, so that
# torch.save(model) and copy.deepcopy(model) work; an entry lives as long as its GradientSync,
# which holds its parameters (so their ids cannot be reused meanwhile).
_OWNERS: "weakref.WeakValueDictionary[int, GradientSync]" = weakref.WeakValueDictionary()
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_graph_task_id = torch._C._current_graph_task_id
_grad_of = operator.attrgetter("grad")
_requires_grad = operator.attrgetter("requires_grad")
_profiling = torch.autograd._profiler_enabled  # the wait is labelled for --profile's trace
_record = torch.profiler.record_function


class GradientSync:
    """Average gradients across ranks in fused buckets, overlapped with backward.

    Args:
        params: the model's parameters in the same order on every rank: an ``nn.Module``, an
            iterable of parameters, or of ``(name, parameter)`` pairs (names make the start-up
            check's messages readable). Parameters with ``requires_grad=False`` are skipped.
        comm: the communicator. One communicator carries one live GradientSync (world size > 1):
            two would start collectives in an order that depends on which backward runs
            (a GAN's generator backward also fires the discriminator's hooks), so a second one
            raises ValueError until the first is ``close()``-d; synchronise all the models'
            parameters with one GradientSync (one DistributedOptimizer) instead.
        fusion_threshold_bytes: most bytes per bucket (default $HPCLB_FUSION_THRESHOLD_BYTES or
            25 MiB; "64MiB", "64MB" accepted there). A tensor larger than this gets a bucket of
            its own. Under 1 KiB warns (a unit mistake makes one bucket per tensor).
        first_bucket_bytes: most bytes in the first bucket (the last layers' gradients, ready
            first; small so communication starts early). Default 1 MiB.
        overlap: ``"thread"``, ``"nonblocking"``, ``"none"`` or ``"auto"`` (default
            $HPCLB_OVERLAP or auto: ``thread`` for MPI, ``nonblocking`` for backends that
            progress on their own threads and for gradients that fit one bucket, where nothing
            can overlap); see :mod:`hpclb.sync.reduction`.
        accumulation_steps: k micro-batches (backward passes, or :meth:`skip_micro_batch`) per
            window: the first k-1 accumulate locally (no communication), the k-th reduces at its
            end. The result is the mean over ranks and micro-batches (one division by
            ``world_size * k``). ``synchronize()`` returns True once per window (the
            accumulation contract: module docstring).
        compression: None, ``"fp16"`` or ``"bf16"`` (default $HPCLB_COMPRESSION): buckets travel
            in that dtype, each rank's share divided by ``world_size * k`` *before* the cast
            (the sum of ranks' shares cannot overflow where each gradient does not).
        stall_timeout_s: report a wait longer than this many seconds, naming the ranks that have
            not joined (default $HPCLB_STALL_TIMEOUT_S or 60).
        stall_abort_s: end the job after a wait this long (default $HPCLB_STALL_ABORT_S or never).
        on_stall: called with a :class:`~hpclb.comm.watchdog.StallReport` (default: print it).
        track_local_norm: also keep, per step, the squared L2 norm of this rank's own gradient
            (the mean over its samples, before the allreduce) for the gradient noise scale
            (:attr:`local_sq_norm`); one norm per bucket on the device, no host sync.
        track_used: record which parameters got a gradient in each window
            (:attr:`used_in_window`, for ``find_unused_parameters``).
        divisor: what the reduced sum is divided by (default ``world_size * k``: the mean over
            ranks and micro-batches). :mod:`hpclb.horovod` passes ``world_size`` (Horovod's
            Average: micro-batches summed) or 1 (Horovod's Sum).
        loss_prescaled: the caller multiplies every micro-batch's loss by
            :attr:`loss_prescale` (``1 / (world_size * k)``) before ``backward()``, so the
            reduced sum already is the mean and no bucket is divided: the mean at the price of
            a sum (one scalar multiply of the loss instead of a pass over every gradient byte).
            Bit-identical to the division when ``world_size * k`` is a power of two (both scale
            by an exact power of two; gradients below fp32's normal range aside); the training
            loop turns it on only then. Not with ``divisor``.

    Every ``p.grad`` becomes a view into a bucket buffer; keep zeroing gradients in place
    (``zero_grad(set_to_none=False)``) to avoid a copy in the hook. A parameter whose hook did
    not run in a window is reduced as zeros. Backward passes inside :meth:`no_sync` accumulate
    locally and do not count toward the window. An error of the allreduce is raised from the
    ``backward()`` that waited for it.

    Raises ValueError for a bad setting, :class:`ModelMismatchError` (on every rank) when ranks
    disagree on the buckets (names, shapes, dtypes) or on settings that change what travels.
    """

    _live: "weakref.WeakValueDictionary[int, GradientSync]" = weakref.WeakValueDictionary()
    _open = False  # True from the end of __init__ until close()

    def __init__(self, params, comm: Communicator, *, fusion_threshold_bytes=None,
                 first_bucket_bytes=None, overlap: str | None = None,
                 accumulation_steps: int = 1, compression: str | None = None,
                 stall_timeout_s: float | None = None, stall_abort_s: float | None = None,
                 on_stall: Callable[[StallReport], None] | None = None,
                 track_local_norm: bool = False, track_used: bool = False,
                 divisor: int | None = None, loss_prescaled: bool = False):
        self.comm = comm
        named = self._named(params)
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self._set_options(accumulation_steps, divisor, bool(loss_prescaled),
                          options.SyncOptions.resolve(
            fusion_threshold_bytes=fusion_threshold_bytes, first_bucket_bytes=first_bucket_bytes,
            overlap=overlap, compression=compression, stall_timeout_s=stall_timeout_s,
            stall_abort_s=stall_abort_s, default_abort_s=comm.stall_abort_s))
        self.on_stall = on_stall
        self.track_local_norm = bool(track_local_norm)
        self.track_used = bool(track_used)
        self._check_not_shared(named)
        self.buckets = self._build_buckets()
        self.overlap = self.options.overlap_for(comm, len(self.buckets))
        # every parameter and its gradient view, in bucket order: one C-level pass over these
        # (grads_are_views) replaces a Python loop per tensor on every step
        self._bucket_params = [p for b in self.buckets for p in b.params]
        self._bucket_views = [v for b in self.buckets for v in b.views]
        for p in self.params:
            _OWNERS[id(p)] = self
        self.window = Window(accumulation_steps, given=accumulation_steps)
        self._next = 0   # next bucket to launch
        self.steps = 0   # synchronised (optimizer) steps so far
        self.wait_s = 0.0  # host seconds spent waiting for the allreduce (all windows)
        self._task = -1    # the backward (autograd graph task) whose end callback is queued
        self._no_sync = False
        self.used_in_window: list[tuple[nn.Parameter, bool]] = []
        self._hooks = []
        self._driver = None
        if comm.world_size > 1:
            self._start()
        if comm.world_size > 1 or accumulation_steps > 1 or self.track_used:
            self._add_hooks()
        self._open = True  # the communicator's one GradientSync, at any world size
        GradientSync._live[id(comm)] = self

    def _set_options(self, accumulation_steps: int, divisor: int | None, prescaled: bool,
                     o: options.SyncOptions) -> None:
        comm = self.comm
        if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) \
                or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an int >= 1")
        if divisor is not None and (isinstance(divisor, bool) or not isinstance(divisor, int)
                                    or divisor < 1):
            raise ValueError(f"divisor={divisor!r} must be None or an int >= 1")
        self.options = o
        self.fusion_threshold_bytes, self.first_bucket_bytes = \
            o.fusion_threshold_bytes, o.first_bucket_bytes
        self.accumulation_steps = accumulation_steps
        self.compression = o.compression_dtype
        if self.compression is torch.bfloat16 and comm.backend == "horovod":
            raise ValueError("compression='bf16': Horovod 0.28.1 cannot reduce bfloat16; use "
                             "'fp16' or another backend")
        self.stall_timeout_s, self.stall_abort_s = o.stall_timeout_s, o.stall_abort_s
        self.comm_poll_s = o.comm_poll_s
        if prescaled and divisor is not None:
            raise ValueError("loss_prescaled=True scales the loss by 1 / (world_size * k) "
                             "itself; it does not take a divisor")
        #: the shares one step averages over (world_size * K)
        self.shares = options.shares_per_step(comm.world_size, accumulation_steps)
        self.divisor = self.shares if divisor is None else divisor
        #: what the caller multiplies each micro-batch's loss by (1.0 unless loss_prescaled)
        self.loss_prescale = 1.0 / self.divisor if prescaled else 1.0
        self.loss_prescaled = prescaled
        if prescaled:
            self.divisor = 1  # the sum is the mean already

    def _start(self) -> None:
        """World size > 1: agree with the other ranks, then register the hooks and the driver."""
        comm = self.comm
        self._agree()
        comm.register_buckets([b.comm_buffer for b in self.buckets])
        self._watchdog = watchdog_for(comm)
        self._watchdog.register_timeout(self.stall_timeout_s)
        driver = DRIVERS[self.overlap]
        self._driver = driver(comm, self.comm_poll_s, owner=self,
                              device=self.buckets[0].buffer.device if self.buckets else None) \
            if self.overlap == "thread" else driver(comm, self.comm_poll_s)

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _named(params) -> list[tuple[str, nn.Parameter]]:
        if isinstance(params, nn.Module):
            items = list(params.named_parameters())
        else:
            items = []
            for i, x in enumerate(params):
                if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                    items.append(x)
                else:
                    items.append((f"param{i}[{'x'.join(map(str, x.shape))}]", x))
        seen, out = set(), []
        for n, p in items:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((n, p))
        return out

    def _check_not_shared(self, named) -> None:
        """A parameter belongs to one GradientSync; a communicator to one, at every world size
        (a script with two that ran at 1 process would hang or be refused at 2 ranks)."""
        for n, p in named:
            other = _OWNERS.get(id(p))
            if other is not None and other._open:
                raise ValueError(f"parameter {n} is already synchronised by {other!r}; "
                                 f"close() that GradientSync first")
        other = GradientSync._live.get(id(self.comm))
        if other is not None and other._open:
            gc.collect()  # an unreachable one (a finished run's) is not in the way
            other = GradientSync._live.get(id(self.comm))
        if other is not None and other._open:
            raise ValueError(
                f"this communicator already carries {other!r}; two GradientSyncs on one "
                f"communicator start collectives in an order that depends on which backward "
                f"runs and hang or mix gradients. Synchronise all parameters (e.g. generator "
                f"and discriminator) with one GradientSync / hpclb.DistributedOptimizer, or "
                f"close() the first")

    @torch.no_grad()
    def _build_buckets(self) -> list[Bucket]:
        """Reverse registration order (roughly the order backward produces gradients), split
        by device and dtype, each bucket up to its byte cap; views at 16-byte aligned offsets."""
        groups = plan_buckets([p.numel() * p.element_size() for p in self.params],
                              self.fusion_threshold_bytes, self.first_bucket_bytes,
                              keys=[(p.dtype, p.device) for p in self.params])
        buckets = [self._make_bucket(bi, idx) for bi, idx in enumerate(groups)]
        for b in buckets:
            b.describe(len(buckets))
        return buckets

    def _make_bucket(self, bi: int, idx: list[int]) -> Bucket:
        return make_bucket(bi, [self.params[i] for i in idx], [self.names[i] for i in idx],
                           self.compression)

    def _agree(self) -> None:
        """Every rank compares its bucket layout and settings with rank 0's (one allgather)."""
        mine = {"params": [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                           for n, p in zip(self.names, self.params)],
                "buckets": [len(b.params) for b in self.buckets],
                "settings": self.agreed_settings()}
        check_sync_agreement(self.comm.allgather_object(mine))

    def agreed_settings(self) -> dict:
        """The settings every rank must share, compared at start-up: each of
        :data:`~hpclb.sync.options.SYNC_VARIABLES` as resolved (argument, else ``$HPCLB_*``,
        else default), the other variables of :data:`~hpclb.sync.options.AGREED_ENVIRONMENT`
        in force (``$HPCLB_TRUST_BACKEND``), and this GradientSync's own arguments."""
        o = self.options
        return {"compression": str(self.compression),
                "accumulation_steps": self.accumulation_steps,
                "fusion_threshold_bytes": self.fusion_threshold_bytes,
                "first_bucket_bytes": self.first_bucket_bytes,
                "overlap": self.overlap, "comm_poll_s": self.comm_poll_s,
                "stall_timeout_s": o.stall_timeout_s, "stall_abort_s": o.stall_abort_s,
                **{f"${name}": options.in_force(name) for name in options.AGREED_ENVIRONMENT
                   if name not in options.SYNC_VARIABLES.values()},
                "track_local_norm": self.track_local_norm,
                "track_used": self.track_used, "divisor": self.divisor,
                "loss_prescaled": self.loss_prescaled}

    def settings(self) -> dict:
        """The gradient-sync settings in force, as recorded in a run's ``config.json``
        (whether they came from arguments, ``HPCLB_*`` variables or the defaults): bucket
        sizes in bytes, the overlap mode chosen, the compression, the stall times in seconds
        (``stall_abort_s`` None: never), the buckets' count."""
        o = self.options
        return {"fusion_threshold_bytes": self.fusion_threshold_bytes,
                "first_bucket_bytes": self.first_bucket_bytes, "overlap": self.overlap,
                "compression": o.compression or "none", "stall_timeout_s": o.stall_timeout_s,
                "stall_abort_s": o.stall_abort_s, "comm_poll_s": self.comm_poll_s,
                "buckets": len(self.buckets)}

    # -- backward ------------------------------------------------------------------------------
    def _add_hooks(self) -> None:
        """One post-accumulate-grad hook per parameter (once; also at one process, where they
        count backward passes for accumulation, :meth:`no_sync` and ``track_used``)."""
        if self._hooks:
            return
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._make_hook(b, j)))

    def _make_hook(self, b: Bucket, j: int):
        owner = weakref.ref(self)  # a strong reference here would keep a dropped sync alive

        def hook(p: Tensor) -> None:
            sync = owner()
            if sync is not None:
                sync._on_grad(b, j, p)
        return hook

    def _on_grad(self, b: Bucket, j: int, p: Tensor) -> None:
        # no torch.no_grad() here: autograd runs hooks with grad mode off (but for
        # create_graph=True), and the bucket buffers never require grad (a context manager per
        # gradient cost more host time than the rest of the hook)
        task = _graph_task_id()
        if task != self._task and task >= 0:  # this backward's first hook: wait at its end
            self.window.check_pass()
            self._task = task
            _queue_callback(self._end_backward)
        if p.grad is not b.views[j]:
            self._adopt(b, j)
        b.used[j] = True
        if self._no_sync or self.window.micro != self.accumulation_steps - 1 \
                or self._driver is None:
            return  # accumulating locally (or one process: all is done at the window's end)
        if b.ready[j]:
            if b.launched:
                raise RuntimeError(
                    f"gradient of {b.names[j]} arrived after its bucket was sent (a second "
                    f"backward through it before synchronize()?); use accumulation_steps for "
                    f"several backward passes per step")
            return
        b.ready[j] = True
        b.pending -= 1
        if b.pending == 0:
            self._launch_ready()
        elif self._next and self._driver.needs_progress:  # buckets in flight: advance them
            self._driver.progress(self.buckets[:self._next])

    @torch.no_grad()
    def _adopt(self, b: Bucket, j: int) -> None:
        """Make ``p.grad`` the bucket view again if someone replaced it (``set_to_none``)."""
        p, view = b.params[j], b.views[j]
        g = p.grad
        if g is None:
            view.zero_()
            p.grad = view
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
            p.grad = view

    def _launch_ready(self) -> None:
        """Start every complete bucket from the next one on, in bucket order (all ranks start
        the same buckets in the same order): this rank's norm (``track_local_norm``), the
        division before a cast, then the driver's launch."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            if self.track_local_norm:  # this rank's mean gradient, before anything is divided
                b.local_sq = self._local_sq(b)
            if b.predivide:  # divide each rank's share first, then cast: the sum cannot overflow
                if self.divisor != 1:
                    b.buffer.div_(self.divisor)
                if b.comm_buffer is not b.buffer:
                    b.comm_buffer.copy_(b.buffer)
            b.launched = True
            b.error = None
            b.seq = self._watchdog.entered(f"step {self.steps + 1} {b.what}")
            self._driver.launch(b)
            self._next += 1

    def loss_weight(self, n_part: int, n_global: int) -> float:
        """What a micro-batch's mean loss over its ``n_part`` samples is multiplied by before
        ``backward()`` so that the window's averaged gradient is the mean over the
        ``n_global`` samples of the global batch (all ranks, all micro-batches), also when the
        shares are uneven: ``world_size * K * n_part / n_global`` (the reduced sum is divided
        by ``world_size * K``), times :attr:`loss_prescale`. Exactly 1 for even shares."""
        w = self.shares * n_part / n_global
        return w * self.loss_prescale

    # -- the window: the accumulation contract (module docstring) -----------------------------
    @torch.no_grad()
    def _end_backward(self) -> None:
        """The end of a backward pass (autograd callback): count the micro-batch; on a window's
        K-th, reduce every bucket and divide, so ``p.grad`` is the global mean on return."""
        self._task = -1
        if self.window.count(self._no_sync):
            self._end_window()

    def skip_micro_batch(self) -> None:
        """This rank has no samples in the current micro-batch (an uneven last step): count it
        in the window as an empty one, so every rank counts the same micro-batches; on the
        window's last, reduce every bucket now, as the end of a backward does."""
        if self._hooks:  # else (one process, K = 1) synchronize() ends every window
            self.window.check_pass()
            self._end_backward()

    def end_window(self) -> None:
        """Reduce the window now with the micro-batches counted so far (Horovod's ``step()``
        after fewer passes than ``backward_passes_per_step``: :mod:`hpclb.horovod`), divided
        as a full window is; :meth:`synchronize` reports it. Nothing to do after the window's
        K-th micro-batch, after a backward under :meth:`no_sync` alone (``synchronize()``
        refuses that) or at one process without hooks (``synchronize()`` ends every window)."""
        if self._hooks and not self.window.reduced and not self.window.local:
            self.window.end()
            self._end_window()

    def synchronize(self) -> bool:
        """Call after the window (``DistributedOptimizer.step()`` does). True when a window
        ended (and was reduced: every ``p.grad`` is the mean over ranks and micro-batches)
        since the last call; False inside a window, where it changes nothing. With
        ``accumulation_steps`` 1 a call with no backward since the last one (a rank with no
        samples, or a backward that reached no parameter) is an empty window, reduced here.

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
        if not self.window.reduced and not self.window.local and self.accumulation_steps == 1:
            self.skip_micro_batch()  # an empty window
        return self.window.report()

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated so far in the current window (0 at a window's start)."""
        return self.window.micro

    def reset_epoch(self) -> int:
        """Start a new accumulation window at an epoch boundary; returns how many micro-batches
        of an unfinished window are dropped (their gradients stay local: zero them)."""
        return self.window.reset()

    def mark_all_ready(self) -> None:
        """End a micro-batch whose gradients were written without autograd (manual gradients,
        benchmarks) as the end of a backward does: on a window's last micro-batch every bucket
        is reduced now. :meth:`synchronize` afterwards reports it as usual. Every gradient
        counts as written (none is taken for an unused parameter and reduced as zeros)."""
        self.window.check_pass()
        for b in self.buckets:
            b.used = [True] * len(b.params)
        self._end_backward()

    @torch.no_grad()
    def _end_window(self) -> None:
        """End the window with the micro-batches counted (K, or fewer: :meth:`end_window`):
        reduce every bucket and divide."""
        if self.track_used:
            self.used_in_window = [(p, u) for b in self.buckets for p, u in zip(b.params, b.used)]
        t0 = time.perf_counter()
        try:
            if self._driver is None:
                self._finish_alone()
            else:
                with _record("hpclb/allreduce_wait") if _profiling() else nullcontext():
                    self._reduce()
        finally:
            self.steps += 1  # counted after the reduction (its buckets are labelled steps + 1)
            self.wait_s += time.perf_counter() - t0

    @contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``: backward passes inside accumulate this rank's gradients locally
        (no communication) and do not count toward ``accumulation_steps``; the next backward
        outside reduces the sum. (Every rank enters it for the same backward passes.)"""
        self._add_hooks()
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def _reduce(self) -> None:
        """World size > 1: start what is left (a parameter without a gradient in this window
        travels as zeros), wait for every bucket in order, divide; the buckets are then ready
        for the next window."""
        for b in self.buckets:
            if b.pending:
                for j, ready in enumerate(b.ready):
                    if not ready:
                        if not b.used[j]:
                            b.views[j].zero_()
                        b.params[j].grad = b.views[j]
                        b.ready[j] = True
                b.pending = 0
        self._launch_ready()
        error = None
        for b in self.buckets:
            label = f"step {self.steps + 1} {b.what}"
            with self._watchdog.waiting(b.seq, label, self.stall_timeout_s, self.on_stall,
                                        self.stall_abort_s):
                self._driver.wait(b)
            if b.error is not None and error is None:
                error = RuntimeError(f"allreduce of {label} failed: {b.error!r}")
            if b.comm_buffer is not b.buffer:
                b.buffer.copy_(b.comm_buffer)
            if not b.predivide and self.divisor != 1:
                b.buffer.div_(self.divisor)
            n = len(b.params)
            b.ready, b.used, b.pending, b.launched = [False] * n, [False] * n, n, False
        self._next = 0
        self._driver.end_step()
        if error is not None:
            raise error

    def _finish_alone(self) -> None:
        """One process: no allreduce; the window's gradients are made final here (the divide),
        labelled as the wait it stands for at several ranks."""
        with _record("hpclb/allreduce_wait") if _profiling() else nullcontext():
            if not self.grads_are_views():  # someone replaced a gradient (or set it to None)
                for b in self.buckets:
                    for j in range(len(b.params)):
                        self._adopt(b, j)
            for b in self.buckets:
                b.used = [False] * len(b.params)
                if self.track_local_norm:
                    b.local_sq = self._local_sq(b)
                if self.divisor != 1:
                    b.buffer.div_(self.divisor)

    # -- the gradients as a whole (what step() does once per window) ---------------------------
    def grads_are_views(self) -> bool:
        """True when every parameter's ``grad`` is its bucket view, as backward leaves them (not
        replaced, not None, none frozen): then the bucket buffers hold exactly the gradients
        (alignment padding is always zero) and whole-gradient work can run on the buffers, one
        operation per bucket instead of one per tensor. One C-level pass, ~0.04 us a tensor."""
        return all(map(operator.is_, map(_grad_of, self._bucket_params), self._bucket_views)) \
            and all(map(_requires_grad, self._bucket_params))

    @torch.no_grad()
    def grad_norm(self) -> Tensor | None:
        """The global L2 norm of every gradient (0-d, the first bucket's dtype and device; no
        host read), computed over the bucket buffers: ``||(||buffer_b||)_b||``. The same value
        as ``torch.nn.utils.get_total_norm`` over the gradients up to rounding (the sum of
        squares is grouped by bucket, not by tensor). The caller checked
        :meth:`grads_are_views`; None when there are no buckets."""
        if not self.buckets:
            return None
        bufs = [b.buffer for b in self.buckets]
        if len(bufs) == 1:
            return torch.linalg.vector_norm(bufs[0])
        dev = bufs[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in torch._foreach_norm(bufs)]))

    @torch.no_grad()
    def scale_grads_(self, coef: Tensor) -> None:
        """Multiply every gradient by the 0-d ``coef`` in place, one multiply per bucket (the
        caller checked :meth:`grads_are_views`); the same elements as
        ``torch.nn.utils.clip_grads_with_norm_``'s per-tensor multiply."""
        for b in self.buckets:
            b.buffer.mul_(coef.to(b.buffer.device))

    @torch.no_grad()
    def zero_grads_(self) -> None:
        """Zero every gradient in place, one fill per bucket (the caller checked
        :meth:`grads_are_views`)."""
        for b in self.buckets:
            b.buffer.zero_()

    def _local_sq(self, b: Bucket) -> Tensor:
        """``|g_local|^2`` of bucket ``b`` before anything is divided: this rank's mean over
        the window's micro-batches (the buffer holds their sum, or with ``loss_prescaled`` that
        sum over ``world_size * k``)."""
        sq = torch.linalg.vector_norm(b.buffer, dtype=torch.float32).square()
        given = max(self.window.given, 1)
        if self.loss_prescaled:
            return sq * (float(self.comm.world_size) * self.accumulation_steps / given) ** 2
        return sq / given ** 2

    @property
    def local_sq_norm(self) -> Tensor | None:
        """0-d float32 tensor on the gradients' device: ``|g_local|^2`` of the last synchronised
        step, this rank's mean gradient over its own samples before the allreduce (needs
        ``track_local_norm=True``; else None)."""
        if not self.track_local_norm or any(b.local_sq is None for b in self.buckets):
            return None
        return torch.stack([b.local_sq.to(self.buckets[0].buffer.device)
                            for b in self.buckets]).sum()

    @property
    def nbytes(self) -> int:
        """Bytes of gradient buffers (all buckets, alignment padding included)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        return [b.nbytes for b in self.buckets]

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (gradients stay bucket views)."""
        self._open = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self.params:
            if _OWNERS.get(id(p)) is self:
                del _OWNERS[id(p)]
        if GradientSync._live.get(id(self.comm)) is self:
            del GradientSync._live[id(self.comm)]
            self.comm.register_buckets([])
        if self._driver is not None:
            self._driver.close()

    def __repr__(self) -> str:
        return (f"GradientSync({len(self.params)} tensors, {self.nbytes / options.MiB:.2f} MiB in "
                f"{len(self.buckets)} buckets, overlap={self.overlap}, "
                f"accumulation_steps={self.accumulation_steps}, compression="
                f"{str(self.compression).replace('torch.', '')}, world_size="
                f"{self.comm.world_size})")
