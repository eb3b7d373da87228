"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017, arXiv 1708.03888).

Per layer, with trust coefficient ``eta``, momentum ``m``, weight decay ``wd``, LR ``lr``::

    ratio = eta * ||w|| / (||g|| + wd * ||w|| + eps)      (1 if ||w|| or ||g|| is 0, or excluded)
    ratio <- min(max(ratio, lo), hi)                       (only with trust_clamp=(lo, hi))
    v    <- m * v + lr * ratio * (g + wd * w)
    w    <- w - v

A layer whose ``||w||`` or ``||g||`` is inf/NaN is left as it was (``w`` and ``v``) and counted in
``nonfinite_layers``; see :mod:`hpclb.optim.base` for that and ``trust_ratios``.

On CUDA with CuPy (:mod:`hpclb.optim.fused`) the whole step is two fused launches for all layers
(norms and ratios, then the update), in the same arithmetic order as :func:`lars`, the torch
path's math (torch ``adam.py``'s pattern: :meth:`LARS.step` gathers, :func:`lars` computes).

The LR sits *inside* the momentum buffer, as in the TF/TPU and MLPerf reference code (torch-style
implementations keep it outside; the two differ whenever the LR changes, i.e. during warmup).
Excluded layers (``ndim < 2`` by default; see :mod:`hpclb.optim.base`) take plain momentum SGD
without weight decay: ``v <- m * v + lr * g``.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.base import (
    LayerwiseOptimizer,
    check_range,
    clamp_row,
    host_to_device,
    unscale_grads_,
)
from hpclb.optim.plan import StepPlan
from hpclb.optim.trust import _torch_norms, clamp_bounds

__all__ = ["lars", "LARS"]


def lars(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
         hp: dict[str, Any], *, grad_scale: Tensor | None = None,
         found_inf: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One LARS step of n layers on the torch path, in place (module docstring).

    ``hp``: the per-layer hyper-parameters (:meth:`LARS._hyper` fills them when a group's value
    changes): ``lr``, ``eta``, ``wd_t``, ``eps`` (tensors ``[n]`` in the norms' dtype on the
    layers' device), ``wd`` and ``momentum`` (n floats), ``adapt`` (bool ``[n]``), ``clamp``
    (``(lo, hi)`` tensors ``[n]``, or None) and ``norm_dtype`` (float32, float64, or None for
    a mix of fp64 and narrower layers). ``grad_scale`` (0-d, or None) divides ``grads`` first;
    where ``found_inf`` (0-d, or None) is not 0 no layer changes, decided on the device.
    Returns ``(ratios [n], nonfinite)``: the trust ratios and how many layers were left as
    they were (int32 0-d: non-finite ``||w||`` or ``||g||``, or all of them under
    ``found_inf``).
    """
    if grad_scale is not None:
        unscale_grads_(grads, grad_scale)
    dtype = hp["norm_dtype"]
    if dtype is None:
        w_norm, g_norm = _torch_norms(params), _torch_norms(grads)
    else:
        w_norm = torch.stack(torch._foreach_norm(params, 2, dtype=dtype))
        g_norm = torch.stack(torch._foreach_norm(grads, 2, dtype=dtype))
    den = g_norm + hp["wd_t"] * w_norm + hp["eps"]
    ratios = hp["eta"] * w_norm / torch.where(den > 0, den, torch.ones_like(den))
    if hp["clamp"] is not None:   # NaN stays NaN, as in the kernel
        ratios = torch.minimum(torch.maximum(ratios, hp["clamp"][0]), hp["clamp"][1])
    use = hp["adapt"] & (w_norm > 0) & (g_norm > 0)
    ratios = torch.where(use, ratios, torch.ones_like(w_norm))
    ok = torch.isfinite(w_norm)
    ok &= torch.isfinite(g_norm)
    if found_inf is not None:   # the whole step masked on the device
        ok &= found_inf.to(ok.device) == 0
    # v <- m*v + step*(g + wd*w); w <- w - v, where ok; elsewhere w and v kept bit for bit
    direction = torch._foreach_add(grads, torch._foreach_mul(params, hp["wd"]))
    torch._foreach_mul_(direction, torch.where(ok, hp["lr"] * ratios, 0).unbind())
    new_bufs = list(map(Tensor.clone, momentum_buffers))   # the in-place ops' rounding
    torch._foreach_mul_(new_bufs, hp["momentum"])
    torch._foreach_add_(new_bufs, direction)
    for k, old, new in zip(ok.unbind(), momentum_buffers, new_bufs):
        torch.where(k, new, old, out=old)
    keep = ok.to(ratios.dtype).unbind()                      # 1, or 0 for a skipped layer
    torch._foreach_sub_(params, torch._foreach_mul(momentum_buffers, keep))
    return ratios, (~ok).sum(dtype=torch.int32)


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
    _HP_OF = itemgetter("trust_coefficient", "weight_decay", "eps", "momentum", "trust_clamp")

    def _torch_step(self, plan: StepPlan, grad_scale: Tensor | None,
                    found_inf: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        ratios, nonfinite = lars(plan.params, plan.grads, plan.tensors["momentum_buffer"],
                                 plan.cache, grad_scale=grad_scale, found_inf=found_inf)
        return ratios, nonfinite, plan.adapted

    def _init_state(self, params: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)

    def _hyper(self, plan: StepPlan) -> None:
        """The torch path's per-layer hyper-parameters (``plan.cache``, the ``hp`` of
        :func:`lars`) and the kernel's rows, one per group (fused path, uploaded), refilled
        when a group's value changed since the last step (the LR, which a schedule changes
        every step, alone: only its vector and the rows)."""
        lrs = list(map(_LR, self.param_groups))
        key = list(map(self._HP_OF, self.param_groups))
        c = plan.cache
        if key == plan.hp_key and lrs == c.get("group_lr"):
            return
        dtype = plan.norm_dtype or torch.float64   # the norms' dtype
        if key != plan.hp_key:
            plan.hp_key = key
            self._layer_hp(plan, dtype)
        c["group_lr"] = lrs
        c["lr"] = host_to_device(list(map(lrs.__getitem__, plan.group_index)), dtype, plan.device)
        if plan.fused is None:
            return
        hp = np.zeros((len(self.param_groups), kernels.HP_WORDS), dtype=np.float32)
        for k, g in enumerate(self.param_groups):
            hp[k, [kernels.HP_LR, kernels.HP_ETA, kernels.HP_WD, kernels.HP_EPS,
                   kernels.HP_BETA1, kernels.HP_TMIN, kernels.HP_TMAX]] = (
                g["lr"], g["trust_coefficient"], g["weight_decay"], g["eps"], g["momentum"],
                *clamp_row(g))
        plan.upload(hp)

    def _layer_hp(self, plan: StepPlan, dtype: torch.dtype) -> None:
        """The per-layer values that change only with a group's hyper-parameters."""
        c, groups = plan.cache, [self.param_groups[k] for k in plan.group_index]
        c["norm_dtype"] = plan.norm_dtype
        c["momentum"] = [g["momentum"] for g in groups]
        c["wd"] = [g["weight_decay"] if a else 0.0 for g, a in zip(groups, plan.adapt)]
        for name, values in (("eta", [g["trust_coefficient"] for g in groups]),
                             ("wd_t", c["wd"]), ("eps", [g["eps"] for g in groups])):
            c[name] = host_to_device(values, dtype, plan.device)
        c["adapt"] = host_to_device(plan.adapt, torch.bool, plan.device)
        bounds = clamp_bounds([g.get("trust_clamp") for g in groups], len(groups))
        c["clamp"] = None if bounds is None else \
            tuple(host_to_device(b, dtype, plan.device) for b in bounds)


_LR = itemgetter("lr")
