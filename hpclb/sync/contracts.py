"""The contracts :class:`~hpclb.sync.optimizer.DistributedOptimizer` keeps for torch.optim, DDP
and Horovod users (``docs/library.md``), each checked where it can break:

- **Gradients are not touched in flight** (:class:`GradGuard`): between ``backward()`` and
  ``step()`` a rank's ``p.grad`` is its local gradient (or, with ``overlap="thread"``, a buffer
  MPI is reducing). An in-place change there (the DDP idiom ``clip_grad_norm_(...); step()``)
  would clip the wrong gradient or race the allreduce, so ``step()`` refuses it, naming the fixes
  (``grad_clip_norm=``, or ``synchronize()`` first as in Horovod).
- **zero_grad() in an accumulation window** (:func:`zero_grad_action`): a no-op inside the
  window (the gradients accumulate until the window's last ``step()``), an error between
  ``backward()`` and ``step()`` while gradients are in flight.
- **The parameter set** (:func:`check_parameter_set`, :func:`drop_frozen_grads`): a parameter that
  became trainable, or was added with ``add_param_group``, after the optimizer was built is
  refused at the next ``step()`` (its gradient would stay local) until
  ``DistributedOptimizer.refresh_parameters()``; a parameter frozen at the step
  (``requires_grad=False``) gets ``grad = None``, so momentum, weight decay and moments leave it,
  as in plain torch.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["GradGuard", "GradientsTouchedError", "SynchronizeMixin", "check_parameter_set",
           "drop_frozen_grads", "zero_grad_action"]


class GradientsTouchedError(RuntimeError):
    """``p.grad`` was changed in place between ``backward()`` and ``step()``."""


class GradGuard:
    """Detects in-place changes to ``p.grad`` after ``backward()`` wrote it.

    A post-accumulate-grad hook per parameter (after GradientSync's own) makes ``p.grad`` an
    alias of its bucket view with a version counter of its own (``view.data``: same memory, so
    nothing is copied; the allreduce's own writes to the bucket do not count) and records that
    counter, which torch bumps on every in-place write through ``p.grad``. :meth:`check`
    compares: a gradient written since backward's last write was changed by the user. Reads are
    invisible (read ``p.grad`` after ``synchronize()``). Active when the local gradient is not
    the final one: world size > 1 or accumulation > 1.
    """

    def __init__(self, sync, active: bool, track_used: bool = False):
        self.sync = sync
        self.active = active
        self._versions: dict[int, tuple[nn.Parameter, str, torch.Tensor, int]] = {}
        self.used: set[int] = set()  # ids of parameters with a gradient in this window
        self._hooks = []
        if not (active or track_used):
            return
        for b in sync.buckets:
            for p, name in zip(b.params, b.names):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(p) -> None:
            self.used.add(id(p))
            if not self.active:
                return
            g = p.grad
            if g is not None and g._base is not None:  # the bucket view: alias it
                p.grad = g = g.data
            self._versions[id(p)] = (p, name, g, g._version if g is not None else -1)
        return hook

    def check(self) -> None:
        """Raise :class:`GradientsTouchedError` naming the first changed gradient and the fixes
        when a gradient was written after backward's last write to it."""
        for p, name, g, version in self._versions.values():
            if p.grad is not g or (g is not None and g._version != version):
                self.clear()
                raise GradientsTouchedError(
                    f"the gradient of {name} was changed between backward() and step(); "
                    f"before step() p.grad is this rank's local gradient (or a buffer the "
                    f"allreduce is still reducing), so e.g. clip_grad_norm_ there clips the "
                    f"wrong gradient and the replicas diverge. Use "
                    f"DistributedOptimizer(..., grad_clip_norm=c), or call "
                    f"optimizer.synchronize() first (then p.grad is the average over ranks) "
                    f"and optimizer.step() after")
        self.clear()

    @property
    def backward_pending(self) -> bool:
        """A backward wrote gradients since the last ``step()`` or ``zero_grad()``."""
        return bool(self._versions)

    def clear(self) -> None:
        """Forget the recorded versions (after a step, after ``zero_grad()``)."""
        self._versions.clear()

    def drop_unused(self, params: list[nn.Parameter], comm) -> None:
        """After a window's allreduce: ``grad = None`` for every parameter that got no gradient
        on any rank in the window (one allreduce (max) of a flag per parameter), as DDP's
        ``find_unused_parameters`` leaves them; then start a new window."""
        flags = torch.tensor([id(p) in self.used for p in params], dtype=torch.uint8)
        if comm.world_size > 1 and len(flags):
            comm.allreduce_(flags, op="max")
        for p, used in zip(params, flags.tolist()):
            if not used:
                p.grad = None
        self.used.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.clear()


def zero_grad_action(sync, micro_batches: int, backward_pending: bool = False) -> bool:
    """True when ``zero_grad()`` should zero now: at the start of an accumulation window.
    False (a no-op) inside a window (``micro_batches`` of ``sync.accumulation_steps`` done).
    Raises RuntimeError when backward has already started this window's allreduce (gradients
    in flight: zeroing would race it or lose this micro-batch), and with
    ``accumulation_steps`` > 1 whenever a backward ran since the last ``step()`` (zeroing would
    silently drop that micro-batch from the window; ``backward_pending``: the GradGuard saw a
    backward since the last ``step()``)."""
    if sync.comm.world_size > 1 and micro_batches == sync.accumulation_steps - 1 and \
            any(any(b.ready) for b in sync.buckets):
        raise RuntimeError(
            "zero_grad() between backward() and step(): this backward's gradients are in flight "
            "(the allreduce has started). Call zero_grad() before backward(), or after step()")
    if sync.accumulation_steps > 1 and backward_pending:
        raise RuntimeError(
            "zero_grad() between backward() and step() with accumulation_steps="
            f"{sync.accumulation_steps}: it would drop this micro-batch's gradients from the "
            "window. Call step() after every backward(), and zero_grad() before backward()")
    return micro_batches == 0


def check_parameter_set(optimizer: torch.optim.Optimizer, synced: set[int],
                        names: dict[int, str]) -> None:
    """Raise RuntimeError when ``optimizer`` holds a trainable parameter whose id is not in
    ``synced`` (unfrozen or added after the DistributedOptimizer was built), naming it and the
    fix. ``names``: id -> parameter name, for the message."""
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
    backward that reaches the parameter makes its gradient the bucket view again."""
    for p in params:
        if not p.requires_grad:
            p.grad = None


class SynchronizeMixin:
    """Horovod's ``synchronize()`` / ``skip_synchronize()`` and the parameter-set changes of
    :class:`~hpclb.sync.optimizer.DistributedOptimizer` (which provides ``sync``, ``optimizer``,
    ``params``, ``names``, ``comm`` and ``_build_sync``)."""

    _synchronized: bool | None = None  # the result of synchronize() not yet used by step()

    def synchronize(self) -> bool:
        """Wait for the gradient allreduce now: afterwards every rank's ``p.grad`` is the average
        over ranks (and the accumulation window), so it may be read, clipped or changed before
        ``step()``, which then does not synchronise again (as Horovod's ``synchronize()``).
        Returns False on a micro-batch that is not the window's last (nothing was reduced; the
        gradients are still local). Raises :class:`GradientsTouchedError` when ``p.grad`` was
        changed in place since ``backward()``, RuntimeError for a parameter set that changed."""
        if self._synchronized is not None:
            raise RuntimeError("synchronize() was already called for this step; call step()")
        try:
            check_parameter_set(self.optimizer, {id(p) for p in self.params},
                                self._names_by_id)
            self._guard.check()
        except RuntimeError:
            self.sync.synchronize()  # finish this step's collectives on every rank, then refuse
            raise
        t0 = time.perf_counter()
        self._synchronized = self.sync.synchronize()
        self.sync_wait_s += time.perf_counter() - t0
        if self._synchronized:
            drop_frozen_grads(self.params)
            if self.find_unused_parameters:
                self._guard.drop_unused(self.params, self.comm)
        return self._synchronized

    def _take_synchronized(self) -> bool:
        """step(): the result of an earlier :meth:`synchronize`, else synchronise now."""
        if self._synchronized is None:
            self.synchronize()
        synced, self._synchronized = self._synchronized, None
        return synced

    @contextmanager
    def skip_synchronize(self):
        """Horovod's idiom: ``opt.synchronize(); clip...; with opt.skip_synchronize():
        opt.step()``. ``step()`` never synchronises twice, so this only checks that
        ``synchronize()`` was called (RuntimeError naming the fix otherwise)."""
        if self._synchronized is None:
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
        self._guard.close()
        self.sync.close()
        self._build_sync()

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group`` on the wrapped optimizer, then
        :meth:`refresh_parameters` (collective: every rank adds the same group)."""
        self.optimizer.add_param_group(param_group)
        self.refresh_parameters()
