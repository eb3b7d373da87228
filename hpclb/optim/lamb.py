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
recomputes them, stores the moments and applies ``u``, in the arithmetic order of
:func:`lamb_direction`.

Weight decay sits in ``u`` (inside the ratio), not in ``g``. Excluded layers (``ndim < 2`` by
default) take the Adam direction without weight decay and ratio 1.
"""
from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import itemgetter, setitem
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.base import LayerwiseOptimizer, check_range, clamp_row, select_
from hpclb.optim.plan import StepPlan
from hpclb.optim.trust import host_to_device, lamb_trust_ratios, nan_if_found, unscale_grads_

__all__ = ["lamb_direction", "LAMB"]


def lamb_direction(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], *, step: int, beta1: float, beta2: float,
                   eps: float, weight_decay: Sequence[float]
                   ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """``(u, m_new, v_new)`` for every layer, all new tensors (the moments are not touched);
    ``step`` is the 1-based step count t of the bias corrections."""
    m = [t.clone() for t in exp_avgs]   # in-place ops on copies: the rounding of in-place
    v = [t.clone() for t in exp_avg_sqs]   # updates, bit for bit (out-of-place differ in bf16)
    torch._foreach_lerp_(m, list(grads), 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, list(grads), list(grads), 1 - beta2)
    m_hat = torch._foreach_div(m, 1 - beta1 ** step)
    denom = torch._foreach_sqrt(torch._foreach_div(v, 1 - beta2 ** step))
    torch._foreach_add_(denom, eps)
    u = torch._foreach_div(m_hat, denom)
    torch._foreach_add_(u, torch._foreach_mul(list(params), list(weight_decay)))
    return u, m, v



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
    _HP = ("betas", "eps", "weight_decay", "trust_clamp")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan()
        if not plan.params:
            return loss
        plan = self._advance(plan)
        found_inf = getattr(self, "found_inf", None)
        unscale_grads_(plan.nonempty, getattr(self, "grad_scale", None))
        self._refresh(plan)
        if plan.fused is not None:
            self._upload_rows(plan)
            with nan_if_found(plan.heads() if found_inf is not None else [], found_inf):
                res = self._run_fused(plan)
            if res is not None:
                self._record(res.ratio, res.nonfinite, plan.adapt)
                return loss
            plan = self._plan()   # the launch failed: the torch path from now on
            self._refresh(plan)
        self._torch_step(plan, found_inf)
        return loss

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
        plan.cache["steps"], plan.cache["row_keys"] = steps, list(index)
        plan.cache["segments"] = [
            (k, [i for i, (g, s) in enumerate(zip(plan.group_index, steps)) if (g, s) == (k, s0)])
            for k in range(len(self.param_groups))
            for s0 in sorted({s for g, s in zip(plan.group_index, steps) if g == k})]

    def _advance(self, plan: StepPlan) -> StepPlan:
        """Every layer's step count + 1 (``state["step"]``); a count that is not the one the plan
        expects (set by hand) rebuilds the plan first."""
        if list(map(_STEP, plan.states)) != plan.cache["steps"]:
            self._step_plan = None
            plan = self._plan()
        new = list(map((1).__add__, plan.cache["steps"]))
        deque(map(setitem, plan.states, repeat("step"), new), maxlen=0)   # C-speed loop
        plan.cache["steps"] = new
        plan.cache["row_keys"] = [(k, s + 1) for k, s in plan.cache["row_keys"]]
        return plan

    def _refresh(self, plan: StepPlan) -> None:
        """Checks eps against the parameters' dtypes and refills the per-layer weight decay,
        when a group's value changed since the last step."""
        key = [tuple(g[k] for k in self._HP) for g in self.param_groups]
        if key == plan.hp_key:
            return
        plan.hp_key = key
        for k, idx in plan.cache["segments"]:
            self._check_eps_dtype(self.param_groups[k], [plan.params[i] for i in idx])
        groups = [self.param_groups[k] for k in plan.group_index]
        plan.cache["wd"] = [g["weight_decay"] if a else 0.0 for g, a in zip(groups, plan.adapt)]

    def _torch_step(self, plan: StepPlan, found_inf: Tensor | None) -> None:
        """The step with torch._foreach ops; layers in the plan's segments (group, step count);
        nothing changes where ``found_inf`` > 0."""
        params, us, ms, vs, m_new, v_new, adapt, lrs, clamps = ([] for _ in range(9))
        m_all, v_all, wd_all = plan.tensors["exp_avg"], plan.tensors["exp_avg_sq"], \
            plan.cache["wd"]
        for k, idx in plan.cache["segments"]:
            group = self.param_groups[k]
            beta1, beta2 = group["betas"]
            same = [plan.params[i] for i in idx]
            m, v = [m_all[i] for i in idx], [v_all[i] for i in idx]
            u, mn, vn = lamb_direction(
                same, [plan.grads[i] for i in idx], m, v,
                step=plan.cache["steps"][idx[0]], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=[wd_all[i] for i in idx])
            for acc, part in ((params, same), (us, u), (ms, m), (vs, v), (m_new, mn),
                              (v_new, vn), (adapt, [plan.adapt[i] for i in idx])):
                acc += part
            lrs += [group["lr"]] * len(same)
            clamps += [group.get("trust_clamp")] * len(same)
        ratios, w_norm, u_norm = lamb_trust_ratios(params, us, adapt=adapt, trust_clamp=clamps)
        ok = self._finite(w_norm, u_norm)
        if found_inf is not None:   # the whole step masked on the device
            ok &= found_inf.to(ok.device) == 0
        select_(ok, ms, m_new)
        select_(ok, vs, v_new)
        step_sizes = host_to_device(lrs, ratios.dtype, ratios.device) * ratios
        us = [torch.where(k, u, 0) for k, u in zip(ok.unbind(), us)]   # inf/NaN -> 0
        torch._foreach_mul_(us, torch.where(ok, step_sizes, 0).unbind())
        torch._foreach_sub_(params, us)
        self._record(ratios, (~ok).sum(dtype=torch.int32), adapt)

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
        for k, (gi, step) in enumerate(plan.cache["row_keys"]):
            g = self.param_groups[gi]
            b1, b2 = g["betas"]
            hp[k, _ROW_SLOTS] = (g["lr"], g["weight_decay"], g["eps"], b1, b2, 1 - b1 ** step,
                                 1 - b2 ** step, 1 - b1, 1 - b2, *clamp_row(g))
        plan.upload(hp)


_STEP = itemgetter("step")
#: the hyper-parameter slots of a LAMB row, in the order :meth:`LAMB._upload_rows` fills them
_ROW_SLOTS = [kernels.HP_LR, kernels.HP_WD, kernels.HP_EPS, kernels.HP_BETA1, kernels.HP_BETA2,
              kernels.HP_BC1, kernels.HP_BC2, kernels.HP_OMB1, kernels.HP_OMB2, kernels.HP_TMIN,
              kernels.HP_TMAX]
