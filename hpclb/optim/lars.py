"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017, arXiv 1708.03888).

Per layer, with trust coefficient ``eta``, momentum ``m``, weight decay ``wd``, LR ``lr``::

    ratio = eta * ||w|| / (||g|| + wd * ||w|| + eps)      (1 if ||w|| or ||g|| is 0, or excluded)
    ratio <- min(max(ratio, lo), hi)                       (only with trust_clamp=(lo, hi))
    v    <- m * v + lr * ratio * (g + wd * w)
    w    <- w - v

A layer whose ``||w||`` or ``||g||`` is inf/NaN is left as it was (``w`` and ``v``) and counted in
``nonfinite_layers``; see :mod:`hpclb.optim.base` for that and ``trust_ratios``.

On CUDA with CuPy (:mod:`hpclb.optim.fused`) the whole step is two fused launches for all layers
(norms and ratios, then the update), in the same arithmetic order as :func:`lars_update_`.

The LR sits *inside* the momentum buffer, as in the TF/TPU and MLPerf reference code (torch-style
implementations keep it outside; the two differ whenever the LR changes, i.e. during warmup).
Excluded layers (``ndim < 2`` by default; see :mod:`hpclb.optim.base`) take plain momentum SGD
without weight decay: ``v <- m * v + lr * g``.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.base import LayerwiseOptimizer, check_range, clamp_row, select_
from hpclb.optim.plan import StepPlan
from hpclb.optim.trust import host_to_device, lars_trust_ratios, nan_if_found, unscale_grads_

__all__ = ["lars_update_", "LARS"]


def lars_update_(params: Sequence[Tensor], grads: Sequence[Tensor],
                 momentum_buffers: Sequence[Tensor], step_sizes: Tensor,
                 momentum: Sequence[float], weight_decay: Sequence[float],
                 update: Tensor | None = None) -> None:
    """In place: ``v <- m*v + step_size*(g + wd*w); w <- w - v`` for every layer.

    ``step_sizes``: tensor ``[n]`` (fp32, or fp64 for fp64 models) holding ``lr * ratio`` per
    layer. ``update``: bool ``[n]``; where False the layer's ``w`` and ``v`` stay exactly as they
    were (device-side selects, no host sync). None updates every layer.
    """
    decay = torch._foreach_mul(list(params), list(weight_decay))
    direction = torch._foreach_add(list(grads), decay)
    bufs = list(momentum_buffers)
    if update is None:
        torch._foreach_mul_(direction, step_sizes.unbind())
        torch._foreach_mul_(bufs, list(momentum))
        torch._foreach_add_(bufs, direction)
        torch._foreach_sub_(list(params), bufs)
        return
    torch._foreach_mul_(direction, torch.where(update, step_sizes, 0).unbind())
    new_bufs = [b.clone() for b in bufs]    # the in-place ops of the path above, bit for bit
    torch._foreach_mul_(new_bufs, list(momentum))
    torch._foreach_add_(new_bufs, direction)
    select_(update, bufs, new_bufs)                                  # skipped layers: v kept
    keep = update.to(step_sizes.dtype).unbind()                      # 1, or 0 for skipped
    torch._foreach_sub_(list(params), torch._foreach_mul(bufs, keep))


class LARS(LayerwiseOptimizer):
    """LARS with momentum (algorithm in the module docstring).

    Args:
        params: parameters or parameter groups (named parameters give names in the exclusion log).
            A group may set ``exclude`` (True/False; default None means ``ndim < 2``).
        lr: global LR (>= 0); hpclb's schedules set it each step.
        momentum: in [0, 1). weight_decay: >= 0. trust_coefficient: eta > 0.
        eps: > 0 (and > 0 in float32), added to the ratio's denominator; default 1e-9.
        trust_clamp: None (default, no clamp) or ``(min, max)`` with ``0 <= min < max``: the
            adapted layers' ratios are clamped to it (both paths).
    Parameters may be fp32, fp16, bf16 (norms in fp32) or fp64 (norms in fp64, torch path: the
    fused kernel refuses fp64 and the step falls back, with one warning).
    Raises ValueError naming any out-of-range hyper-parameter; ``step`` raises RuntimeError
    naming a parameter whose gradient is sparse.

    torch's ``_step_supports_amp_scaling`` contract (``GradScaler.step``, and
    :class:`hpclb.DistributedOptimizer`'s non-finite guard): when ``found_inf`` (0-d float
    tensor) is set on the optimizer and > 0, the step leaves every layer's ``w`` and ``v`` as
    they were, decided on the device (no host read); ``grad_scale`` (when not None) divides the
    gradients first.
    """

    _EPS_TYPICAL = "1e-9"
    _step_supports_amp_scaling = True   # honours found_inf / grad_scale (see step)

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9,
                 weight_decay: float = 1e-4, trust_coefficient: float = 0.001, eps: float = 1e-9,
                 trust_clamp: tuple[float, float] | None = None):
        check_range("learning rate", lr, 0.0)
        check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
        check_range("weight_decay", weight_decay, 0.0)
        check_range("trust_coefficient", trust_coefficient, 0.0, lo_open=True)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, exclude=None,
                                      trust_clamp=trust_clamp))

    _STATE_KEYS = ("momentum_buffer",)
    _KIND = "lars"
    #: the group values the plan's lists derive from (a change refills them; the LR is
    #: compared on its own: a schedule changes it every step)
    _HP = ("trust_coefficient", "weight_decay", "eps", "momentum", "trust_clamp")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan()
        if not plan.params:
            return loss
        found_inf = getattr(self, "found_inf", None)
        unscale_grads_(plan.nonempty, getattr(self, "grad_scale", None))
        self._refresh(plan)
        if plan.fused is not None:
            with nan_if_found(plan.heads() if found_inf is not None else [], found_inf):
                res = self._run_fused(plan)
            if res is not None:
                self._record(res.ratio, res.nonfinite, plan.adapt)
                return loss
            plan = self._plan()   # the launch failed: the torch path from now on
            self._refresh(plan)
        self._torch_step(plan, found_inf)
        return loss

    def _torch_step(self, plan: StepPlan, found_inf: Tensor | None) -> None:
        c = plan.cache
        ratios, w_norm, g_norm = lars_trust_ratios(
            plan.params, plan.grads, trust_coefficient=c["trust_coefficient"],
            weight_decay=c["wd"], eps=c["eps"], adapt=plan.adapt, trust_clamp=c["trust_clamp"])
        lrs = host_to_device(c["lr"], ratios.dtype, ratios.device)
        ok = self._finite(w_norm, g_norm)
        if found_inf is not None:   # the whole step masked on the device
            ok &= found_inf.to(ok.device) == 0
        lars_update_(plan.params, plan.grads, plan.tensors["momentum_buffer"], lrs * ratios,
                     c["momentum"], c["wd"], update=ok)
        self._record(ratios, (~ok).sum(dtype=torch.int32), plan.adapt)

    def _init_state(self, params: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)

    def _refresh(self, plan: StepPlan) -> None:
        """Per-layer hyper-parameter lists (torch path) and the kernel's rows, one per group
        (fused path, uploaded), refilled when a group's value changed since the last step (the
        LR, which a schedule changes every step, alone: only its list and the rows)."""
        lrs = [g["lr"] for g in self.param_groups]
        key = [tuple(g[k] for k in self._HP) for g in self.param_groups]
        c = plan.cache
        if key == plan.hp_key and lrs == c.get("group_lr"):
            return
        if key != plan.hp_key:
            plan.hp_key = key
            groups = [self.param_groups[k] for k in plan.group_index]
            for name in ("trust_coefficient", "eps", "momentum", "trust_clamp"):
                c[name] = [g.get(name) for g in groups]
            c["wd"] = [g["weight_decay"] if a else 0.0 for g, a in zip(groups, plan.adapt)]
        c["group_lr"], c["lr"] = lrs, list(map(lrs.__getitem__, plan.group_index))
        if plan.fused is None:
            return
        hp = np.zeros((len(self.param_groups), kernels.HP_WORDS), dtype=np.float32)
        for k, g in enumerate(self.param_groups):
            hp[k, [kernels.HP_LR, kernels.HP_ETA, kernels.HP_WD, kernels.HP_EPS,
                   kernels.HP_BETA1, kernels.HP_TMIN, kernels.HP_TMAX]] = (
                g["lr"], g["trust_coefficient"], g["weight_decay"], g["eps"], g["momentum"],
                *clamp_row(g))
        plan.upload(hp)
