"""One optimizer step across ranks, shared by ``hpclb train`` and library users.

:class:`DistributedOptimizer` wraps any ``torch.optim.Optimizer``. Its ``step()`` does, in order:

1. take the window's averaged gradients. They are already there: the allreduce (fused
   buckets, :class:`~hpclb.sync.gradients.GradientSync`) starts during backward and is waited
   for at the end of the window's last ``backward()``, so ``step()`` waits for nothing. With
   ``accumulation_steps`` K, the window is K backward passes (``hpclb train`` counts an empty
   share with ``sync.skip_micro_batch()``) and then one ``step()``, GradientSync's one
   accumulation contract (:mod:`hpclb.sync.gradients`). ``step()`` may also follow every
   backward: inside a window it returns ``False`` and changes nothing, and one with no backward
   since the last counts an empty micro-batch (``skip_micro_batch()``). A short window (a
   ``step()`` after fewer passes, reduced there) is :mod:`hpclb.horovod`'s loop;
2. unscale the fp16 loss scale (when a ``torch.amp.GradScaler`` is given);
3. the global gradient norm (one fused norm over all gradients, on the device) and the
   non-finite guard: a non-finite norm skips the step on every rank together (the averaged
   gradients are identical on all ranks, so no extra collective is needed) and counts it; after
   ``max_nonfinite_steps`` skipped steps in a row it raises :class:`NonFiniteError` naming the
   step and the first non-finite layer. Two ways, by what the optimizer supports:

   - *on the device* (optimizers with torch's ``_step_supports_amp_scaling`` contract:
     :class:`hpclb.LARS`, :class:`hpclb.LAMB`, torch's fused Adam/AdamW/SGD): the found-inf flag
     is handed to the optimizer as ``optimizer.found_inf`` (as ``torch.amp.GradScaler`` does),
     which masks the whole update on the device; the skip and the run of skips are counted on
     the device, and the limit is checked by :meth:`check_nonfinite` (the training loop calls
     it at each log line and epoch end). The step reads nothing from the device;
   - *on the host* (any other optimizer): one 0-d read per step, as ``GradScaler.step`` makes;
     the limit is checked at once;
4. optional clipping to ``grad_clip_norm`` (after the averaging, once);
5. the wrapped optimizer's step.

DDP's contract: when the window's last ``backward()`` returns, ``p.grad`` is the global mean;
``step()`` only takes the window, so forgetting the synchronisation is impossible.

The contracts kept for torch.optim, DDP and Horovod users (``docs/library.md``), each checked
where it can break: Horovod's ``synchronize()`` / ``skip_synchronize()`` (the window is already
reduced; ``p.grad`` may be changed before ``step()``, which does not synchronise again);
``zero_grad()`` zeroes at a window's start, is a no-op inside one of the per-backward loop, and
raises between a ``backward()`` and its ``step()``; a parameter that
became trainable or was added after construction is refused at the next ``step()`` until
:meth:`~DistributedOptimizer.refresh_parameters` (:func:`check_parameter_set`); a parameter
frozen at the step gets ``grad = None`` (:func:`drop_frozen_grads`); ``find_unused_parameters``
as DDP's (:func:`drop_unused`).

A DistributedOptimizer is an instance of the wrapped optimizer's class (a subclass made once per
class, as Horovod's wrapper is), so torch's LR schedulers and ``isinstance`` checks take it; its
``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's.
"""
from __future__ import annotations

import math
import operator
from contextlib import contextmanager
from itertools import chain
from typing import Callable

import torch
from torch import Tensor, nn

from hpclb.comm.base import Communicator
from hpclb.comm.world import current_communicator
from hpclb.errors import NonFiniteError
from hpclb.sync.agree import verify_replicas
from hpclb.sync.gradients import GradientSync

__all__ = ["CALIBRATION_SCALE", "DistributedOptimizer", "NonFiniteGuard", "masks_on_device"]


def _named(model_or_named_parameters) -> list[tuple[str, nn.Parameter]]:
    if isinstance(model_or_named_parameters, nn.Module):
        return list(model_or_named_parameters.named_parameters())
    items = list(model_or_named_parameters)
    if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
        return [(f"param{i}", p) for i, p in enumerate(items)]
    return items


_requires_grad = operator.attrgetter("requires_grad")
_params_of = operator.itemgetter("params")


def drop_unused(used: list, comm) -> None:
    """After a window's allreduce: ``grad = None`` for every parameter that got no gradient on
    any rank in the window (``used``: ``(parameter, got a gradient here)`` pairs, the
    GradientSync's ``used_in_window``; one allreduce (max) of a byte per parameter), as DDP's
    ``find_unused_parameters`` leaves them."""
    flags = torch.tensor([u for _, u in used], dtype=torch.uint8)
    if comm.world_size > 1 and len(flags):
        comm.allreduce_(flags, op="max")
    for (p, _), u in zip(used, flags.tolist()):
        if not u:
            p.grad = None


def check_parameter_set(optimizer: torch.optim.Optimizer, synced: set[int],
                        names: dict[int, str]) -> None:
    """Raise RuntimeError when ``optimizer`` holds a trainable parameter whose id is not in
    ``synced`` (unfrozen or added after the DistributedOptimizer was built), naming it and the
    fix. ``names``: id -> parameter name, for the message. (The check of every step is the
    one C-level pass :meth:`DistributedOptimizer.synchronize` makes; this runs when it fails.)"""
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if p.requires_grad and id(p) not in synced:
                name = names.get(id(p), f"param_groups[{gi}]['params'][{j}]")
                raise RuntimeError(
                    f"parameter {name} {list(p.shape)} is trainable but was not when the "
                    f"DistributedOptimizer was built (unfrozen, or added with add_param_group): "
                    f"its gradient would stay local and the replicas would diverge. Call "
                    f"optimizer.refresh_parameters() on every rank after changing requires_grad "
                    f"(before the next backward), or add groups with "
                    f"DistributedOptimizer.add_param_group()")


def drop_frozen_grads(params: list[nn.Parameter]) -> None:
    """``grad = None`` for every parameter frozen at this step (``requires_grad=False``): torch
    optimizers skip such parameters (no momentum, weight decay or moment update). The next
    backward that reaches the parameter makes its gradient the bucket view again. (The check
    of every step, none frozen, is one C-level pass in :meth:`DistributedOptimizer.synchronize`.)"""
    for p in params:
        if not p.requires_grad:
            p.grad = None


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _subclass_for(base: type, cls: type) -> type:
    """``base`` (DistributedOptimizer or a subclass) mixed with the optimizer class ``cls``
    (made once per pair)."""
    sub = _SUBCLASSES.get((base, cls))
    if sub is None:
        sub = _SUBCLASSES[base, cls] = type(f"Distributed{cls.__name__}", (base, cls),
                                            {"__module__": base.__module__, "_mixed": True})
    return sub


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose ``step()`` averages gradients across ranks first.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (SGD, Adam, :class:`hpclb.LARS`, ...) over the
            model's parameters.
        model_or_named_parameters: the model (``nn.Module``) or its ``named_parameters()``, in the
            same order on every rank. Every parameter the optimizer updates must be here.
        comm: the communicator (default: the one :func:`hpclb.init` made).
        accumulation_steps: K micro-batches (backward passes) per optimizer step: K
            ``backward()`` (``sync.skip_micro_batch()`` for a rank's empty share), then
            ``step()``; or ``step()`` after every ``backward()``, where the first ``K - 1``
            return False without stepping and a ``step()`` with no backward since the last
            counts an empty micro-batch. The result is the mean over ranks and the K
            micro-batches (the gradient of the K-times larger batch when each micro-batch loss
            is a mean). More than K backward passes before a ``step()``, or a ``step()`` after
            2 to K - 1 of them (a short window: :mod:`hpclb.horovod`'s), raise RuntimeError;
            so does a ``step()`` after one pass once the first window took K per ``step()``
            (the loop is known from the first window, on each rank).
        grad_clip_norm: clip the averaged gradient to this global L2 norm (None: no clipping).
        max_nonfinite_steps: non-finite steps skipped in a row before :class:`NonFiniteError`
            (>= 1; default 3). With an fp16 scaler, overflows count only once the loss scale has
            fallen below 1 (before that they are the scaler's calibration).
        scaler: a ``torch.amp.GradScaler`` for fp16 (the caller scales the loss with
            ``scaler.scale(loss).backward()``; ``step()`` unscales before the norm, clipping and
            trust ratios, and updates the scale).
        broadcast_mismatch: at construction every rank's parameter and buffer values are
            compared by fingerprint (:func:`~hpclb.sync.agree.verify_replicas`); replicas that
            differ get rank 0's values with a UserWarning naming the first differing tensor
            (True, default) or raise ModelMismatchError on every rank (False). Given the model
            (an ``nn.Module``), the source of the modules that define its classes is compared
            first (:func:`~hpclb.sync.agree.check_model_code`): a rank whose copy of one differs
            raises ModelMismatchError on every rank, naming it.
        check_nonfinite_every: on the device path (LARS, LAMB, torch's fused optimizers) the
            non-finite limit is checked by :meth:`check_nonfinite`, which ``step()`` also calls
            every this many optimizer steps (one small read; default 100; 0: only when the
            caller calls it), so a diverged run cannot go on silently masking every update.
        find_unused_parameters: as DDP's: after each allreduce, parameters that got no gradient
            on any rank in the window get ``grad = None`` (not updated, as in plain torch), at
            the cost of one allreduce of a byte per parameter per step. False (default): they
            are reduced as zeros (momentum and weight decay still move them).
        **sync_options: passed to :class:`~hpclb.sync.gradients.GradientSync`
            (fusion_threshold_bytes, overlap, compression, stall_timeout_s, track_local_norm,
            ...).

    Attributes after each ``step()``: ``grad_norm`` (0-d float32 device tensor, the averaged
    gradient's global L2 norm before clipping), ``steps`` (optimizer steps taken or skipped),
    ``skipped_steps`` (non-finite steps skipped in total; reading it reads the device when the
    guard counts there), ``step_skipped`` (0-d bool device tensor: the last completed step was
    skipped; None before the first), ``sync_wait_s`` (host seconds spent
    waiting for the allreduce, all steps: the communication that backward did not hide),
    ``sync`` (the GradientSync).

    The contract with the caller (``docs/library.md``; the functions above the class): when the
    window's last ``backward()`` returns, ``p.grad`` is the global mean (clip, log or change it
    there, as under DDP); :meth:`no_sync` is DDP's ``no_sync()``; ``zero_grad()`` is a no-op
    inside an accumulation window and zeroes after every window's ``step()``; parameters frozen
    at a step are not updated; a parameter set that grows needs :meth:`refresh_parameters` (or
    :meth:`add_param_group`). The object is an instance of ``type(optimizer)`` (torch's LR
    schedulers take it).

    Raises ValueError when the optimizer updates a parameter that is not in
    ``model_or_named_parameters`` (its gradient would never be averaged) or for a bad setting,
    TypeError for something that is not a torch optimizer (or is already distributed).
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        if not cls.__dict__.get("_mixed") and isinstance(optimizer, torch.optim.Optimizer) \
                and not isinstance(optimizer, DistributedOptimizer):
            cls = _subclass_for(cls, type(optimizer))
        return object.__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, model_or_named_parameters, *,
                 comm: Communicator | None = None, accumulation_steps: int = 1,
                 grad_clip_norm: float | None = None, max_nonfinite_steps: int = 3,
                 scaler: "torch.amp.GradScaler | None" = None, broadcast_mismatch: bool = True,
                 find_unused_parameters: bool = False, check_nonfinite_every: int = 100,
                 **sync_options):
        if not isinstance(optimizer, torch.optim.Optimizer) or \
                isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if grad_clip_norm is not None and not (grad_clip_norm > 0
                                               and math.isfinite(grad_clip_norm)):
            raise ValueError(f"grad_clip_norm={grad_clip_norm!r} must be None or a positive norm")
        if isinstance(max_nonfinite_steps, bool) or not isinstance(max_nonfinite_steps, int) \
                or max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps={max_nonfinite_steps!r} must be an int >= 1 "
                             f"(consecutive skipped steps before the run stops)")
        if isinstance(check_nonfinite_every, bool) or not isinstance(check_nonfinite_every, int) \
                or check_nonfinite_every < 0:
            raise ValueError(f"check_nonfinite_every={check_nonfinite_every!r} must be an int >= 0 "
                             f"(optimizer steps between checks of the non-finite limit)")
        self.check_nonfinite_every = check_nonfinite_every
        if comm is None:
            comm = current_communicator()
        named = _named(model_or_named_parameters)
        known = {id(p) for _, p in named}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad and id(p) not in known:
                    raise ValueError(f"the optimizer's param_groups[{gi}] holds a parameter of "
                                     f"shape {list(p.shape)} that is not among the model's "
                                     f"parameters given to DistributedOptimizer; its gradient "
                                     f"would never be averaged across ranks")
        self.optimizer = optimizer
        self.comm = comm
        verify_replicas(model_or_named_parameters if isinstance(model_or_named_parameters,
                                                                nn.Module) else named,
                        comm, broadcast=broadcast_mismatch)
        self._named = named
        self.find_unused_parameters = bool(find_unused_parameters)
        self._sync_kwargs = dict(accumulation_steps=accumulation_steps, **sync_options)
        self._build_sync()
        self.grad_clip_norm = grad_clip_norm
        self.max_nonfinite_steps = max_nonfinite_steps
        self.scaler = scaler
        self.grad_norm: Tensor | None = None
        self._views = False  # this step's gradients are the bucket views (GradientSync)
        self.steps = 0
        self.guard = NonFiniteGuard(optimizer, max_nonfinite_steps, scaler)
        #: the caller's loop, seen at its first window (K > 1): True, step() after every
        #: backward; False, one step() after the window's K passes (then a step() after one
        #: pass is a short window, refused, not a micro-batch); None, not seen yet
        self._step_per_backward: bool | None = None

    def _build_sync(self) -> None:
        """The GradientSync over the trainable parameters of ``_named``."""
        trainable = [(n, p) for n, p in self._named if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self._synced_ids = {id(p) for p in self.params}
        self._names_by_id = {id(p): n for n, p in self._named}
        self.sync = GradientSync(trainable, self.comm, track_used=self.find_unused_parameters,
                                 **self._sync_kwargs)
        # zero_grad() may zero the buckets when they hold exactly the optimizer's gradients
        self._zero_by_bucket = self._synced_ids == {
            id(p) for g in self.optimizer.param_groups for p in g["params"]}

    # the torch.optim.Optimizer surface LR schedulers and user code read: the wrapped one's
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def sync_wait_s(self) -> float:
        """Host seconds spent waiting for the allreduce at the end of backward, all windows."""
        return self.sync.wait_s

    def no_sync(self):
        """DDP's ``model.no_sync()``, as a context manager on the optimizer: backward passes
        inside accumulate this rank's gradients (no communication, not counted toward
        ``accumulation_steps``); the next backward outside reduces the sum (divided by
        ``world_size``: scale the loss as under DDP). ``step()`` after a backward inside with
        none outside raises RuntimeError. Every rank uses it for the same backward passes."""
        return self.sync.no_sync()

    @property
    def accumulation_steps(self) -> int:
        return self.sync.accumulation_steps

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place (they are views into the communication buckets;
        ``set_to_none`` is accepted and ignored, since re-allocating would cost a copy). Inside
        an accumulation window (after a ``step()`` that returned False) a no-op:
        the window's gradients accumulate until its last ``step()``; after every ``step()`` that
        ended a window it zeroes. With ``accumulation_steps`` > 1 raises
        RuntimeError whenever it would drop a micro-batch's gradients (after its backward,
        before its ``step()``)."""
        sync = self.sync
        if sync.accumulation_steps > 1 and sync.window.passes:
            raise RuntimeError(
                "zero_grad() between backward() and step() with accumulation_steps="
                f"{sync.accumulation_steps}: it would drop this micro-batch's gradients from the "
                "window. Call step() after every backward(), and zero_grad() before backward()")
        if sync.window.micro == 0:  # a window's start: after every step() that ended one
            if self._zero_by_bucket and self.sync.grads_are_views():
                self.sync.zero_grads_()  # the same zeros, one fill per bucket
            else:
                self.optimizer.zero_grad(set_to_none=False)

    def synchronize(self) -> bool:
        """Horovod's ``synchronize()``. The gradients are already averaged when the window's
        last ``backward()`` returns (DDP's contract), so this only checks the parameter set and
        takes the window (:mod:`hpclb.horovod`'s reduces a short one here first): afterwards
        ``p.grad`` may be read, clipped or changed before ``step()``, which then does not
        synchronise again. Returns False inside a window (``step()`` after every backward: the
        gradients are still local); a call with no backward since the last counts an empty
        micro-batch. Raises RuntimeError for a parameter set that changed, a backward under
        ``no_sync()`` with none after it, or a short window (2 to K - 1 backward passes, or
        one in a loop whose first window took K per ``step()``)."""
        window = self.sync.window  # window.reported: this result, until step() takes it
        if window.reported is not None:
            raise RuntimeError("synchronize() was already called for this step; call step()")
        k = self.sync.accumulation_steps
        if not window.reduced and not window.local:  # inside a window: step() per backward
            if window.passes > 1 or (window.passes and self._step_per_backward is False):
                raise RuntimeError(
                    f"step() after {window.passes} of the window's accumulation_steps={k} "
                    f"backward passes (a short window): hpclb.DistributedOptimizer takes K "
                    f"backward passes per step(), or one step() after every backward, and this "
                    f"loop took {k} per step() before. Count the missing micro-batches with "
                    f"opt.sync.skip_micro_batch() and scale each loss by {k} / passes given, "
                    f"drop the short last batch (drop_last=True), or use "
                    f"hpclb.horovod.DistributedOptimizer for Horovod's short windows")
            if window.passes:
                self._step_per_backward = True
            else:  # no backward since the last step(): an empty micro-batch
                self.sync.skip_micro_batch()
        elif window.reduced and k > 1 and self._step_per_backward is None:
            self._step_per_backward = window.passes == 1
        if not all(map(self._synced_ids.__contains__,
                       map(id, chain.from_iterable(map(_params_of, self.optimizer.param_groups))))):
            try:  # a parameter the optimizer holds is not synchronised: trainable now?
                check_parameter_set(self.optimizer, self._synced_ids, self._names_by_id)
            except RuntimeError:
                self.sync.synchronize()  # take this window on every rank, then refuse
                raise
        window.reported = self.sync.synchronize()
        if window.reported:
            if not all(map(_requires_grad, self.params)):  # frozen at this step
                drop_frozen_grads(self.params)
            if self.find_unused_parameters:
                drop_unused(self.sync.used_in_window, self.comm)
        return window.reported

    @contextmanager
    def skip_synchronize(self):
        """Horovod's idiom: ``opt.synchronize(); clip...; with opt.skip_synchronize():
        opt.step()``. ``step()`` never synchronises twice, so this only checks that
        ``synchronize()`` was called (RuntimeError naming the fix otherwise)."""
        if self.sync.window.reported is None:
            raise RuntimeError("skip_synchronize(): call optimizer.synchronize() before step()")
        yield

    def refresh_parameters(self) -> None:
        """Re-bucket after parameters were unfrozen (``requires_grad=True``) or added to the
        optimizer: every trainable parameter of the model and of the optimizer's groups is
        averaged from the next backward on. Collective: every rank calls it at the same point,
        between ``step()`` and the next ``backward()`` (RuntimeError otherwise); ranks that
        disagree on the new set raise ModelMismatchError together."""
        if self.sync.micro_batches or any(any(b.ready) for b in self.sync.buckets):
            raise RuntimeError("refresh_parameters() inside an accumulation window or between "
                               "backward() and step(): call it after step()")
        known = {id(p) for _, p in self._named}
        for gi, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in known:
                    known.add(id(p))
                    self._named.append((f"param_groups[{gi}][{j}]", p))
        self.sync.close()
        self._build_sync()

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group`` on the wrapped optimizer, then
        :meth:`refresh_parameters` (collective: every rank adds the same group)."""
        self.optimizer.add_param_group(param_group)
        self.refresh_parameters()

    def step(self, closure=None) -> bool:
        """Average, check, clip and step (module docstring). Returns False inside an
        accumulation window (``step()`` after every backward) or for a step skipped on the host
        path; True when the update was
        issued (on the device path a non-finite step is masked there: ``step_skipped`` says).
        Raises :class:`NonFiniteError` after too many non-finite steps in a row (host path;
        the device path raises in :meth:`check_nonfinite`)."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step() takes no closure: run forward and "
                             "backward before calling step()")
        window = self.sync.window
        if window.reported is None:  # unless the caller synchronised already
            self.synchronize()
        synced, window.reported = window.reported, None
        if not synced:
            return False
        self.steps += 1
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        self._views = self.sync.grads_are_views()  # the buckets hold exactly the gradients
        self.grad_norm = self.sync.grad_norm() if self._views else None
        if self.grad_norm is None:  # a gradient replaced, None or frozen: tensor by tensor
            grads = [p.grad for p in self.params if p.grad is not None]
            self.grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.grad_norm.device.type == "meta":  # a device dry run: nothing to read
            self._apply(None)
            return True
        if self.guard.on_device:  # the optimizer masks the update: no host read
            self._apply(self.guard.found_on_device(self.grad_norm, self.steps))
            if self.check_nonfinite_every and self.steps % self.check_nonfinite_every == 0:
                self.check_nonfinite()  # one read every N steps: raises at the limit
            return True
        if self.guard.skip_on_host_norm(self.grad_norm):  # the one host read per step
            self._skip()
            return False
        self._apply(None)
        return True

    def _apply(self, found: Tensor | None) -> None:
        """Clip and step; ``found`` (device path): the found-inf flag handed to the optimizer."""
        if self.grad_clip_norm:  # a skipped step's norm as 0: clipping leaves its gradients be
            norm = self.grad_norm if found is None else torch.where(found, 0.0, self.grad_norm)
            if self._views:  # torch's coefficient, one multiply per bucket
                self.sync.scale_grads_(torch.clamp(self.grad_clip_norm / (norm + 1e-6), max=1.0))
            else:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip_norm, norm)
        if found is None:
            self.optimizer.step()
        else:  # torch's contract (GradScaler.step): grad_scale None = already unscaled
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        if self.scaler is not None:
            self.scaler.update()  # lowers the fp16 loss scale after a skip, as GradScaler does

    def _skip(self) -> None:
        self.guard.check(self.steps, self.first_nonfinite_layer)  # raises at the limit
        self.optimizer.zero_grad(set_to_none=False)
        if self.scaler is not None:
            self.scaler.update()  # lowers the fp16 loss scale, as a skipped scaler step does

    def check_nonfinite(self) -> int:
        """Raise :class:`NonFiniteError` when ``max_nonfinite_steps`` skipped steps in a row were
        reached (naming the optimizer step at which it happened); returns the skipped steps so
        far. On the device path this is where the limit is checked (one host read): call it
        at log points; on the host path the step itself raises."""
        return self.guard.check(self.steps, self.first_nonfinite_layer)

    @property
    def step_skipped(self) -> Tensor | None:
        return self.guard.found_inf

    @property
    def skipped_steps(self) -> int:
        return self.guard.total()

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        self.guard.set_skipped(n)

    def first_nonfinite_layer(self) -> str | None:
        """Name of the first parameter whose gradient holds inf/NaN (host syncs per layer: only
        for the error path)."""
        for n, p in zip(self.names, self.params):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return n
        return None

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict (``state``, ``param_groups``: the plain optimizer
        class loads it as it is) plus the counters ``steps``, ``skipped_steps`` and, with a
        scaler, ``scaler`` (which torch's ``load_state_dict`` ignores)."""
        return {**self.optimizer.state_dict(), "steps": self.steps,
                "skipped_steps": self.skipped_steps,
                **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s dict, a plain optimizer's, or the older form that nested
        the optimizer's under ``"optimizer"``."""
        if "optimizer" in state and "param_groups" not in state:
            state = {**state["optimizer"], **{k: v for k, v in state.items() if k != "optimizer"}}
        self.optimizer.load_state_dict(state)
        if "steps" not in state:  # a plain optimizer state dict
            return
        self.steps = int(state.get("steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        """Release the communicator (hooks, communication thread)."""
        self.sync.close()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({type(self.optimizer).__name__}, {self.sync!r})"


# -- the non-finite guard of step() -----------------------------------------------------------
#: fp16 overflows while the loss scale is at least this are the scaler's calibration, not counted
#: toward ``max_nonfinite_steps``.
CALIBRATION_SCALE = 1.0
#: the device counts keep the step at which the limit was hit as ``_HIT_BASE - step``
_HIT_BASE = 2 ** 62


def masks_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step()`` honours ``optimizer.found_inf`` (torch's
    ``_step_supports_amp_scaling`` contract), so a skip can be masked without a host read."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class NonFiniteGuard:
    """The non-finite guard of :meth:`DistributedOptimizer.step` (step 3 of the module
    docstring): skips a step whose averaged gradient has a non-finite global norm, on every rank
    (the norm is the same on all of them), and counts it. On the device (``on_device``, from
    :func:`masks_on_device`) the wrapped optimizer gets the flag as ``optimizer.found_inf`` (0-d
    float32, 1.0 = skip) and masks the update itself; the skip, the run of skips in a row and
    the step at which that run reached ``max_nonfinite_steps`` are counted in a 3-element int64
    device tensor that :meth:`check` reads (one read). On the host: one read per step (two flags
    in one copy with an fp16 scaler), the limit checked at once. With an fp16 scaler a skip
    counts toward the limit only once the loss scale is below :data:`CALIBRATION_SCALE` (before
    that it is the scaler calibrating itself), decided on the device.

    ``found_inf`` after each :meth:`found`: 0-d bool device tensor, True when the last completed
    step was skipped (the training loop masks that step's statistics with it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_nonfinite_steps: int,
                 scaler: "torch.amp.GradScaler | None"):
        self.optimizer, self.max_steps, self.scaler = optimizer, max_nonfinite_steps, scaler
        self.on_device = masks_on_device(optimizer)
        self.found_inf: Tensor | None = None
        self.skipped_host = 0    # skips counted on the host (and those of a loaded state)
        self.streak = 0          # host path: skips in a row that count toward the limit
        self._counts: Tensor | None = None   # device: skipped, streak, step the limit was hit
        self._count_views: tuple[Tensor, ...] = ()   # its three elements (views)
        self._flags: dict = {}  # device -> (False, True) 0-d bool tensors (the host path's flag)

    def found(self, grad_norm: Tensor) -> Tensor:
        """The step's found-inf flag (0-d bool, on ``grad_norm``'s device; no read)."""
        self.found_inf = ~torch.isfinite(grad_norm)
        return self.found_inf

    def _counted(self, found: Tensor) -> Tensor:
        """Skips that count toward the limit under the fp16 scaler (its callers have one): those
        at scale < 1."""
        scale = self.scaler._get_scale_async()
        if scale is None:   # never scaled yet: the initial scale (>= 1)
            return torch.zeros_like(found)
        return found & (scale.to(found.device) < CALIBRATION_SCALE)

    def found_on_device(self, grad_norm: Tensor, step: int) -> Tensor:
        """The device path: the step's found-inf flag (0-d bool, no read), counted on the
        device (``step``: the optimizer step, 1-based) in six small ops, four in place on the
        three counts. The streak is ``(streak + counted) * found`` (a finite step resets it);
        the step at which it first reached the limit is kept as ``_HIT_BASE - step``, so a
        later step never replaces it (``clamp_(min=...)``)."""
        found = self.found_inf = ~torch.isfinite(grad_norm)
        if self._counts is None:
            self._counts = torch.zeros(3, dtype=torch.int64, device=found.device)
            self._count_views = self._counts.unbind()
        skipped, streak, hit = self._count_views
        skipped.add_(found)
        streak.add_(found if self.scaler is None else self._counted(found)).mul_(found)
        hit.clamp_(min=(streak >= self.max_steps) * (_HIT_BASE - step))
        return found

    def skip_on_host_norm(self, grad_norm: Tensor) -> bool:
        """The host path without a scaler: one read of the norm itself (``item()``, the same
        one read ``bool(found)`` makes) and the finiteness decided on the host, no tensor op;
        ``found_inf`` is a cached 0-d bool on the norm's device. With a scaler:
        :meth:`found` then :meth:`skip_on_host`."""
        if self.scaler is not None:
            return self.skip_on_host(self.found(grad_norm))
        bad = not math.isfinite(grad_norm.item())
        flags = self._flags.get(grad_norm.device)
        if flags is None:
            flags = self._flags[grad_norm.device] = (
                torch.tensor(False, device=grad_norm.device),
                torch.tensor(True, device=grad_norm.device))
        self.found_inf = flags[bad]
        if not bad:
            self.streak = 0
            return False
        self.skipped_host += 1
        self.streak += 1
        return True

    def skip_on_host(self, found: Tensor) -> bool:
        """One read: True when the step must be skipped (then counted; the caller raises
        :meth:`over_limit`)."""
        if self.scaler is None:
            bad = counted = bool(found)
        else:
            bad, counted = torch.stack([found, self._counted(found)]).tolist()
        if not bad:
            self.streak = 0
            return False
        self.skipped_host += 1
        self.streak += int(counted)
        return True

    def check(self, step: int, first_layer: Callable[[], str | None]) -> int:
        """The total of skipped steps; raises :class:`NonFiniteError` when
        ``max_nonfinite_steps`` skips in a row were reached (on the host path at ``step``; on
        the device path at the step the device recorded: one read)."""
        if self.streak >= self.max_steps:
            raise NonFiniteError(step, first_layer(), self.streak)
        skipped, streak, hit = self._read()
        if hit:
            raise NonFiniteError(hit, first_layer(), max(streak, self.max_steps))
        return self.skipped_host + skipped

    def _read(self) -> list[int]:
        """``[skipped, streak, step at which the limit was hit or 0]`` (one read)."""
        if self._counts is None or self._counts.device.type == "meta":
            return [0, 0, 0]
        skipped, streak, hit = self._counts.tolist()
        return [skipped, streak, _HIT_BASE - hit if hit else 0]

    def total(self) -> int:
        """Skipped steps so far (one read on the device path; never raises)."""
        return self.skipped_host + self._read()[0]

    def set_skipped(self, n: int) -> None:
        """Restart the counts at ``n`` skipped steps (a loaded state)."""
        self.skipped_host, self.streak = int(n), 0
        if self._counts is not None:
            self._counts.zero_()
