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

from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.base import LayerwiseOptimizer, check_range, clamp_row, select_
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = self._gather()
        if not pairs:
            return loss
        for _, p in pairs:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            elif torch.is_tensor(state["step"]):   # torch Adam's format: once, then an int
                state["step"] = int(state["step"].item())
            state["step"] += 1
        params = [p for _, p in pairs]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        found_inf = getattr(self, "found_inf", None)
        unscale_grads_([p.grad for p in params], getattr(self, "grad_scale", None))
        fused = self._fused_for(pairs, params, [p.grad for p in params], m, v)
        if fused is not None:
            with nan_if_found([p.grad for p in params], found_inf):
                self._fused_step(fused, pairs, m, v)
        else:
            self._torch_step(pairs, found_inf)
        return loss

    def _torch_step(self, pairs: list[tuple[dict, Tensor]], found_inf: Tensor | None) -> None:
        """The step with torch._foreach ops; layers grouped by (group, step count); nothing
        changes where ``found_inf`` > 0."""
        params, us, ms, vs, m_new, v_new, adapt, lrs, clamps = ([] for _ in range(9))
        for group in self.param_groups:
            ps = [p for g, p in pairs if g is group]
            if ps:
                self._check_eps_dtype(group, ps)
            beta1, beta2 = group["betas"]
            # One foreach call per distinct step count (all of a group's, unless added late).
            for step in sorted({self.state[p]["step"] for p in ps}):
                same = [p for p in ps if self.state[p]["step"] == step]
                flags = [self.is_adapted(p, group) for p in same]
                m, v = [self.state[p]["exp_avg"] for p in same], \
                    [self.state[p]["exp_avg_sq"] for p in same]
                u, mn, vn = lamb_direction(
                    same, [p.grad for p in same], m, v, step=step, beta1=beta1, beta2=beta2,
                    eps=group["eps"],
                    weight_decay=[group["weight_decay"] if a else 0.0 for a in flags])
                for acc, part in ((params, same), (us, u), (ms, m), (vs, v), (m_new, mn),
                                  (v_new, vn), (adapt, flags)):
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

    def _fused_step(self, fused: kernels.FusedTrust, pairs: list[tuple[dict, Tensor]],
                    m: list[Tensor], v: list[Tensor]) -> None:
        """Both passes of the fused kernel (one hyper-parameter row per group and step count)."""
        params = [p for _, p in pairs]
        grads = [p.grad for p in params]
        rows, index, adapt = [], {}, []
        for group, p in pairs:
            key = (id(group), self.state[p]["step"])
            if key not in index:
                index[key] = len(index)
                rows.append((group, self.state[p]["step"]))
            adapt.append(self.is_adapted(p, group))
        hp = np.zeros((len(rows), kernels.HP_WORDS), dtype=np.float32)
        for k, (g, step) in enumerate(rows):
            b1, b2 = g["betas"]
            hp[k, [kernels.HP_LR, kernels.HP_WD, kernels.HP_EPS, kernels.HP_BETA1,
                   kernels.HP_BETA2, kernels.HP_BC1, kernels.HP_BC2, kernels.HP_OMB1,
                   kernels.HP_OMB2, kernels.HP_TMIN, kernels.HP_TMAX]] = (
                g["lr"], g["weight_decay"], g["eps"], b1, b2, 1 - b1 ** step, 1 - b2 ** step,
                1 - b1, 1 - b2, *clamp_row(g))
        res = fused.lamb_step(params, grads, m, v, hp,
                              [index[(id(g), self.state[p]["step"])] for g, p in pairs], adapt)
        self._record(res.ratio, res.nonfinite, adapt)
