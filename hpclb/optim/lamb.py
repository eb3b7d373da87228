"""LAMB: layer-wise adaptive moments (You et al., ICLR 2020, arXiv 1904.00962, Algorithm 2).

Per layer at step t (1-based), with ``b1, b2, eps, wd`` and LR ``lr``::

    m <- b1 * m + (1 - b1) * g             v <- b2 * v + (1 - b2) * g**2
    m_hat = m / (1 - b1**t)                v_hat = v / (1 - b2**t)
    u = m_hat / (sqrt(v_hat) + eps) + wd * w
    ratio = ||w|| / ||u||                  (1 if either is 0, or the layer is excluded)
    w <- w - lr * ratio * u

On CUDA with CuPy (:mod:`hpclb.kernels`) the step is two fused launches for all layers: pass 1
updates the moments, forms ``u`` on the fly and reduces ||w|| and ||u||; pass 2 recomputes ``u``
and applies it (``u`` is never stored), in the arithmetic order of :func:`lamb_direction`.

Weight decay sits in ``u`` (inside the ratio), not in ``g``. Excluded layers (``ndim < 2`` by
default) take the Adam direction without weight decay and ratio 1.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from .. import kernels
from .base import LayerwiseOptimizer, check_range
from .trust import fused_backend, lamb_trust_ratios


def lamb_direction(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                   exp_avg_sqs: Sequence[Tensor], *, step: int, beta1: float, beta2: float,
                   eps: float, weight_decay: Sequence[float]) -> list[Tensor]:
    """Update the moments in place and return ``u`` for every layer (new tensors)."""
    torch._foreach_lerp_(list(exp_avgs), list(grads), 1 - beta1)
    torch._foreach_mul_(list(exp_avg_sqs), beta2)
    torch._foreach_addcmul_(list(exp_avg_sqs), list(grads), list(grads), 1 - beta2)
    m_hat = torch._foreach_div(list(exp_avgs), 1 - beta1 ** step)
    denom = torch._foreach_sqrt(torch._foreach_div(list(exp_avg_sqs), 1 - beta2 ** step))
    torch._foreach_add_(denom, eps)
    u = torch._foreach_div(m_hat, denom)
    torch._foreach_add_(u, torch._foreach_mul(list(params), list(weight_decay)))
    return u


class LAMB(LayerwiseOptimizer):
    """LAMB (algorithm in the module docstring).

    Args:
        params: parameters or groups; a group may set ``exclude`` (default None: ``ndim < 2``).
        lr: >= 0. betas: each in [0, 1). eps: >= 0. weight_decay: >= 0.
    Raises ValueError naming any out-of-range hyper-parameter.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01):
        check_range("learning rate", lr, 0.0)
        check_range("beta1", betas[0], 0.0, 1.0, hi_open=True)
        check_range("beta2", betas[1], 0.0, 1.0, hi_open=True)
        check_range("eps", eps, 0.0)
        check_range("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, exclude=None))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
        if self._fused_step():
            return loss
        params, us, adapt, lrs = [], [], [], []
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            beta1, beta2 = group["betas"]
            # One foreach call per distinct step count (all of a group's, unless added late).
            for step in sorted({self.state[p]["step"] for p in ps}):
                same = [p for p in ps if self.state[p]["step"] == step]
                flags = [self.is_adapted(p, group) for p in same]
                us += lamb_direction(
                    same, [p.grad for p in same], [self.state[p]["exp_avg"] for p in same],
                    [self.state[p]["exp_avg_sq"] for p in same], step=step, beta1=beta1,
                    beta2=beta2, eps=group["eps"],
                    weight_decay=[group["weight_decay"] if a else 0.0 for a in flags])
                params += same
                adapt += flags
                lrs += [group["lr"]] * len(same)
        if not params:
            return loss
        ratios, _, _ = lamb_trust_ratios(params, us, adapt=adapt)
        step_sizes = torch.tensor(lrs, dtype=torch.float32, device=ratios.device) * ratios
        torch._foreach_mul_(us, step_sizes.unbind())
        torch._foreach_sub_(params, us)
        return loss

    def _fused_step(self) -> bool:
        """Both passes of the fused kernel (one hyper-parameter row per group and step count);
        False, having done nothing, when the fused path does not serve these tensors."""
        pairs = self._gather()
        if not pairs:
            return False
        params = [p for _, p in pairs]
        grads = [p.grad for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        fused = fused_backend(params, grads, m, v)
        if fused is None:
            return False
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
                   kernels.HP_OMB2]] = (g["lr"], g["weight_decay"], g["eps"], b1, b2,
                                        1 - b1 ** step, 1 - b2 ** step, 1 - b1, 1 - b2)
        fused.lamb_step(params, grads, m, v, hp,
                        [index[(id(g), self.state[p]["step"])] for g, p in pairs], adapt)
        return True
