"""GPU tests of the fused trust-ratio kernel (marked ``gpu``; skipped without CUDA and CuPy).

Fresh random inputs every run (the seed is in every failure message; HPCLB_TEST_SEED fixes it),
outputs poisoned with NaN before every launch, results against a float64 reference computed on
the GPU: relative error <= 1e-6 for fp32 inputs, <= 1e-3 for fp16/bf16. Shapes: ResNet-50 and
BERT-large parameters, 10,000 tiny tensors, one 100M-element tensor, all-zero layers (ratio 1),
inf/NaN layers (flag set), misaligned views and mixed dtypes; a LARS and a LAMB step with the
CuPy backend equal the torch backend's; a broken source raises KernelCompileError through CuPy.

Runs under pytest (``pytest -m gpu tests/test_kernel_gpu.py``) or, where pytest is missing, as a
script (``python tests/test_kernel_gpu.py``), which prints one line per case and
``N passed, M failed``.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hpclb.bench.shapes import BERT_LARGE, RESNET50  # noqa: E402
from hpclb.optim import fused as K  # noqa: E402
from hpclb.optim.fused import launcher as fused_launcher  # noqa: E402

try:
    import pytest
except ImportError:  # the script runner below needs no pytest
    pytest = None

SEED = int(os.environ.get("HPCLB_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not K.cupy_available():
        return "CuPy not installed (pip install -e '.[gpu-cuda13]' or '.[gpu-cuda12]')"
    return None


SKIP = _why_not()
if pytest is not None:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


def params(name: str, values: list):
    """pytest.mark.parametrize when pytest is there; the script runner reads ``_cases``."""
    def wrap(fn):
        fn._cases = getattr(fn, "_cases", []) + [(name, v) for v in values]
        return pytest.mark.parametrize(name, values)(fn) if pytest is not None else fn
    return wrap


TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-3}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def fused() -> K.FusedTrust:
    f = K.fused_for(dev())
    assert f is not None and f.launcher.name == "cupy"
    return f


def gen(tag: int) -> torch.Generator:
    return torch.Generator(device=dev()).manual_seed(SEED * 1000 + tag)


def rand(shape, dtype, g, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=dev()) * scale).to(dtype)


def poisoned(n: int) -> K.TrustResult:
    nan = float("nan")
    d = dev()
    return K.TrustResult(torch.full((n,), nan, device=d), torch.full((n,), nan, device=d),
                         torch.full((n,), nan, device=d),
                         torch.full((1,), -7, dtype=torch.int32, device=d))


def norms64(ts) -> torch.Tensor:
    if not ts:
        return torch.zeros(0, dtype=torch.float64, device=dev())
    return torch.stack([torch.linalg.vector_norm(t.double()) if t.numel() else
                        torch.zeros((), dtype=torch.float64, device=dev()) for t in ts])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.double(), want.double()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    err = (got - want).abs() / want.abs().clamp_min(1e-30)
    return torch.where(same, torch.zeros_like(err), torch.nan_to_num(err, nan=float("inf")))


def check_lars(ws, gs, dtype, *, expect_nonfinite=0, g_tag=0):
    n = len(ws)
    g = gen(100 + g_tag)
    eta = torch.rand(n, generator=g, device=dev()) * 1e-2 + 1e-3
    wd = torch.rand(n, generator=g, device=dev()) * 1e-3
    eps = 1e-9
    adapt = [(i % 5 != 3) for i in range(n)]
    res = fused().lars_ratios(ws, gs, trust_coefficient=eta.cpu().numpy(),
                              weight_decay=wd.cpu().numpy(), eps=eps, adapt=adapt,
                              out=poisoned(n))
    wn, gn = norms64(ws), norms64(gs)
    eta64, wd64 = eta.double(), wd.double()
    use = torch.tensor(adapt, device=dev()) & (wn > 0) & (gn > 0)
    ratio = torch.where(use, eta64 * wn / (gn + wd64 * wn + eps), torch.ones_like(wn))
    tol = TOL[dtype]
    for name, got, want in (("ratio", res.ratio, ratio), ("w_norm", res.w_norm, wn),
                            ("g_norm", res.o_norm, gn)):
        e = rel_err(got, want)
        finite = torch.isfinite(want)
        worst = float(e[finite].max()) if bool(finite.any()) else 0.0
        assert worst <= tol, f"seed {SEED}: {name} rel err {worst:.3g} > {tol}"
    assert int(res.nonfinite.item()) == expect_nonfinite, f"seed {SEED}: flag {res.nonfinite}"
    return res


@params("dtype", list(DTYPES))
@params("shapes", ["resnet50", "bert_large"])
def test_real_parameter_sets(shapes, dtype):
    dt = DTYPES[dtype]
    spec = RESNET50 if shapes == "resnet50" else BERT_LARGE
    g = gen(1)
    ws = [rand(s, dt, g) for _, s in spec]
    gs = [rand(s, dt, g, 1e-2) for _, s in spec]
    check_lars(ws, gs, dt)


def test_ten_thousand_tiny_tensors():
    rng = np.random.default_rng(SEED)
    sizes = rng.integers(0, 65, 10_000)
    g = gen(2)
    ws = [rand((int(n),), torch.float32, g) for n in sizes]
    gs = [rand((int(n),), torch.float32, g) for n in sizes]
    check_lars(ws, gs, torch.float32)


def test_one_tensor_of_100M_elements():
    g = gen(3)
    ws, gs = [rand((100_000_000,), torch.float32, g)], [rand((100_000_000,), torch.float32, g)]
    check_lars(ws, gs, torch.float32)


def test_all_zero_layers_get_ratio_one():
    g = gen(4)
    ws = [rand((300, 7), torch.float32, g) for _ in range(6)]
    gs = [rand((300, 7), torch.float32, g) for _ in range(6)]
    ws[1].zero_()
    gs[2].zero_()
    ws[4].zero_()
    gs[4].zero_()
    res = check_lars(ws, gs, torch.float32)
    assert bool((res.ratio[[1, 2, 4]] == 1).all())


def test_nonfinite_layers_set_the_flag():
    g = gen(5)
    ws = [rand((1000, 33), torch.float32, g) for _ in range(5)]
    gs = [rand((1000, 33), torch.float32, g) for _ in range(5)]
    gs[1][17, 3] = float("inf")
    ws[3][999, 32] = float("nan")
    res = check_lars(ws, gs, torch.float32, expect_nonfinite=2)
    assert not bool(torch.isfinite(res.o_norm[1])) and not bool(torch.isfinite(res.w_norm[3]))


def test_misaligned_views_and_mixed_dtypes():
    g = gen(6)
    base_w, base_g = rand((100_003,), torch.float32, g), rand((100_003,), torch.float32, g)
    ws = [base_w[1:40_001], base_w[40_002:100_001].to(torch.float16).clone(),
          base_w[3:99_999].to(torch.bfloat16)]
    gs = [base_g[5:40_005], base_g[7:60_006].to(torch.float16),
          base_g[1:99_997].to(torch.bfloat16)]
    check_lars(ws, gs, torch.bfloat16)


def test_deterministic_bitwise():
    g = gen(7)
    ws = [rand(s, torch.float32, g) for _, s in RESNET50]
    gs = [rand(s, torch.float32, g) for _, s in RESNET50]
    a = fused().lars_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4, eps=1e-9,
                            adapt=[True] * len(ws))
    b = fused().lars_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4, eps=1e-9,
                            adapt=[True] * len(ws))
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def test_launches_on_torchs_current_stream():
    g = gen(8)
    ws = [rand((4096, 1024), torch.float32, g) for _ in range(4)]
    gs = [torch.empty_like(w) for w in ws]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w, gg in zip(ws, gs):   # producers queued on s right before the fused launch
            torch.mul(w, 3.0, out=gg)
        res = fused().lars_ratios(ws, gs, trust_coefficient=1.0, weight_decay=0.0, eps=0.0,
                                  adapt=[True] * 4)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(res.o_norm, 3 * res.w_norm, rtol=1e-6, atol=0)


def test_trust_module_picks_cupy_for_cuda_tensors():
    from hpclb.optim import trust

    g = gen(9)
    ws = [rand(s, torch.float32, g) for _, s in RESNET50[:40]]
    gs = [rand(s, torch.float32, g) for _, s in RESNET50[:40]]
    adapt = [w.ndim >= 2 for w in ws]
    assert trust.backend_for(ws) == "cupy"
    got = trust.lars_trust_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4, eps=1e-9,
                                  adapt=adapt)
    got_lamb = trust.lamb_trust_ratios(ws, gs, adapt=adapt)
    os.environ["HPCLB_TRUST_BACKEND"] = "torch"
    try:
        assert trust.backend_for(ws) == "torch"
        want = trust.lars_trust_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4,
                                       eps=1e-9, adapt=adapt)
        want_lamb = trust.lamb_trust_ratios(ws, gs, adapt=adapt)
    finally:
        del os.environ["HPCLB_TRUST_BACKEND"]
    for a, b in zip(got + got_lamb, want + want_lamb):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0)


def _model(dtype, seed):
    g = torch.Generator(device=dev()).manual_seed(seed)
    shapes = [s for _, s in RESNET50[:30]] + [(1000, 2048), (1000,)]
    return [torch.nn.Parameter(rand(s, dtype, g, 0.05)) for s in shapes]


@params("opt", ["lars", "lamb"])
def test_optimizer_step_equals_torch_backend(opt):
    from hpclb.optim import LAMB, LARS

    runs = {}
    for backend in ("cupy", "torch"):
        params_ = _model(torch.float32, SEED)
        o = LARS(params_, lr=0.5, weight_decay=1e-4) if opt == "lars" else \
            LAMB(params_, lr=1e-2, weight_decay=1e-2)
        g = gen(10)
        if backend == "torch":
            os.environ["HPCLB_TRUST_BACKEND"] = "torch"
        try:
            for _ in range(3):
                for p in params_:
                    p.grad = rand(p.shape, p.dtype, g, 1e-2)
                o.param_groups[0]["lr"] *= 0.7
                o.step()
        finally:
            os.environ.pop("HPCLB_TRUST_BACKEND", None)
        runs[backend] = [p.detach().clone() for p in params_]
    for a, b in zip(runs["cupy"], runs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"seed {SEED}: {m}")


def test_optimizer_outputs_nonfinite_clamp_and_vector_path():
    """LARS with a trust clamp and a NaN layer: the CuPy path equals the torch path, leaves the
    NaN layer untouched, reports it in nonfinite_layers, and vectorises every launch on fresh
    (allocator-aligned) parameters."""
    from hpclb.optim import LARS

    runs = {}
    for backend in ("cupy", "torch"):
        params_ = _model(torch.float32, SEED)
        o = LARS(params_, lr=0.5, weight_decay=1e-4, trust_clamp=(0.001, 0.02))
        g = gen(11)
        counters = dict(fused().counters)
        if backend == "torch":
            os.environ["HPCLB_TRUST_BACKEND"] = "torch"
        try:
            for step in range(2):
                for p in params_:
                    p.grad = rand(p.shape, p.dtype, g, 1e-2)
                if step == 1:
                    params_[3].grad.view(-1)[0] = float("nan")
                before = params_[3].detach().clone()
                o.step()
        finally:
            os.environ.pop("HPCLB_TRUST_BACKEND", None)
        assert o.path == backend
        assert o.nonfinite_layers.device == dev() and int(o.nonfinite_layers) == 1
        assert torch.equal(params_[3].detach(), before)
        if backend == "cupy":
            c = {k: v - counters[k] for k, v in fused().counters.items()}
            assert c["launches"] == 4 and c["vector_launches"] == 4, c
        runs[backend] = [p.detach().clone() for p in params_], o.trust_ratios.clone()
    (pc, rc), (pt, rt) = runs["cupy"], runs["torch"]
    torch.testing.assert_close(rc, rt, rtol=1e-5, atol=0)
    for a, b in zip(pc, pt):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"seed {SEED}: {m}")


def test_two_streams_get_their_own_tables():
    g = gen(12)
    ws = [rand((2048, 1024), torch.float32, g) for _ in range(3)]
    gs = [rand((2048, 1024), torch.float32, g) for _ in range(3)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (s1, s2):
        s.wait_stream(torch.cuda.current_stream())
    out = []
    for s in (s1, s2):   # both queued before either finishes
        with torch.cuda.stream(s):
            out.append(fused().lars_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4,
                                           eps=1e-9, adapt=[True] * 3))
    for s in (s1, s2):
        torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.stream(s1):
        t1 = fused().table(ws, gs, adapt=[True] * 3)
    with torch.cuda.stream(s2):
        t2 = fused().table(ws, gs, adapt=[True] * 3)
    assert t1 is not t2 and t1.partials.data_ptr() != t2.partials.data_ptr()
    for a, b in zip(out[0][:3], out[1][:3]):
        assert torch.equal(a, b)


def test_cupy_compile_error_is_reported():
    launcher = K.CupyLauncher(dev())
    real = K.kernel_source   # CupyLauncher.module looks kernel_source up in fused.launcher
    fused_launcher.kernel_source = lambda: real().replace(
        "s_last = done == (unsigned int)(nct - 1);", "s_last = done == (unsigned int)(nct - 1)")
    try:
        raised = None
        try:
            launcher.module()
        except K.KernelCompileError as e:
            raised = e
        assert raised is not None and "expected a" in str(raised), raised
    finally:
        fused_launcher.kernel_source = real


# ---------------------------------------------------------------------------------------------
def _script() -> int:
    if SKIP is not None:
        print(f"0 passed, 0 failed, all skipped: {SKIP}")
        return 0
    passed = failed = 0
    for name, fn in list(globals().items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        combos: list[dict] = [{}]
        cases: list = getattr(fn, "_cases", [])
        keys = []
        for k, _ in cases:
            if k not in keys:
                keys.append(k)
        for k in keys:
            combos = [dict(c, **{k: v}) for c in combos for kk, v in cases if kk == k]
        for kw in combos:
            label = name + (f"[{','.join(map(str, kw.values()))}]" if kw else "")
            t0 = time.time()
            try:
                fn(**kw)
                passed += 1
                print(f"PASS {label} ({time.time() - t0:.1f}s)", flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
            torch.cuda.empty_cache()
    print(f"seed {SEED}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_script())
