"""LAMB: layer-wise adaptive moments (You et al., ICLR 2020, arXiv 1904.00962, Algorithm 2).

Per layer at step t (1-based), with ``b1, b2, eps, wd`` and LR ``lr``::

    m <- b1 * m + (1 - b1) * g             v <- b2 * v + (1 - b2) * g**2
    m_hat = m / (1 - b1**t)                v_hat = v / (1 - b2**t)
    u = m_hat / (sqrt(v_hat) + eps) + wd * w          (eps > 0: never 0/0, even where g = 0)
    ratio = ||w|| / ||u||                  (1 if either is 0, or the layer is excluded)
    ratio <- min(max(ratio, lo), hi)       (only with trust_clamp=(lo, hi))
    w <- w - lr * ratio * u

A layer whose ``||w||`` or ``||u||`` is inf/NaN keeps ``w``, ``m`` and ``v`` as they were and is
counted in ``nonfinite_layers`` (see :mod:`hpclb.optim.base`).

On CUDA with CuPy (:mod:`hpclb.optim.fused`) the step is two fused launches for all layers: pass 1
forms the new moments and ``u`` on the fly (storing neither) and reduces ||w|| and ||u||; pass 2
recomputes them, stores the moments and applies ``u``, in the arithmetic order of :func:`lamb`,
the torch path's math (torch ``adam.py``'s pattern: :meth:`LAMB.step` gathers, :func:`lamb`
computes).

Weight decay sits in ``u`` (inside the ratio), not in ``g``. Excluded layers (``ndim < 2`` by
default) take the Adam direction without weight decay and ratio 1.
"""
from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import itemgetter, setitem
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
from hpclb.optim.plan import StepPlan, adapted_index
from hpclb.optim.trust import _torch_norms, clamp_bounds

__all__ = ["lamb", "LAMB"]


def lamb(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], hp: dict[str, Any], *, grad_scale: Tensor | None = None,
         found_inf: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One LAMB step of n layers on the torch path, in place (module docstring).

    ``hp`` (:meth:`LAMB._hyper` fills it): ``segments``, ``(start, stop, beta1, beta2, eps)``
    per run of layers of one group and step count, with ``segment_steps``, each segment's
    1-based step count t; ``lr`` (tensor ``[n]`` in the norms' dtype), ``wd`` (n floats),
    ``adapt`` (bool ``[n]``), ``clamp`` (``(lo, hi)`` tensors ``[n]``, or None),
    ``norm_dtype`` (float32, float64, or None for a mix). ``grad_scale`` (0-d, or None)
    divides ``grads`` first; where ``found_inf`` (0-d, or None) is not 0 no layer changes,
    decided on the device. Returns
    ``(ratios [n], nonfinite)``: the trust ratios and how many layers kept ``w``, ``m`` and
    ``v`` (int32 0-d: non-finite ``||w||`` or ``||u||``, or all of them under ``found_inf``).
    """
    if grad_scale is not None:
        unscale_grads_(grads, grad_scale)
    us: list[Tensor] = []
    ms: list[Tensor] = []
    vs: list[Tensor] = []
    for (a, b, beta1, beta2, eps), step in zip(hp["segments"], hp["segment_steps"]):
        m = list(map(Tensor.clone, exp_avgs[a:b]))   # in-place ops on copies: the rounding of
        v = list(map(Tensor.clone, exp_avg_sqs[a:b]))   # in-place updates (not out-of-place's)
        g = grads[a:b]
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        m_hat = torch._foreach_div(m, 1 - beta1 ** step)
        denom = torch._foreach_sqrt(torch._foreach_div(v, 1 - beta2 ** step))
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m_hat, denom)      # u = m_hat / (sqrt(v_hat) + eps) + wd * w
        torch._foreach_add_(u, torch._foreach_mul(params[a:b], hp["wd"][a:b]))
        us += u
        ms += m
        vs += v
    dtype = hp["norm_dtype"]
    if dtype is None:
        w_norm, u_norm = _torch_norms(params), _torch_norms(us)
    else:
        w_norm = torch.stack(torch._foreach_norm(params, 2, dtype=dtype))
        u_norm = torch.stack(torch._foreach_norm(us, 2, dtype=dtype))
    ratios = w_norm / torch.where(u_norm > 0, u_norm, torch.ones_like(u_norm))
    if hp["clamp"] is not None:   # NaN stays NaN, as in the kernel
        ratios = torch.minimum(torch.maximum(ratios, hp["clamp"][0]), hp["clamp"][1])
    use = hp["adapt"] & (w_norm > 0) & (u_norm > 0)
    ratios = torch.where(use, ratios, torch.ones_like(w_norm))
    ok = torch.isfinite(w_norm)
    ok &= torch.isfinite(u_norm)
    if found_inf is not None:   # the whole step masked on the device
        ok &= found_inf.to(ok.device) == 0
    for k, m_old, m_new, v_old, v_new in zip(ok.unbind(), exp_avgs, ms, exp_avg_sqs, vs):
        torch.where(k, m_new, m_old, out=m_old)   # a skipped layer keeps m and v bit for bit
        torch.where(k, v_new, v_old, out=v_old)
    us = list(map(torch.where, ok.unbind(), us, repeat(0)))   # inf/NaN -> 0
    torch._foreach_mul_(us, torch.where(ok, hp["lr"] * ratios, 0).unbind())
    torch._foreach_sub_(params, us)
    return ratios, (~ok).sum(dtype=torch.int32)


class LAMB(LayerwiseOptimizer):
    """LAMB (algorithm in the module docstring).

    Args:
        params: parameters or groups; a group may set ``exclude`` (default None: ``ndim < 2``).
        lr: >= 0. betas: each in [0, 1). weight_decay: >= 0.
        eps: > 0 (and > 0 in float32; default 1e-6): with 0, a zero gradient entry gives 0/0.
        trust_clamp: None (default, no clamp) or ``(min, max)`` with ``0 <= min < max``.
    Parameters may be fp32, fp16, bf16 or fp64 (the moments take the parameter's dtype; norms
    accumulate in fp32, fp64 for fp64; the fused kernel refuses fp64 and the step falls back to
    the torch path with one warning). On the torch path eps must also be > 0 in the parameter's
    dtype (fp16 parameters: eps >= 6e-8).
    Raises ValueError naming any out-of-range hyper-parameter; ``step`` raises RuntimeError
    naming a parameter whose gradient is sparse.

    torch's ``_step_supports_amp_scaling`` contract (``GradScaler.step``, and
    :class:`hpclb.DistributedOptimizer`'s non-finite guard): when ``found_inf`` (0-d float
    tensor) is set on the optimizer and > 0, the step leaves every layer's ``w``, ``m`` and ``v``
    as they were, decided on the device (no host read; the host-side step count ``t`` still
    advances, so the following steps' bias corrections use ``t + 1``); ``grad_scale`` (when not
    None) divides the gradients first. A state whose ``step`` is a tensor (torch Adam's format)
    is read once and kept as an int.
    """

    _step_supports_amp_scaling = True   # honours found_inf / grad_scale

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01,
                 trust_clamp: tuple[float, float] | None = None):
        check_range("learning rate", lr, 0.0)
        check_range("beta1", betas[0], 0.0, 1.0, hi_open=True)
        check_range("beta2", betas[1], 0.0, 1.0, hi_open=True)
        check_range("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, exclude=None,
                                      trust_clamp=trust_clamp))

    _STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _KIND = "lamb"
    #: the group values the plan's lists derive from (a change refills them; the LR, which a
    #: schedule changes every step, is read per step)
    _HP_OF = itemgetter("betas", "eps", "weight_decay", "trust_clamp")

    def _init_state(self, params: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            elif torch.is_tensor(state["step"]):   # torch Adam's format: once, then an int
                state["step"] = int(state["step"].item())

    def _plan_rows(self, plan: StepPlan) -> None:
        """One row per (group, step count), in order of first use (fused path); the torch
        path's segments: per group, its layers of one step count, step counts ascending."""
        steps = [st["step"] for st in plan.states]
        index: dict[tuple[int, int], int] = {}
        for k, step in zip(plan.group_index, steps):
            index.setdefault((k, step), len(index))
        plan.rows = [index[key] for key in zip(plan.group_index, steps)]
        plan.cache.update(steps=steps, row_keys=list(index), advanced=0)
        plan.cache["segments"] = [
            (k, [i for i, (g, s) in enumerate(zip(plan.group_index, steps)) if (g, s) == (k, s0)])
            for k in range(len(self.param_groups))
            for s0 in sorted({s for g, s in zip(plan.group_index, steps) if g == k})]

    def _plan(self) -> StepPlan:
        """The base's plan with every layer's step count + 1 (``state["step"]``); a count that
        is not the one the plan expects (set by hand) rebuilds the plan first."""
        plan = super()._plan()
        if list(map(_STEP, plan.states)) != plan.cache["steps"]:
            plan = self._build(plan.grads_all)
        c = plan.cache
        c["steps"] = list(map((1).__add__, c["steps"]))
        deque(map(setitem, plan.states, repeat("step"), c["steps"]), maxlen=0)   # C-speed loop
        c["advanced"] += 1
        return plan

    def _hyper(self, plan: StepPlan) -> None:
        """Per step: each segment's step count (torch path) or the kernel's rows, uploaded
        (fused path: the bias corrections change); when a group's value changed since the last
        step, the per-layer values (eps checked against the parameters' dtypes)."""
        c = plan.cache
        key = list(map(self._HP_OF, self.param_groups))
        if key != plan.hp_key:
            plan.hp_key = key
            self._layer_hp(plan)
        if plan.fused is not None:
            self._upload_rows(plan)
            return
        lrs = list(map(_LR, self.param_groups))
        if lrs != c.get("group_lr"):
            c["group_lr"] = lrs
            c["lr"] = host_to_device(list(map(lrs.__getitem__, c["layer_group"])),
                                     plan.norm_dtype or torch.float64, plan.device)
        c["segment_steps"] = list(map(c["steps"].__getitem__, c["segment_first"]))

    def _layer_hp(self, plan: StepPlan) -> None:
        """The torch path's per-layer values in segment order (``hp`` of :func:`lamb`; lists
        ``p``, ``g``, ``m``, ``v`` of the layers in that order), refilled when a group's value
        changes."""
        c, order, segments = plan.cache, [], []
        for k, idx in c["segments"]:
            self._check_eps_dtype(self.param_groups[k], [plan.params[i] for i in idx])
            beta1, beta2 = self.param_groups[k]["betas"]
            segments.append((len(order), len(order) + len(idx), beta1, beta2,
                             self.param_groups[k]["eps"]))
            order += idx
        groups = [self.param_groups[plan.group_index[i]] for i in order]
        adapt = [plan.adapt[i] for i in order]
        dtype = plan.norm_dtype or torch.float64
        for name, ts in (("p", plan.params), ("g", plan.grads), ("m", plan.tensors["exp_avg"]),
                         ("v", plan.tensors["exp_avg_sq"])):
            c[name] = [ts[i] for i in order]
        c.update(segments=segments, segment_first=[order[a] for a, *_ in segments],
                 norm_dtype=plan.norm_dtype, layer_group=[plan.group_index[i] for i in order],
                 wd=[g["weight_decay"] if a else 0.0 for g, a in zip(groups, adapt)],
                 adapt=host_to_device(adapt, torch.bool, plan.device),
                 adapted=adapted_index(adapt, plan.device), group_lr=None)
        bounds = clamp_bounds([g.get("trust_clamp") for g in groups], len(groups))
        c["clamp"] = None if bounds is None else \
            tuple(host_to_device(b, dtype, plan.device) for b in bounds)

    def _torch_step(self, plan: StepPlan, grad_scale: Tensor | None,
                    found_inf: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        c = plan.cache
        ratios, nonfinite = lamb(c["p"], c["g"], c["m"], c["v"], c,
                                 grad_scale=grad_scale, found_inf=found_inf)
        return ratios, nonfinite, c["adapted"]

    _eps_checked: set = set()

    def _check_eps_dtype(self, group: dict, params: list[Tensor]) -> None:
        """Raise ValueError when eps rounds to 0 in a parameter's dtype (the torch path adds it
        in that dtype; 0 would allow 0/0)."""
        for dtype in {p.dtype for p in params}:
            key = (group["eps"], dtype)
            if key in self._eps_checked:
                continue
            info = torch.finfo(dtype)   # half the smallest subnormal or less rounds to 0
            eps = float(np.float32(group["eps"])) if dtype == torch.bfloat16 else group["eps"]
            if eps <= info.smallest_normal * info.eps / 2:   # (bf16: via fp32, as torch does)
                raise ValueError(f"Invalid eps: {group['eps']} rounds to 0 in {dtype} (the "
                                 f"parameters' dtype); use eps >= "
                                 f"{torch.finfo(dtype).smallest_normal:.1e} or fp32 parameters")
            self._eps_checked.add(key)

    def _upload_rows(self, plan: StepPlan) -> None:
        """The kernel's rows, one per (group, step count), filled and uploaded (every step: the
        bias corrections change)."""
        hp = np.zeros((len(plan.cache["row_keys"]), kernels.HP_WORDS), dtype=np.float32)
        for k, (gi, built) in enumerate(plan.cache["row_keys"]):
            g, step = self.param_groups[gi], built + plan.cache["advanced"]
            b1, b2 = g["betas"]
            hp[k, _ROW_SLOTS] = (g["lr"], g["weight_decay"], g["eps"], b1, b2, 1 - b1 ** step,
                                 1 - b2 ** step, 1 - b1, 1 - b2, *clamp_row(g))
        plan.upload(hp)


_STEP, _LR = itemgetter("step"), itemgetter("lr")
#: the hyper-parameter slots of a LAMB row, in the order :meth:`LAMB._upload_rows` fills them
_ROW_SLOTS = [kernels.HP_LR, kernels.HP_WD, kernels.HP_EPS, kernels.HP_BETA1, kernels.HP_BETA2,
              kernels.HP_BC1, kernels.HP_BC2, kernels.HP_OMB1, kernels.HP_OMB2, kernels.HP_TMIN,
              kernels.HP_TMAX]
