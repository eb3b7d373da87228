"""Per-layer norms and trust ratios for every layer in one call.

One spec, several implementations that must agree (a float64 NumPy reference in the tests, this
torch path on CPU/GPU, and the fused CUDA kernel of ``kernels/`` behind the same functions).
Formulas (You, Gitman, Ginsburg 2017, arXiv 1708.03888, for LARS; You et al., ICLR 2020,
arXiv 1904.00962, for LAMB):

- LARS: ``ratio = eta * ||w|| / (||g|| + wd * ||w|| + eps)``
- LAMB: ``ratio = ||w|| / ||u||`` with ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``
- optional clamp ``trust_clamp=(min, max)``: ``ratio = min(max(ratio, min), max)``

A layer whose ``||w||`` or ``||g||`` (``||u||``) is 0 gets ratio 1 (never 0/0), and so does a
layer that is excluded from adaptation (``adapt`` False); the clamp applies to the other layers
only. Norms accumulate in the wider of the tensor's dtype and fp32: fp32 for fp32/fp16/bf16,
fp64 for fp64. Results are tensors of shape ``[n_layers]`` on the tensors' device, fp32, or fp64
when any input is fp64, so nothing synchronises with the host per layer.

Backends (:func:`backend_for`): ``"cupy"``, the fused kernel of ``kernels/trust_ratio.cu``
(:mod:`hpclb.optim.fused`: one launch for all layers), is chosen automatically for CUDA tensors when
CuPy imports; ``"torch"`` (``torch._foreach_norm`` calls) everywhere else, and for inputs the
kernel does not take (non-contiguous tensors; dtypes other than fp32/fp16/bf16, e.g. float64),
which is logged once per reason. ``HPCLB_TRUST_BACKEND=torch`` forces the torch path. The choice
is logged once per process and backend.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.base import check_trust_clamp, host_to_device

__all__ = ["TrustClamp", "backend_for", "fused_backend", "layer_norms", "clamp_bounds",
           "check_trust_clamp", "lars_trust_ratios", "lamb_trust_ratios", "host_to_device"]

log = logging.getLogger(__name__)
_announced: set[str] = set()

#: ``trust_clamp`` as accepted here: None (no clamp), one ``(min, max)`` for every layer, or one
#: ``(min, max)`` or None per layer.
TrustClamp = Any


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
    """The fused implementation (:class:`hpclb.optim.fused.FusedTrust`) that can take all of
    ``lists`` (layer-aligned tensor lists, the first non-empty), or None for the torch path."""
    first = lists[0]
    if not first or backend_for(first) == "torch":
        return None
    fused = kernels.fused_for(first[0].device)
    if fused is None:
        return None
    reason = fused.why_not(*lists)
    if reason is not None:
        kind = reason.split(" ", 2)[-1]   # without "layer N": once per kind of reason
        if kind not in _announced:
            _announced.add(kind)
            log.info("trust ratios: torch path instead of %s: %s", fused.launcher.name, reason)
        return None
    return fused


@torch.no_grad()
def layer_norms(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of each tensor, accumulated in the wider of its dtype and fp32.

    Args: ``tensors``, n floating tensors of any shape/size (an empty tensor has norm 0), all on
    one device. Returns a tensor of shape ``[n]`` on that device (``[0]`` if n = 0), fp32, or
    fp64 when any input is fp64.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    fused = fused_backend(tensors)
    if fused is not None:
        return fused.norms(tensors)
    return _torch_norms(tensors)


def _torch_norms(tensors: Sequence[Tensor]) -> Tensor:
    """``[n]`` norms: fp32 accumulation, fp64 for fp64 tensors (then the result is fp64)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
    if not wide:
        return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))
    if len(wide) == len(tensors):
        return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64))
    narrow = [i for i, t in enumerate(tensors) if t.dtype != torch.float64]
    out = torch.empty(len(tensors), dtype=torch.float64, device=tensors[0].device)
    for idx, dtype in ((wide, torch.float64), (narrow, torch.float32)):
        norms = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=dtype)
        out[host_to_device(idx, torch.long, out.device)] = torch.stack(norms).to(torch.float64)
    return out


def _as_layer_vector(x: float | Sequence[float] | Tensor, n: int, like: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(dtype=like.dtype, device=like.device).expand(n)
    if isinstance(x, (int, float)):   # filled on the device: nothing copied
        return torch.full((n,), float(x), dtype=like.dtype, device=like.device)
    return host_to_device(x, like.dtype, like.device).expand(n)


def clamp_bounds(trust_clamp: TrustClamp, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-layer ``(lo, hi)`` float64 arrays ``[n]`` of a ``trust_clamp`` (see
    :data:`TrustClamp`; a layer without a clamp gets ``(0, inf)``), or None when no layer has
    one. Raises ValueError for a malformed clamp (each must be ``0 <= min < max``)."""
    if trust_clamp is None:
        return None
    items = list(trust_clamp)
    if len(items) == 2 and all(isinstance(x, (int, float, np.floating)) for x in items):
        items = [tuple(items)] * n
    if len(items) != n:
        raise ValueError(f"trust_clamp: {len(items)} entries for {n} layers; give one "
                         "(min, max), or one (min, max) or None per layer")
    lo, hi = np.zeros(n), np.full(n, math.inf)
    for i, c in enumerate(items):
        if c is not None:
            lo[i], hi[i] = check_trust_clamp(c)
    return (lo, hi) if any(c is not None for c in items) else None


def _clamp(ratio: Tensor, bounds: tuple[np.ndarray, np.ndarray] | None) -> Tensor:
    if bounds is None:
        return ratio
    lo, hi = (host_to_device(b, ratio.dtype, ratio.device) for b in bounds)
    return torch.minimum(torch.maximum(ratio, lo), hi)   # NaN stays NaN, as in the kernel


def _fused_clamp(bounds: tuple[np.ndarray, np.ndarray] | None, n: int) -> dict[str, Any]:
    """The kernel's clamp arguments: ``clamp_max`` 0 means no clamp for that layer."""
    if bounds is None:
        return {}
    lo, hi = bounds
    return dict(clamp_min=lo.astype(np.float32),
                clamp_max=np.where(np.isinf(hi) & (lo == 0), 0.0, hi).astype(np.float32))


def _ratio(numerator: Tensor, w_norm: Tensor, other_norm: Tensor, adapt: Tensor) -> Tensor:
    """``numerator`` where the layer is adapted and both norms are non-zero, else 1."""
    adapt = adapt if adapt.device == w_norm.device else \
        host_to_device(adapt, torch.bool, w_norm.device)
    use = adapt & (w_norm > 0) & (other_norm > 0)
    return torch.where(use, numerator, torch.ones_like(w_norm))


@torch.no_grad()
def lars_trust_ratios(weights: Sequence[Tensor], grads: Sequence[Tensor], *,
                      trust_coefficient: float | Sequence[float] | Tensor,
                      weight_decay: float | Sequence[float] | Tensor,
                      eps: float | Sequence[float] | Tensor,
                      adapt: Sequence[bool] | Tensor,
                      trust_clamp: TrustClamp = None) -> tuple[Tensor, Tensor, Tensor]:
    """LARS trust ratios of n layers in one call.

    Args: ``weights``/``grads``, n tensors each (pairwise same shape); per-layer hyper-parameters
    as a float or a length-n sequence; ``adapt``, n bools (False = excluded, ratio 1);
    ``trust_clamp``, see :data:`TrustClamp`.
    Returns ``(ratios, w_norms, g_norms)``, tensors of shape ``[n]`` (fp32; fp64 when any input
    is fp64). Raises ValueError when the lists differ in length or a clamp is malformed.
    """
    if len(weights) != len(grads) or len(weights) != len(adapt):
        raise ValueError(f"got {len(weights)} weights, {len(grads)} grads, "
                         f"{len(adapt)} adapt flags")
    n = len(weights)
    bounds = clamp_bounds(trust_clamp, n)
    fused = fused_backend(weights, grads)
    if fused is not None and not isinstance(adapt, Tensor):
        r = fused.lars_ratios(weights, grads, trust_coefficient=trust_coefficient,
                              weight_decay=weight_decay, eps=eps, adapt=adapt,
                              **_fused_clamp(bounds, n))
        return r.ratio, r.w_norm, r.o_norm
    w_norm = _torch_norms(weights)
    g_norm = _torch_norms(grads)
    eta = _as_layer_vector(trust_coefficient, n, w_norm)
    wd = _as_layer_vector(weight_decay, n, w_norm)
    e = _as_layer_vector(eps, n, w_norm)
    den = g_norm + wd * w_norm + e
    ratio = _clamp(eta * w_norm / torch.where(den > 0, den, torch.ones_like(den)), bounds)
    return _ratio(ratio, w_norm, g_norm, torch.as_tensor(adapt, dtype=torch.bool)), w_norm, g_norm


@torch.no_grad()
def lamb_trust_ratios(weights: Sequence[Tensor], updates: Sequence[Tensor], *,
                      adapt: Sequence[bool] | Tensor,
                      trust_clamp: TrustClamp = None) -> tuple[Tensor, Tensor, Tensor]:
    """LAMB trust ratios ``||w|| / ||u||`` of n layers in one call.

    Args: ``weights``/``updates`` (u, weight decay already inside), n tensors each; ``adapt``, n
    bools; ``trust_clamp``, see :data:`TrustClamp`. Returns ``(ratios, w_norms, u_norms)``,
    tensors of shape ``[n]`` (fp32; fp64 when any input is fp64).
    Raises ValueError when the lists differ in length or a clamp is malformed.
    """
    if len(weights) != len(updates) or len(weights) != len(adapt):
        raise ValueError(f"got {len(weights)} weights, {len(updates)} updates, "
                         f"{len(adapt)} adapt flags")
    n = len(weights)
    bounds = clamp_bounds(trust_clamp, n)
    fused = fused_backend(weights, updates)
    if fused is not None and not isinstance(adapt, Tensor):
        r = fused.lamb_ratios(weights, updates, adapt=adapt, **_fused_clamp(bounds, n))
        return r.ratio, r.w_norm, r.o_norm
    w_norm = _torch_norms(weights)
    u_norm = _torch_norms(updates)
    ratio = _clamp(w_norm / torch.where(u_norm > 0, u_norm, torch.ones_like(u_norm)), bounds)
    return _ratio(ratio, w_norm, u_norm, torch.as_tensor(adapt, dtype=torch.bool)), w_norm, u_norm
