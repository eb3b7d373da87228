"""Per-layer norms and trust ratios for every layer in one call.

One spec, several implementations that must agree (a float64 NumPy reference in the tests, this
torch path on CPU/GPU, and the fused CUDA kernel of ``kernels/`` behind the same functions).
Formulas (DESIGN.md; You, Gitman, Ginsburg 2017 for LARS; You et al. ICLR 2020 for LAMB):

- LARS: ``ratio = eta * ||w|| / (||g|| + wd * ||w|| + eps)``
- LAMB: ``ratio = ||w|| / ||u||`` with ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``

A layer whose ``||w||`` or ``||g||`` (``||u||``) is 0 gets ratio 1, and so does a layer that is
excluded from adaptation (``adapt`` False). Norms accumulate in fp32 whatever the input dtype
(fp32, fp16, bf16); results are fp32 tensors of shape ``[n_layers]`` on the tensors' device, so
nothing synchronises with the host per layer.

Backends (:func:`backend_for`): ``"cupy"``, the fused kernel of ``kernels/trust_ratio.cu``
(:mod:`hpclb.kernels`: one launch for all layers), is chosen automatically for CUDA tensors when
CuPy imports; ``"torch"`` (two ``torch._foreach_norm`` calls) everywhere else, and for inputs the
kernel does not take (non-contiguous tensors keep the torch path; dtypes other than
fp32/fp16/bf16). ``HPCLB_TRUST_BACKEND=torch`` forces the torch path. The choice is logged once
per process and backend.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor

from .. import kernels

log = logging.getLogger(__name__)
_announced: set[str] = set()


def backend_for(tensors: Sequence[Tensor]) -> str:
    """The implementation that serves ``tensors``: ``"cupy"`` (fused kernel) for CUDA tensors
    when CuPy imports, ``"torch"`` otherwise (or under ``HPCLB_TRUST_BACKEND=torch``; a test may
    install another launcher, whose name is returned). Logs the choice once per process."""
    device = tensors[0].device if tensors else torch.device("cpu")
    fused = kernels.fused_for(device) if tensors else None
    name = "torch" if fused is None else fused.launcher.name
    if name not in _announced:
        _announced.add(name)
        log.info("trust ratios: backend %s on %s", name, device)
    return name


def fused_backend(*lists: Sequence[Tensor | None]) -> kernels.FusedTrust | None:
    """The fused implementation (:class:`hpclb.kernels.FusedTrust`) that can take all of
    ``lists`` (layer-aligned tensor lists, the first non-empty), or None for the torch path."""
    first = lists[0]
    if not first or backend_for(first) == "torch":
        return None
    fused = kernels.fused_for(first[0].device)
    return fused if fused is not None and fused.supports(*lists) else None


@torch.no_grad()
def layer_norms(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of each tensor, accumulated in fp32.

    Args: ``tensors``, n tensors of any shape/size (an empty tensor has norm 0), fp32/fp16/bf16,
    all on one device. Returns an fp32 tensor of shape ``[n]`` on that device (``[0]`` if n = 0).
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    fused = fused_backend(tensors)
    if fused is not None:
        return fused.norms(tensors)
    return _torch_norms(tensors)


def _torch_norms(tensors: Sequence[Tensor]) -> Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))


def _as_layer_vector(x: float | Sequence[float] | Tensor, n: int, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=like.device).expand(n)


def _ratio(numerator: Tensor, w_norm: Tensor, other_norm: Tensor, adapt: Tensor) -> Tensor:
    """``numerator`` where the layer is adapted and both norms are non-zero, else 1."""
    use = adapt.to(w_norm.device) & (w_norm > 0) & (other_norm > 0)
    return torch.where(use, numerator, torch.ones_like(w_norm))


@torch.no_grad()
def lars_trust_ratios(weights: Sequence[Tensor], grads: Sequence[Tensor], *,
                      trust_coefficient: float | Sequence[float] | Tensor,
                      weight_decay: float | Sequence[float] | Tensor,
                      eps: float | Sequence[float] | Tensor,
                      adapt: Sequence[bool] | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """LARS trust ratios of n layers in one call.

    Args: ``weights``/``grads``, n tensors each (pairwise same shape); per-layer hyper-parameters
    as a float or a length-n sequence; ``adapt``, n bools (False = excluded, ratio 1).
    Returns ``(ratios, w_norms, g_norms)``, fp32 tensors of shape ``[n]``.
    Raises ValueError when the lists differ in length.
    """
    if len(weights) != len(grads) or len(weights) != len(adapt):
        raise ValueError(f"got {len(weights)} weights, {len(grads)} grads, {len(adapt)} adapt flags")
    fused = fused_backend(weights, grads)
    if fused is not None and not isinstance(adapt, Tensor):
        r = fused.lars_ratios(weights, grads, trust_coefficient=trust_coefficient,
                              weight_decay=weight_decay, eps=eps, adapt=adapt)
        return r.ratio, r.w_norm, r.o_norm
    w_norm = _torch_norms(weights)
    g_norm = _torch_norms(grads)
    n = len(weights)
    eta = _as_layer_vector(trust_coefficient, n, w_norm)
    wd = _as_layer_vector(weight_decay, n, w_norm)
    e = _as_layer_vector(eps, n, w_norm)
    ratio = eta * w_norm / (g_norm + wd * w_norm + e)
    return _ratio(ratio, w_norm, g_norm, torch.as_tensor(adapt, dtype=torch.bool)), w_norm, g_norm


@torch.no_grad()
def lamb_trust_ratios(weights: Sequence[Tensor], updates: Sequence[Tensor], *,
                      adapt: Sequence[bool] | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """LAMB trust ratios ``||w|| / ||u||`` of n layers in one call.

    Args: ``weights``/``updates`` (u, weight decay already inside), n tensors each; ``adapt``, n
    bools. Returns ``(ratios, w_norms, u_norms)``, fp32 tensors of shape ``[n]``.
    Raises ValueError when the lists differ in length.
    """
    if len(weights) != len(updates) or len(weights) != len(adapt):
        raise ValueError(f"got {len(weights)} weights, {len(updates)} updates, "
                         f"{len(adapt)} adapt flags")
    fused = fused_backend(weights, updates)
    if fused is not None and not isinstance(adapt, Tensor):
        r = fused.lamb_ratios(weights, updates, adapt=adapt)
        return r.ratio, r.w_norm, r.o_norm
    w_norm = _torch_norms(weights)
    u_norm = _torch_norms(updates)
    ratio = w_norm / torch.where(u_norm > 0, u_norm, torch.ones_like(u_norm))
    return _ratio(ratio, w_norm, u_norm, torch.as_tensor(adapt, dtype=torch.bool)), w_norm, u_norm
