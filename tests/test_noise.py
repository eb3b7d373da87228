"""hpclb.noise: the gradient noise scale on linear regression, where it is known in closed form.

y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, sigma^2), per-sample loss (x.w - y)^2 / 2 at a fixed
w = w* + delta. Per-sample gradient g = x (x.delta - eps); G = E[g] = delta, and with Isserlis'
theorem E[g g^T] = |delta|^2 I + 2 delta delta^T + sigma^2 I, so
    |G|^2 = |delta|^2,   tr(Sigma) = (d + 1)|delta|^2 + d sigma^2,
    B_simple = (d + 1) + d sigma^2 / |delta|^2.
"""
import math

import pytest
import torch

from hpclb.noise import NoiseScaleEstimator, grad_sq_norm
from hpclb.tools.advise import format_advice, recommend_batch

pytestmark = pytest.mark.timeout(120)


def rank_gradients(d, delta_sq, sigma, ranks, b, steps, seed=0):
    """Real per-rank mini-batch gradients (autograd of the mean loss of each rank's b samples)
    for `steps` steps: a (steps, ranks, d) float64 tensor, and the true (|G|^2, tr Sigma)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    w_star = torch.randn(d, **f64)
    delta = torch.randn(d, **f64)
    delta *= math.sqrt(delta_sq) / delta.norm()
    X = torch.randn(steps, ranks, b, d, **f64)
    y = X @ w_star + sigma * torch.randn(steps, ranks, b, **f64)
    w = (w_star + delta).expand(steps, ranks, d).clone().requires_grad_(True)  # one copy a rank
    loss = 0.5 * ((X @ w.unsqueeze(-1)).squeeze(-1) - y).pow(2).mean(-1).sum()
    (grads,) = torch.autograd.grad(loss, w)
    return grads, (delta_sq, (d + 1) * delta_sq + d * sigma ** 2)


def feed(est, grads, b):
    """What a data-parallel step hands the estimator: the mean over ranks of each rank's local
    squared norm (batch b) and the squared norm of the allreduced mean (batch ranks * b)."""
    ranks = grads.shape[1]
    small = grads.pow(2).sum(-1).mean(-1)  # (steps,): per rank |g_r|^2, mean over ranks
    big = grads.mean(1).pow(2).sum(-1)     # (steps,): |mean_r g_r|^2
    for s, g in zip(small, big):
        est.update(s, b, g, ranks * b)


CASES = [  # d, |delta|^2, sigma, ranks, per-rank batch  ->  B_simple 21, 13.5
    (10, 1.0, 1.0, 4, 8),
    (10, 4.0, 1.0, 8, 4),
]


@pytest.mark.parametrize("d,delta_sq,sigma,ranks,b", CASES)
def test_unbiased_estimates_match_closed_form(d, delta_sq, sigma, ranks, b):
    grads, (g2_true, trace_true) = rank_gradients(d, delta_sq, sigma, ranks, b, steps=4000)
    small = grads.pow(2).sum(-1).mean(-1)          # mean over ranks of |G_small|^2
    big = grads.mean(1).pow(2).sum(-1)             # |G_big|^2
    g2, trace = NoiseScaleEstimator.estimates(small, b, big, ranks * b)
    # standard errors of the 4000-step means are about 1.5 % (|G|^2) and 1 % (tr Sigma)
    assert g2.mean().item() == pytest.approx(g2_true, rel=0.05)
    assert trace.mean().item() == pytest.approx(trace_true, rel=0.05)


@pytest.mark.parametrize("d,delta_sq,sigma,ranks,b", CASES)
def test_smoothed_b_simple_within_ten_percent(d, delta_sq, sigma, ranks, b):
    grads, (g2_true, trace_true) = rank_gradients(d, delta_sq, sigma, ranks, b, steps=2000,
                                                  seed=1)
    b_true = trace_true / g2_true
    est = NoiseScaleEstimator(ema=0.99)
    feed(est, grads, b)
    s = est.summary()
    assert s["n"] == 2000
    assert s["b_simple"] == pytest.approx(b_true, rel=0.10)
    assert s["b_simple_lo"] < b_true < s["b_simple_hi"]
    assert s["b_simple_hi"] / s["b_simple_lo"] < 1.5
    assert s["g2"] == pytest.approx(g2_true, rel=0.10)
    assert s["trace"] == pytest.approx(trace_true, rel=0.10)


def test_no_noise_means_b_simple_zero_and_pure_noise_is_undefined():
    est = NoiseScaleEstimator(ema=0.5)
    for _ in range(3):  # every rank sees the same gradient: no variance
        est.update(4.0, 16, 4.0, 64)
    s = est.summary()
    assert s["g2"] == pytest.approx(4.0) and s["trace"] == 0.0 and s["b_simple"] == 0.0
    est = NoiseScaleEstimator()
    est.update(1.0, 8, 0.25, 32)  # |G|^2 estimate (32*.25 - 8)/24 = 0: no signal at all
    s = est.summary()
    assert s["g2"] == 0.0 and s["b_simple"] is None and s["trace"] == pytest.approx(8.0)  # .75 / (1/8 - 1/32)


def test_summary_empty_errors_and_window():
    est = NoiseScaleEstimator()
    assert est.summary() == {"b_simple": None, "g2": None, "trace": None, "b_simple_lo": None,
                             "b_simple_hi": None, "n": 0}
    with pytest.raises(ValueError, match="small_batch < big_batch"):
        est.update(1.0, 32, 1.0, 32)
    with pytest.raises(ValueError, match="ema"):
        NoiseScaleEstimator(ema=1.0)
    est.update(2.0, 8, 1.0, 32)
    est.new_window()
    assert est.summary()["n"] == 0 and est.summary()["b_simple"] is not None


def test_state_dict_resumes_bit_for_bit():
    grads, _ = rank_gradients(6, 1.0, 1.0, 2, 4, steps=40)
    whole, first = NoiseScaleEstimator(), NoiseScaleEstimator()
    feed(whole, grads, 4)
    feed(first, grads[:25], 4)
    second = NoiseScaleEstimator()
    second.load_state_dict(first.state_dict())
    feed(second, grads[25:], 4)
    assert second.summary() == whole.summary()


def test_grad_sq_norm_and_recommended_batch():
    ts = [torch.tensor([3.0, 4.0]), None, torch.ones(2, 2)]
    assert grad_sq_norm(ts).item() == pytest.approx(29.0, rel=1e-6)  # float32 norm, squared
    assert grad_sq_norm(ts).dtype == torch.float64
    assert grad_sq_norm([]).item() == 0.0
    assert recommend_batch(1000.0, 128) == 512
    assert recommend_batch(1024.0, 128) == 1024
    assert recommend_batch(50.0, 128) == 128
    # never above the training set: 84k critical on MNIST's 60,000 samples gives 32768, not 65536
    assert recommend_batch(84000.0, 128) == 65536
    assert recommend_batch(84000.0, 128, max_batch=59905) == 32768
    assert recommend_batch(50.0, 128, max_batch=100) == 128  # B0 stays the floor
    # the printed rule says so when B0 is above the critical batch (fresh-user review)
    advice = {"epochs": [1, 2], "critical_batch": 112.6, "critical_lo": 90.0,
              "critical_hi": 130.0, "base_batch_size": 128, "recommended_batch": 128,
              "recommended_lo": 128, "recommended_hi": 128, "run_batch_size": 128}
    assert "k = 1: B0 itself: critical_batch is below it" in format_advice(advice)
    advice.update(critical_batch=1000.0, recommended_batch=512)
    assert "k = 4: the largest B0 x 2^j not above critical_batch," in format_advice(advice)
    advice.update(critical_batch=84000.0, recommended_batch=32768, train_samples_min=59905)
    assert "k = 256: the largest B0 x 2^j not above critical_batch nor the training set " \
           "(>= 59905 samples)" in format_advice(advice)
    with pytest.raises(ValueError, match="b_simple"):
        recommend_batch(float("nan"), 128)
