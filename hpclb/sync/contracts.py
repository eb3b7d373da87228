"""The contracts :class:`~hpclb.sync.optimizer.DistributedOptimizer` keeps for torch.optim, DDP
and Horovod users (``docs/library.md``), each checked where it can break:

- **DDP's gradient contract** (kept by :class:`~hpclb.sync.gradients.GradientSync`): when the
  window's last ``backward()`` returns, every ``p.grad`` is the global mean, so
  ``clip_grad_norm_`` or a norm logged there is DDP's; Horovod's ``synchronize()`` then only
  takes the window.
- **zero_grad() in an accumulation window** (:func:`zero_grad_action`): a no-op inside a
  window of hpclb's loop (the gradients accumulate until the window's last ``step()``), zeroes
  after every ``step()`` that ended a window (in Horovod's loop, every ``step()``: the window
  count re-aligns there, :mod:`hpclb.sync.window`), an error between a ``backward()`` and its
  ``step()`` (it would drop that micro-batch).
- **The parameter set** (:func:`check_parameter_set`, :func:`drop_frozen_grads`): a parameter that
  became trainable, or was added with ``add_param_group``, after the optimizer was built is
  refused at the next ``step()`` (its gradient would stay local) until
  ``DistributedOptimizer.refresh_parameters()``; a parameter frozen at the step
  (``requires_grad=False``) gets ``grad = None``, so momentum, weight decay and moments leave it,
  as in plain torch.
"""
from __future__ import annotations

import operator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["SynchronizeMixin", "check_parameter_set", "drop_frozen_grads", "drop_unused",
           "zero_grad_action"]

_requires_grad = operator.attrgetter("requires_grad")


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


def zero_grad_action(sync) -> bool:
    """True when ``zero_grad()`` should zero now: at the start of an accumulation window, i.e.
    after every ``step()`` that ended one (with ``accumulation_steps=1``: always, as in torch;
    the gradients are final once backward returns). False (a no-op) inside a window of hpclb's
    loop (``step()`` after every backward, which returned False). Raises RuntimeError with
    ``accumulation_steps`` > 1 when a backward ended since the last ``step()`` (zeroing would
    silently drop that micro-batch, or the whole reduced window, from the update)."""
    if sync.accumulation_steps > 1 and sync.backward_pending:
        raise RuntimeError(
            "zero_grad() between backward() and step() with accumulation_steps="
            f"{sync.accumulation_steps}: it would drop this micro-batch's gradients from the "
            "window. Call step() after every backward(), and zero_grad() before backward()")
    return sync.micro_batches == 0


def check_parameter_set(optimizer: torch.optim.Optimizer, synced: set[int],
                        names: dict[int, str]) -> None:
    """Raise RuntimeError when ``optimizer`` holds a trainable parameter whose id is not in
    ``synced`` (unfrozen or added after the DistributedOptimizer was built), naming it and the
    fix. ``names``: id -> parameter name, for the message."""
    groups = optimizer.param_groups
    if all(all(map(synced.__contains__, map(id, g["params"]))) for g in groups):
        return  # every parameter is synchronised (one C-level pass: the check of every step)
    for gi, group in enumerate(groups):
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
    if all(map(_requires_grad, params)):
        return  # none frozen (one C-level pass: the check of every step)
    for p in params:
        if not p.requires_grad:
            p.grad = None


class SynchronizeMixin:
    """Horovod's ``synchronize()`` / ``skip_synchronize()`` and the parameter-set changes of
    :class:`~hpclb.sync.optimizer.DistributedOptimizer` (which provides ``sync``, ``optimizer``,
    ``params``, ``names``, ``comm`` and ``_build_sync``)."""

    _synchronized: bool | None = None  # the result of synchronize() not yet used by step()

    def synchronize(self) -> bool:
        """Horovod's ``synchronize()``. The gradients are already averaged when the window's
        last ``backward()`` returns (DDP's contract), so this only checks the parameter set and
        takes the window (in Horovod's loop a short one, fewer passes than
        ``accumulation_steps``, is reduced here: :mod:`hpclb.sync.window`): afterwards
        ``p.grad`` may be read, clipped or changed before ``step()``, which then does not
        synchronise again. Returns False on a micro-batch of hpclb's loop that is not the
        window's last (the gradients are still local). Raises RuntimeError for a
        parameter set that changed, or a backward under ``no_sync()`` with none after it."""
        if self._synchronized is not None:
            raise RuntimeError("synchronize() was already called for this step; call step()")
        try:
            check_parameter_set(self.optimizer, self._synced_ids, self._names_by_id)
        except RuntimeError:
            self.sync.synchronize()  # take this window on every rank, then refuse
            raise
        self._synchronized = self.sync.synchronize()
        if self._synchronized:
            drop_frozen_grads(self.params)
            if self.find_unused_parameters:
                drop_unused(self.sync.used_in_window, self.comm)
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
        self._sync_kwargs["step_after"] = self.sync.step_after  # the loop, once recognised
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
