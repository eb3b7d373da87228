"""The per-step host path of DistributedOptimizer works on the bucket buffers (one operation per
bucket, not per tensor) exactly when every ``p.grad`` is its bucket view, and falls back to
torch's per-tensor functions otherwise; each way gives torch's result (issue 26: host time per
step). At 1 process and under ``mpirun -n 2 ... --only-mpi``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hpclb
from hpclb.comm.testing import assert_all

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120, method="thread")]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))


def _rank() -> int:
    from hpclb.comm.world import current_communicator
    return current_communicator().rank


def _backward(model, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + _rank())
    x, y = torch.randn(8, 7, generator=g), torch.randn(8, 2, generator=g)
    (model(x) - y).pow(2).mean().backward()


@pytest.mark.filterwarnings("ignore:fusion_threshold_bytes")
@pytest.mark.parametrize("threshold", [64, 1 << 20])  # several buckets / one bucket
def test_the_norm_over_buckets_is_torchs_norm_and_clipping_is_torchs(threshold):
    """grad_norm over the buckets equals get_total_norm of the gradients to rounding (1e-6
    relative), and clipping to it multiplies every element as clip_grads_with_norm_ does."""
    hpclb.init()
    model = _model()
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                     grad_clip_norm=1e-3, fusion_threshold_bytes=threshold,
                                     first_bucket_bytes=threshold)
    try:
        _backward(model, 0)
        grads = [p.grad.clone() for p in model.parameters()]
        ref_norm = torch.nn.utils.get_total_norm(grads)
        ref = [g.clone() for g in grads]
        torch.nn.utils.clip_grads_with_norm_([_P(g) for g in ref], 1e-3, opt.sync.grad_norm())
        opt.step()
        assert opt.sync.grads_are_views() and len(opt.sync.buckets) >= (2 if threshold < 1024
                                                                        else 1)
        ok = torch.allclose(opt.grad_norm, ref_norm, rtol=1e-6, atol=0) and all(
            torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
        assert_all(opt.comm, ok, f"norm {opt.grad_norm.item()} vs {ref_norm.item()}")
    finally:
        opt.close()


class _P:
    """A stand-in parameter whose .grad is the given tensor (for torch's clip function)."""

    def __init__(self, g):
        self.grad = g


def test_a_replaced_gradient_takes_torchs_per_tensor_path():
    """A gradient replaced after backward (not the bucket view): the norm is torch's
    get_total_norm of the gradients as they are, bit for bit, and clipping uses them."""
    hpclb.init()
    model = _model()
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                     grad_clip_norm=1e-3)
    try:
        _backward(model, 1)
        w = model[0].weight
        w.grad = w.grad * 2  # a new tensor, no longer the bucket view
        assert not opt.sync.grads_are_views()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        doubled = w.grad.clone()
        opt.step()
        coef = torch.clamp(1e-3 / (expected + 1e-6), max=1.0)
        assert_all(opt.comm, torch.equal(opt.grad_norm, expected)
                   and torch.equal(w.grad, doubled * coef), "per-tensor fallback")
    finally:
        opt.close()


def test_zero_grad_zeroes_the_buckets_only_where_torch_would():
    """zero_grad() fills the buckets when they hold exactly the optimizer's gradients; a model
    parameter the optimizer does not hold keeps its gradient, as with torch's zero_grad()."""
    hpclb.init()
    model = _model()
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        _backward(model, 2)
        opt.step()
        opt.zero_grad()
        assert_all(opt.comm, all(p.grad is not None and not p.grad.any()
                                 for p in model.parameters())
                   and all(not b.buffer.any() for b in opt.sync.buckets), "all zero")
    finally:
        opt.close()
    model = _model()
    last = model[4]
    inner = torch.optim.SGD([p for m in list(model)[:4] for p in m.parameters()], lr=0.1)
    opt = hpclb.DistributedOptimizer(inner, model)
    try:
        _backward(model, 3)
        opt.step()
        kept = last.weight.grad.clone()
        opt.zero_grad()
        assert_all(opt.comm, torch.equal(last.weight.grad, kept) and kept.any()
                   and not model[0].weight.grad.any(), "the optimizer's gradients only")
    finally:
        opt.close()
