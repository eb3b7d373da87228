"""Logic gate of kernels/trust_ratio.cu without a GPU.

The unchanged .cu runs on the CPU through kernels/testing/cuda_on_cpu.h (every CUDA thread a
ucontext fiber, blocks one after another), built at test time with g++ -std=c++20 and driven
through the same host code as on a GPU (hpclb.optim.fused.FusedTrust with the emulator as launcher).
Outputs are compared with a float64 NumPy reference (and, for the element-wise updates, with a
float32 NumPy model of the same operation order, bit for bit) across dtypes, odd tensor, chunk,
block and grid sizes, schedule policies, misaligned views, missing gradients, zeros and inf/NaN.
Every tensor lives in an arena between canaries, so an out-of-bounds read changes a norm and an
out-of-bounds write changes a canary. One run goes under AddressSanitizer, and mutated copies of
the kernel (a barrier removed, an off-by-one read) must be caught.

Environment: HPCLB_EMULATOR_LIB=path uses a prebuilt library (the ASan runs do);
HPCLB_EMULATOR_SMALL=1 runs a reduced sweep; HPCLB_EMULATOR_SEPARATE=1 allocates every tensor
on its own (no arena), so that ASan sees each one's end.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpclb.optim import fused as K

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "kernels" / "testing"))
import harness as H  # noqa: E402

SMALL = os.environ.get("HPCLB_EMULATOR_SMALL") == "1"
SEPARATE = os.environ.get("HPCLB_EMULATOR_SEPARATE") == "1"
SEED = int(os.environ.get("HPCLB_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
CANARY = 1000.0
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

pytestmark = pytest.mark.skipif(H.compiler() is None, reason="needs g++ (C++20)")

BARRIER_LINE = "    if (lane == 0) s_warp[warp] = a;\n    __syncthreads();\n"
TAIL_LOOP = "for (long long j = i + threadIdx.x; j < end; j += blockDim.x)"


def mutant(old: str, new: str) -> str:
    src = H.SOURCE.read_text()
    assert src.count(old) == 1, f"mutation site not unique/absent: {old!r}"
    return src.replace(old, new)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    """The emulator libraries, built in parallel: plain, ASan, and the mutants."""
    if os.environ.get("HPCLB_EMULATOR_LIB"):
        return {"plain": Path(os.environ["HPCLB_EMULATOR_LIB"])}
    d = tmp_path_factory.mktemp("emulator")
    no_barrier = mutant(BARRIER_LINE, "    if (lane == 0) s_warp[warp] = a;\n")
    off_by_one = mutant(TAIL_LOOP, TAIL_LOOP.replace("j < end", "j <= end"))
    jobs = {
        "plain": dict(),
        "asan": dict(sanitize=True),
        "no_barrier": dict(source_text=no_barrier, tag="nobarrier"),
        "off_by_one": dict(source_text=off_by_one, tag="offbyone"),
        "off_by_one_asan": dict(source_text=off_by_one, sanitize=True, tag="offbyone"),
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(H.build_emulator, d, **kw) for k, kw in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


@pytest.fixture(scope="module")
def emu(libs) -> H.Emulator:
    return H.Emulator(libs["plain"])


# ---------------------------------------------------------------------------------------------
# inputs in a canary arena, and the float64 reference
# ---------------------------------------------------------------------------------------------

class Arena:
    """Tensors as views into one buffer, with CANARY guards around each (or, with SEPARATE,
    each tensor its own allocation). ``misalign`` shifts some views off 16-byte alignment."""

    def __init__(self, dtype: torch.dtype, sizes: list[int], rng: np.random.Generator,
                 misalign: bool = True, guard: int = 3):
        self.dtype = dtype
        self.offsets, off = [], guard
        per16 = 16 // torch.tensor([], dtype=dtype).element_size()
        for i, n in enumerate(sizes):
            off = -(-off // per16) * per16           # aligned start ...
            if misalign and i % 3 == 2:
                off += 1                             # ... or one element off
            self.offsets.append(off)
            off += n + guard
        self.buf = torch.full((off + guard,), CANARY, dtype=dtype)
        self.sizes = sizes

    def views(self, values: list[np.ndarray]) -> list[torch.Tensor]:
        out = []
        for off, n, v in zip(self.offsets, self.sizes, values):
            t = torch.from_numpy(np.asarray(v, dtype=np.float32)).to(self.dtype)
            if SEPARATE:
                out.append(t.clone())
            else:
                view = self.buf[off:off + n]
                view.copy_(t)
                out.append(view)
        return out

    def canaries_intact(self) -> bool:
        if SEPARATE:
            return True
        mask = torch.ones(self.buf.numel(), dtype=torch.bool)
        for off, n in zip(self.offsets, self.sizes):
            mask[off:off + n] = False
        return bool((self.buf[mask] == CANARY).all())


def f64(t: torch.Tensor | None, n: int = 0) -> np.ndarray:
    return np.zeros(n) if t is None else t.detach().to(torch.float64).numpy().copy()


def rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
    return np.where(same, 0.0, np.nan_to_num(err, nan=np.inf))


def ref_lars(ws, gs, eta, wd, eps, adapt):
    wn = np.array([np.sqrt(np.sum(w * w)) for w in ws])
    gn = np.array([np.sqrt(np.sum(g * g)) for g in gs])
    use = np.asarray(adapt) & (wn > 0) & (gn > 0)
    with np.errstate(all="ignore"):
        r = np.where(use, eta * wn / (gn + wd * wn + eps), 1.0)
    return r, wn, gn


def make_values(rng, sizes, kind="normal"):
    out = []
    for i, n in enumerate(sizes):
        scale = 10.0 ** rng.uniform(-2, 1)
        out.append((rng.standard_normal(n) * scale).astype(np.float32))
    return out


SIZES = [0, 1, 3, 7, 31, 32, 33, 100, 257, 1000, 4097, 5003]
# (chunk_size, block, max_grid, policy): odd chunks, all block sizes used in practice, grids
# smaller than, equal to and larger than the chunk count, every schedule policy.
CONFIGS = [(7, 32, None, 0), (64, 64, 3, 1), (100, 96, 1, 2), (1000, 32, 7, 0),
           (4096, 256, 5, 2), (2048, 1024, 2, 0), (24, 128, 13, 1)]
if SMALL:
    SIZES = [1, 33, 257, 0, 1000]   # an empty tensor (null pointer) not first
    CONFIGS = [(64, 64, 3, 0), (100, 96, 1, 2)]
if os.environ.get("HPCLB_EMULATOR_NONEMPTY") == "1":
    SIZES = [s for s in SIZES if s]


def fused(emu, chunk, block, grid, policy, seed=SEED) -> K.FusedTrust:
    return K.FusedTrust(H.EmulatorLauncher(emu, max_grid=grid, policy=policy, seed=seed),
                        chunk_size=chunk, block=block)


def poisoned(n: int) -> K.TrustResult:
    nan = float("nan")
    return K.TrustResult(torch.full((n,), nan), torch.full((n,), nan), torch.full((n,), nan),
                         torch.full((1,), -7, dtype=torch.int32))


def lars_case(F, dtype, rng, *, missing=(), zero_w=(), zero_g=(), bad=()):
    """Run pass 1 (LARS mode) on fresh inputs; return the list of problems found."""
    n = len(SIZES)
    arena_w, arena_g = Arena(dtype, SIZES, rng), Arena(dtype, SIZES, rng)
    wv, gv = make_values(rng, SIZES), make_values(rng, SIZES)
    missing, zero_w, zero_g = ({i % n for i in ix} for ix in (missing, zero_w, zero_g))
    for i in zero_w:
        wv[i][:] = 0
    for i in zero_g:
        gv[i][:] = 0
    for i, val in bad:
        if SIZES[i]:
            gv[i][SIZES[i] // 2] = val
    ws, gs = arena_w.views(wv), arena_g.views(gv)
    gs = [None if i in missing else g for i, g in enumerate(gs)]
    eta = rng.uniform(1e-3, 1e-2, n).astype(np.float32)
    wd = rng.uniform(0, 1e-3, n).astype(np.float32)
    eps = np.float32(1e-9)
    adapt = [bool(x) for x in rng.integers(0, 2, n)]
    adapt[-1] = adapt[-2] = True
    out = F.lars_ratios(ws, gs, trust_coefficient=eta, weight_decay=wd, eps=float(eps),
                        adapt=adapt, out=poisoned(n))
    r, wn, gn = ref_lars([f64(w) for w in ws], [f64(g, s) for g, s in zip(gs, SIZES)],
                         eta.astype(np.float64), wd.astype(np.float64), float(eps),
                         np.array(adapt))
    problems = []
    for name, got, want in (("ratio", out.ratio, r), ("w_norm", out.w_norm, wn),
                            ("g_norm", out.o_norm, gn)):
        e = rel_err(got.numpy(), want)
        if not (e <= 1e-6).all():
            i = int(np.argmax(e))
            problems.append(f"{name}[{i}] (size {SIZES[i]}): {got[i].item()!r} vs {want[i]!r}, "
                            f"rel err {e[i]:.3g}")
    expect_bad = sum(1 for i, _ in bad if SIZES[i])
    if int(out.nonfinite.item()) != expect_bad:
        problems.append(f"nonfinite flag {int(out.nonfinite.item())}, expected {expect_bad}")
    if not (arena_w.canaries_intact() and arena_g.canaries_intact()):
        problems.append("a canary changed: out-of-bounds write")
    tab = F.table(ws, gs, adapt=adapt)
    if int(tab.tickets.abs().sum()) != 0:
        problems.append("tickets not reset")
    return problems, out


# ---------------------------------------------------------------------------------------------
# the emulator itself
# ---------------------------------------------------------------------------------------------

def test_selftest_warp_shuffles_follow_cuda_semantics(emu):
    out = np.zeros(64 * 6, np.int32)
    emu.launch("hlcpu_selftest_shfl", 1, 64, [np.uint64(out.ctypes.data)])
    lane = np.arange(64) % 32
    o = out.reshape(64, 6)
    np.testing.assert_array_equal(o[:, 0], np.where(lane + 1 < 32, lane + 1, lane))
    np.testing.assert_array_equal(o[:, 1], np.where(lane >= 2, lane - 2, lane))
    np.testing.assert_array_equal(o[:, 2], lane ^ 5)
    np.testing.assert_array_equal(o[:, 3], np.full(64, 7))
    np.testing.assert_array_equal(o[:, 4], np.where(lane % 8 + 3 < 8, lane + 3, lane))
    np.testing.assert_array_equal(o[:, 5], (lane & ~3) + (lane + 1) % 4)


@pytest.mark.parametrize("policy", [0, 1, 2])
def test_selftest_atomics_and_shared_memory(emu, policy):
    counter, olds = np.zeros(1, np.int32), np.zeros(3 * 128, np.int32)
    emu.launch("hlcpu_selftest_atomic", 3, 128, [np.uint64(counter.ctypes.data),
                                                 np.uint64(olds.ctypes.data)], policy=policy)
    assert counter[0] == 384 and sorted(olds) == list(range(384))
    out = np.zeros(2 * 256, np.int32)
    want = np.concatenate([10 * (255 - np.arange(256)) + b for b in range(2)])
    emu.launch("hlcpu_selftest_shared", 2, 256, [np.uint64(out.ctypes.data), np.int32(1)],
               policy=policy)
    np.testing.assert_array_equal(out, want)
    if policy != 2:  # without the barrier a warp reads slots others have not written yet
        emu.launch("hlcpu_selftest_shared", 2, 256, [np.uint64(out.ctypes.data), np.int32(0)],
                   policy=policy)
        assert not np.array_equal(out, want)


@pytest.mark.parametrize("kernel,message", [
    ("hlcpu_selftest_exit_before_barrier", r"deadlock .* 63 wait at __syncthreads .* 1 exited"),
    ("hlcpu_selftest_divergent_barrier", r"divergent __syncthreads"),
    ("hlcpu_selftest_missing_lane", r"deadlock .* wait at a warp operation"),
    ("hlcpu_selftest_read_outside_mask", r"reads lane 20, which is not in the mask"),
    ("hlcpu_selftest_bad_syncwarp", r"lacks the calling lane"),
])
def test_selftest_reports_misuse(emu, kernel, message):
    out = np.zeros(64, np.int32)
    with pytest.raises(H.EmulatorError, match=message):
        emu.launch(kernel, 2, 64, [np.uint64(out.ctypes.data)])


# ---------------------------------------------------------------------------------------------
# the kernel's pieces
# ---------------------------------------------------------------------------------------------

def test_constants_match_the_cu_file():
    src = H.SOURCE.read_text()
    defs = dict(re.findall(r"^#define (HL_\w+) (\d+)", src, re.M))
    for name in ("DESC_WORDS", "HP_WORDS", "F32", "F16", "BF16", "MODE_LARS", "MODE_LAMB_NORMS",
                 "MODE_LAMB_FUSED"):
        assert int(defs[f"HL_{name}"]) == getattr(K, name), name
    for prefix, names in (("HL_D_", "W G M V NUMEL FIRST META ROW"),
                          ("HL_HP_", "LR ETA WD EPS BETA1 BETA2 BC1 BC2 OMB1 OMB2 TMIN TMAX")):
        for n in names.split():
            assert int(defs[prefix + n]) == getattr(K, prefix[3:] + n), prefix + n
    assert int(defs["HL_MAX_THREADS"]) == K.KERNELS["hl_norms_pass1"] == K.KERNELS["hl_lars_apply"]
    assert int(defs["HL_MAX_THREADS_LAMB"]) == K.KERNELS["hl_lamb_pass1"]
    for name in K.KERNELS:
        assert re.search(rf'extern "C" __global__ .*\n{name}\(', src), name


def test_half_conversions_exhaustive(emu):
    bits = np.arange(65536, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = emu.convert("hlcpu_f16_to_f32", bits, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)],
                                  want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all()
    bf = (bits.astype(np.uint32) << 16).view(np.float32)
    got = emu.convert("hlcpu_bf16_to_f32", bits, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), bf.view(np.uint32))
    # float32 -> 16 bits, round to nearest even: random bit patterns plus every tie and edge
    rng = np.random.default_rng(SEED)
    x = rng.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, 65504, 65519.99, 65520, -65520, 2 ** -24, 2 ** -25,
                      1.5 * 2 ** -25, 2 ** -14, 2 ** -14 - 2 ** -26, np.inf, -np.inf, 1e-40],
                     np.float32)
    h = np.sort(bits.view(np.float16)[np.isfinite(bits.view(np.float16))].astype(np.float64))
    mids = ((h[1:] + h[:-1]) / 2).astype(np.float32)       # exact ties between fp16 neighbours
    x = np.concatenate([x, edges, mids, np.nextafter(mids, np.float32(np.inf)),
                        np.nextafter(mids, np.float32(-np.inf))]).astype(np.float32)
    finite = ~np.isnan(x)
    with np.errstate(over="ignore"):
        want16 = x.astype(np.float16).view(np.uint16)
    got16 = emu.convert("hlcpu_f16_from_f32", x, np.uint16)
    np.testing.assert_array_equal(got16[finite], want16[finite])
    assert np.isnan(got16[~finite].view(np.float16)).all()
    wantbf = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    gotbf = emu.convert("hlcpu_bf16_from_f32", x, np.uint16)
    np.testing.assert_array_equal(gotbf[finite], wantbf[finite])
    assert np.isnan((gotbf[~finite].astype(np.uint32) << 16).view(np.float32)).all()


def test_layout_gives_every_tensor_its_chunks():
    first, owner = K.build_layout([0, 5, 10, 11, 1], 5)
    assert first.tolist() == [0, 1, 2, 4, 7]
    assert owner.tolist() == [0, 1, 2, 2, 3, 3, 3, 4]
    with pytest.raises(ValueError):
        K.build_layout([3], 0)


# ---------------------------------------------------------------------------------------------
# pass 1 and pass 2 against the references
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "c{}-b{}-g{}-p{}".format(*c))
def test_lars_sweep(emu, dtype, config):
    rng = np.random.default_rng([SEED, CONFIGS.index(config), list(DTYPES).index(dtype)])
    F = fused(emu, *config)
    problems, _ = lars_case(F, DTYPES[dtype], rng, missing=(2, 6), zero_w=(3,), zero_g=(4,))
    assert not problems, f"seed {SEED}: {problems}"


def test_nonfinite_layers_are_flagged_and_others_stay_exact(emu):
    rng = np.random.default_rng(SEED)
    F = fused(emu, 100, 64, 4, 2)
    n = len(SIZES)
    bad = [(n - 1, np.inf), (n - 2, np.nan), (n - 3, -np.inf)]
    problems, out = lars_case(F, torch.float32, rng, bad=bad)
    assert not problems, f"seed {SEED}: {problems}"
    assert int(out.nonfinite) == sum(1 for i, _ in bad if SIZES[i])
    assert not torch.isfinite(out.o_norm[[i for i, _ in bad if SIZES[i]]]).any()


def test_results_are_bitwise_deterministic_across_schedules(emu):
    outs = []
    for policy, grid in ((0, None), (1, 3), (2, 5), (2, 1)):
        rng = np.random.default_rng(SEED)   # same inputs every time
        problems, out = lars_case(fused(emu, 64, 64, grid, policy, seed=policy + 11),
                                  torch.float32, rng)
        assert not problems
        outs.append(torch.cat([out.ratio, out.w_norm, out.o_norm]))
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int32), outs[0].view(torch.int32))


def np_dtype_round(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(dtype).to(torch.float32).numpy()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lars_step_matches_the_float32_model_and_the_float64_reference(emu, dtype):
    dt = DTYPES[dtype]
    rng = np.random.default_rng([SEED, 7, list(DTYPES).index(dtype)])
    sizes = SIZES
    arenas = [Arena(dt, sizes, rng) for _ in range(3)]
    w, g, buf = (a.views(make_values(rng, sizes)) for a in arenas)
    w0, g0, b0 = ([t.float().numpy().copy() for t in ts] for ts in (w, g, buf))
    hp = np.zeros((2, K.HP_WORDS), np.float32)
    hp[:, [K.HP_LR, K.HP_ETA, K.HP_WD, K.HP_EPS, K.HP_BETA1]] = [[0.5, 1e-3, 1e-4, 1e-9, 0.9],
                                                                [2.0, 2e-2, 5e-4, 1e-8, 0.8]]
    rows = [i % 2 for i in range(len(sizes))]
    adapt = [i % 4 != 1 for i in range(len(sizes))]
    F = fused(emu, 100, 64, 5, 2)
    res = F.lars_step(w, g, buf, hp, rows, adapt)
    assert all(a.canaries_intact() for a in arenas)
    for i in range(len(sizes)):
        h = hp[rows[i]]
        wd = h[K.HP_WD] if adapt[i] else np.float32(0)
        ratio = res.ratio[i].numpy()
        r_ref, _, _ = ref_lars([w0[i].astype(np.float64)], [g0[i].astype(np.float64)],
                               float(h[K.HP_ETA]), float(h[K.HP_WD]), float(h[K.HP_EPS]),
                               np.array([adapt[i]]))
        assert rel_err(ratio, r_ref[0]) <= 1e-6
        # float32 model of hl_lars_apply (rounded to the storage type only when stored)
        step = np.float32(h[K.HP_LR] * ratio)
        d = ((g0[i] + w0[i] * wd) * step).astype(np.float32)
        b = (b0[i] * h[K.HP_BETA1] + d).astype(np.float32)
        np.testing.assert_array_equal(buf[i].float().numpy(), np_dtype_round(b, dt),
                                      err_msg=f"buffer, layer {i}")
        np.testing.assert_array_equal(w[i].float().numpy(), np_dtype_round(w0[i] - b, dt),
                                      err_msg=f"w, layer {i}")
        # float64 reference of the same update
        b64 = float(h[K.HP_BETA1]) * b0[i].astype(np.float64) + \
            float(step) * (g0[i].astype(np.float64) + float(wd) * w0[i].astype(np.float64))
        tol = 1e-6 if dt == torch.float32 else 1e-2
        np.testing.assert_allclose(buf[i].double().numpy(), b64, rtol=tol,
                                   atol=tol * (np.abs(b64).max(initial=0) + 1e-30))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lamb_step_matches_the_float32_model_and_the_float64_reference(emu, dtype):
    dt = DTYPES[dtype]
    rng = np.random.default_rng([SEED, 8, list(DTYPES).index(dtype)])
    sizes = SIZES
    arenas = [Arena(dt, sizes, rng) for _ in range(4)]
    vals = [make_values(rng, sizes) for _ in range(4)]
    vals[3] = [np.abs(v) * 1e-2 for v in vals[3]]          # second moment >= 0
    w, g, m, v = (a.views(x) for a, x in zip(arenas, vals))
    w0, g0, m0, v0 = ([t.float().numpy().copy() for t in ts] for ts in (w, g, m, v))
    step_t, b1, b2 = 3, 0.9, 0.999
    hp = np.zeros((1, K.HP_WORDS), np.float32)
    hp[0, [K.HP_LR, K.HP_WD, K.HP_EPS, K.HP_BETA1, K.HP_BETA2, K.HP_BC1, K.HP_BC2, K.HP_OMB1,
           K.HP_OMB2]] = (1e-2, 1e-2, 1e-6, b1, b2, 1 - b1 ** step_t, 1 - b2 ** step_t,
                          1 - b1, 1 - b2)
    h = hp[0]
    adapt = [i % 4 != 1 for i in range(len(sizes))]
    res = fused(emu, 64, 96, 4, 1).lamb_step(w, g, m, v, hp, [0] * len(sizes), adapt)
    assert all(a.canaries_intact() for a in arenas)
    f = np.float32
    for i in range(len(sizes)):
        wd = h[K.HP_WD] if adapt[i] else f(0)
        mm = np_dtype_round(m0[i] + h[K.HP_OMB1] * (g0[i] - m0[i]), dt)
        vv = np_dtype_round(v0[i] * h[K.HP_BETA2] + (g0[i] * g0[i]) * h[K.HP_OMB2], dt)
        u = ((mm / h[K.HP_BC1]) / (np.sqrt(vv / h[K.HP_BC2]) + h[K.HP_EPS]) + w0[i] * wd)
        u = u.astype(f)
        np.testing.assert_array_equal(m[i].float().numpy(), mm, err_msg=f"m, layer {i}")
        np.testing.assert_array_equal(v[i].float().numpy(), vv, err_msg=f"v, layer {i}")
        wn, un = np.linalg.norm(w0[i].astype(np.float64)), np.linalg.norm(u.astype(np.float64))
        assert rel_err(res.w_norm[i].numpy(), wn) <= 1e-6
        assert rel_err(res.o_norm[i].numpy(), un) <= 1e-6
        want_ratio = wn / un if adapt[i] and wn > 0 and un > 0 else 1.0
        assert rel_err(res.ratio[i].numpy(), want_ratio) <= 1e-6
        w_new = np_dtype_round(w0[i] - u * f(h[K.HP_LR] * res.ratio[i].numpy()), dt)
        np.testing.assert_array_equal(w[i].float().numpy(), w_new, err_msg=f"w, layer {i}")


def test_lamb_norms_mode(emu):
    rng = np.random.default_rng([SEED, 9])
    ws = Arena(torch.float32, SIZES, rng).views(make_values(rng, SIZES))
    us = Arena(torch.float32, SIZES, rng).views(make_values(rng, SIZES))
    us[4].zero_()
    adapt = [i != 1 for i in range(len(SIZES))]
    res = fused(emu, 33, 64, 6, 0).lamb_ratios(ws, us, adapt=adapt, out=poisoned(len(SIZES)))
    wn = np.array([np.linalg.norm(f64(w)) for w in ws])
    un = np.array([np.linalg.norm(f64(u)) for u in us])
    with np.errstate(all="ignore"):
        want = np.where(np.array(adapt) & (wn > 0) & (un > 0), wn / un, 1.0)
    assert (rel_err(res.ratio.numpy(), want) <= 1e-6).all()
    assert (rel_err(res.o_norm.numpy(), un) <= 1e-6).all()


# ---------------------------------------------------------------------------------------------
# the optimizers and trust.py through the fused path (emulator) vs the torch path
# ---------------------------------------------------------------------------------------------

def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, dtype=dtype) * 0.1)
            for s in [(37, 19), (37,), (64, 33), (64,), (5, 3, 3, 3), (10, 64)]]


@pytest.mark.parametrize("opt", ["lars", "lamb"])
def test_optimizer_step_equals_torch_backend(emu, opt):
    from hpclb.optim import LAMB, LARS

    runs = {}
    for backend in ("torch", "fused"):
        params = _model()
        groups = [{"params": params[:4]}, {"params": params[4:], "lr": 0.05, "exclude": False}]
        o = LARS(groups, lr=0.1, momentum=0.9, weight_decay=1e-4) if opt == "lars" else \
            LAMB(groups, lr=0.01, weight_decay=0.01)
        F = fused(emu, 256, 64, 4, 0)
        gen = torch.Generator().manual_seed(SEED)
        with K.use_fused("cpu", F if backend == "fused" else None):
            for step in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                params[3].grad = None if step == 1 else params[3].grad   # a missing gradient
                for gr in o.param_groups:
                    gr["lr"] *= 0.5                                     # LR changes each step
                o.step()
        if backend == "fused":
            assert {n for n, _, _ in F.launcher.launches} == (
                {"hl_norms_pass1", "hl_lars_apply"} if opt == "lars"
                else {"hl_lamb_pass1", "hl_lamb_apply"})
            assert len(F.launcher.launches) == 6
        runs[backend] = [p.detach().clone() for p in params]
    for a, b in zip(runs["torch"], runs["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_trust_functions_use_the_installed_fused_backend(emu, caplog):
    from hpclb.optim import trust

    rng = np.random.default_rng([SEED, 3])
    ws = [torch.from_numpy(x) for x in make_values(rng, SIZES)]
    gs = [torch.from_numpy(x) for x in make_values(rng, SIZES)]
    adapt = [True] * len(ws)
    want = trust.lars_trust_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4, eps=1e-9,
                                   adapt=adapt)
    want_lamb = trust.lamb_trust_ratios(ws, gs, adapt=adapt)
    F = fused(emu, 512, 64, 3, 0)
    with K.use_fused("cpu", F), caplog.at_level("INFO"):
        assert trust.backend_for(ws) == "emulator"
        got = trust.lars_trust_ratios(ws, gs, trust_coefficient=1e-3, weight_decay=1e-4,
                                      eps=1e-9, adapt=adapt)
        got_lamb = trust.lamb_trust_ratios(ws, gs, adapt=adapt)
        norms = trust.layer_norms(ws)
        # a non-contiguous tensor keeps the torch path
        nc = [torch.randn(6, 4).t()]
        torch.testing.assert_close(trust.layer_norms(nc), torch.linalg.vector_norm(nc[0])[None])
        # layers whose weight and gradient differ in dtype keep the torch path too
        mixed = trust.lars_trust_ratios([ws[-1]], [gs[-1].half()], trust_coefficient=1e-3,
                                        weight_decay=1e-4, eps=1e-9, adapt=[True])
        torch.testing.assert_close(mixed[0], want[0][-1:], rtol=1e-3, atol=0)
    assert len(F.launcher.launches) == 3
    for a, b in zip(want + want_lamb, got + got_lamb):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=0)
    torch.testing.assert_close(norms, want[1], rtol=2e-6, atol=0)
    assert trust.backend_for(ws) == "torch"


# ---------------------------------------------------------------------------------------------
# trust-ratio clamp, non-finite layers, float64, streams, the vector path
# ---------------------------------------------------------------------------------------------

def test_clamp_in_the_kernel(emu):
    rng = np.random.default_rng([SEED, 20])
    sizes = [33, 257, 1000, 7, 100]
    ws = Arena(torch.float32, sizes, rng).views(make_values(rng, sizes))
    gs = Arena(torch.float32, sizes, rng).views(make_values(rng, sizes))
    adapt = [True, True, True, False, True]
    F = fused(emu, 64, 64, 3, 2)
    kw = dict(trust_coefficient=1e-2, weight_decay=1e-4, eps=1e-9, adapt=adapt)
    free = F.lars_ratios(ws, gs, **kw).ratio.clone()
    lo, hi = np.float32(np.quantile(free[:3].numpy(), 0.5)), np.float32(free[:3].max() / 2)
    lo = min(lo, np.float32(hi / 2))
    tmax = np.array([hi, hi, hi, hi, 0.0], np.float32)       # layer 4: no clamp (0)
    got = F.lars_ratios(ws, gs, clamp_min=lo, clamp_max=tmax, out=poisoned(5), **kw).ratio
    want = np.where(adapt, np.clip(free.numpy(), lo, hi), 1.0).astype(np.float32)
    want[4] = free[4]
    np.testing.assert_array_equal(got.numpy(), want)
    assert (got != free).any()
    # LAMB norms mode, and the torch path agrees with the kernel
    from hpclb.optim import trust
    with K.use_fused("cpu", F):
        got = trust.lamb_trust_ratios(ws, gs, adapt=adapt, trust_clamp=(float(lo), float(hi)))[0]
    want = trust.lamb_trust_ratios(ws, gs, adapt=adapt, trust_clamp=(float(lo), float(hi)))[0]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("opt", ["lars", "lamb"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step_leaves_nonfinite_layers_untouched(emu, opt, dtype):
    dt = DTYPES[dtype]
    rng = np.random.default_rng([SEED, 21, list(DTYPES).index(dtype)])
    sizes = [100, 257, 33, 1000]
    arenas = [Arena(dt, sizes, rng) for _ in range(4)]
    vals = [make_values(rng, sizes) for _ in range(4)]
    vals[3] = [np.abs(v) * 1e-2 for v in vals[3]]
    vals[1][1][5] = np.inf
    vals[1][2][0] = np.nan
    w, g, m, v = (a.views(x) for a, x in zip(arenas, vals))
    before = [[t.clone() for t in ts] for ts in (w, m, v)]
    hp = np.zeros((1, K.HP_WORDS), np.float32)
    F = fused(emu, 64, 64, 3, 1)
    if opt == "lars":
        hp[0, [K.HP_LR, K.HP_ETA, K.HP_WD, K.HP_EPS, K.HP_BETA1]] = (1.0, 1e-2, 1e-4, 1e-9, 0.9)
        res = F.lars_step(w, g, m, hp, [0] * 4, [True] * 4)
    else:
        hp[0, [K.HP_LR, K.HP_WD, K.HP_EPS, K.HP_BETA1, K.HP_BETA2, K.HP_BC1, K.HP_BC2,
               K.HP_OMB1, K.HP_OMB2]] = (1e-2, 1e-2, 1e-6, 0.9, 0.999, 0.1, 0.001, 0.1, 0.001)
        res = F.lamb_step(w, g, m, v, hp, [0] * 4, [True] * 4)
    assert int(res.nonfinite) == 2
    assert all(a.canaries_intact() for a in arenas)
    for i in (1, 2):   # bit for bit as before the step
        for now, then in zip((w, m, v), before):
            assert torch.equal(now[i].view(torch.int16 if dt != torch.float32 else torch.int32),
                               then[i].view(torch.int16 if dt != torch.float32 else torch.int32))
    for i in (0, 3):
        assert not torch.equal(w[i], before[0][i]) and not torch.equal(m[i], before[1][i])


def _model_state(o, params):
    return [t.clone() for p in params for t in o.state[p].values() if torch.is_tensor(t)]


@pytest.mark.parametrize("opt", ["lars", "lamb"])
def test_optimizer_outputs_equal_on_both_paths(emu, opt):
    """trust_clamp, a non-finite layer, nonfinite_layers and trust_ratios: fused == torch."""
    from hpclb.optim import LAMB, LARS

    runs = {}
    for backend in ("torch", "fused"):
        params = _model()
        o = LARS(params, lr=0.5, trust_clamp=(0.001, 0.02)) if opt == "lars" else \
            LAMB(params, lr=0.01, trust_clamp=(0.01, 2.0))
        F = fused(emu, 256, 64, 4, 0)
        gen = torch.Generator().manual_seed(SEED)
        out = []
        with K.use_fused("cpu", F if backend == "fused" else None):
            for step in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                if step == 2:
                    params[2].grad[0, 0] = float("nan")
                o.step()
                out.append((int(o.nonfinite_layers), o.trust_ratios.clone(), o.path))
        runs[backend] = out, [p.detach().clone() for p in params] + _model_state(o, params)
    (out_t, state_t), (out_f, state_f) = runs["torch"], runs["fused"]
    assert [x[0] for x in out_t] == [x[0] for x in out_f] == [0, 0, 1]
    assert [x[2] for x in out_t] == ["torch"] * 3 and [x[2] for x in out_f] == ["emulator"] * 3
    for (_, a, _), (_, b, _) in zip(out_t, out_f):
        assert a.shape == b.shape == (4,) and b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    for a, b in zip(state_t, state_f):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_float64_is_refused_before_launch_and_the_optimizer_falls_back(emu, caplog):
    from hpclb.optim import LARS

    F = fused(emu, 256, 64, 4, 0)
    ws = [torch.randn(4, 4, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"layer 0 is torch.float64; the fused kernel takes "
                                         r"float32, float16 and bfloat16"):
        F.lars_ratios(ws, ws, trust_coefficient=1.0, weight_decay=0.0, eps=1e-9, adapt=[True])
    assert F.launcher.launches == [] and F.counters["launches"] == 0
    model = torch.nn.Linear(5, 3).double()
    o = LARS(model.named_parameters(), lr=0.1)
    with K.use_fused("cpu", F), caplog.at_level("INFO", logger="hpclb.optim.base"):
        for _ in range(3):
            model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
            o.step()
    assert F.launcher.launches == [] and o.path == "torch"
    msgs = [r.getMessage() for r in caplog.records if "path" in r.getMessage()]
    assert msgs == ["LARS: torch path on cpu, not the fused kernel: layer 'weight' is "
                    "torch.float64; the fused kernel takes float32, float16 and bfloat16 (it "
                    "accumulates in fp32)"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_tables_and_scratch_are_keyed_by_stream(emu):
    rng = np.random.default_rng([SEED, 22])
    sizes = [100, 3000]
    ws = Arena(torch.float32, sizes, rng).views(make_values(rng, sizes))
    F = fused(emu, 64, 64, 3, 0)
    launcher = F.launcher
    tabs = {}
    for stream in (1, 2, 1):
        launcher.stream = stream
        tab = F.table(ws, ws, adapt=[True, True])
        assert tab.stream == stream
        tabs.setdefault(stream, tab)
        assert tab is tabs[stream]                       # a hit on the same stream
    assert tabs[1].partials.data_ptr() != tabs[2].partials.data_ptr()
    assert tabs[1].tickets.data_ptr() != tabs[2].tickets.data_ptr()
    norms = []
    for stream in (1, 2):
        launcher.stream = stream
        norms.append(F.norms(ws).clone())
    assert torch.equal(norms[0], norms[1])


@pytest.mark.parametrize("misalign", [False, True])
def test_vector_path_is_counted_per_launch(emu, misalign):
    from hpclb.optim import LAMB

    rng = np.random.default_rng([SEED, 23])
    sizes = [64, 256, 4096, 40, 1000]                    # multiples of 4 fp32 (16 bytes) ...
    arena_w, arena_g = Arena(torch.float32, sizes, rng, misalign), \
        Arena(torch.float32, sizes, rng, misalign)       # ... misaligned: every third view
    ws = [torch.nn.Parameter(t) for t in arena_w.views(make_values(rng, sizes))]
    for p, gr in zip(ws, arena_g.views(make_values(rng, sizes))):
        p.grad = gr
    F = fused(emu, 512, 64, 4, 0)
    o = LAMB(ws, lr=0.01)
    with K.use_fused("cpu", F):
        o.step()
    c = F.counters
    assert c["launches"] == 2 and c["chunks"] == 2 * (1 + 1 + 8 + 1 + 2)
    if misalign:   # views 2 (4096: 8 chunks) are misaligned in w and g: never vectorised
        assert c["vector_launches"] == 0 and c["vector_chunks"] == c["chunks"] - 2 * 8
    else:
        assert c["vector_launches"] == 2 and c["vector_chunks"] == c["chunks"]
    # the rule itself: a chunk whose start is not 16-byte aligned takes the scalar path
    desc = np.zeros((1, K.DESC_WORDS), np.int64)
    desc[0, [K.D_W, K.D_G, K.D_NUMEL]] = (4096, 4096 + 16, 10)
    first, owner = K.build_layout([10], 3)
    desc[0, K.D_FIRST] = first[0]
    assert K.vector_chunks(desc, owner, 3, (K.D_W, K.D_G)) == 1   # offsets 0, 12, 24, 36 bytes
    owner4 = K.build_layout([10], 4)[1]                               # offsets 0, 16, 32 bytes
    assert K.vector_chunks(desc, owner4, 4, (K.D_W, K.D_G)) == 3
    desc[0, K.D_G] = 4096 + 4                                         # g 4 bytes off
    assert K.vector_chunks(desc, owner4, 4, (K.D_W, K.D_G)) == 0
    assert K.vector_chunks(desc, owner4, 4, (K.D_W,)) == 3            # g unused: w decides


# ---------------------------------------------------------------------------------------------
# the gate catches bugs: mutants, and AddressSanitizer
# ---------------------------------------------------------------------------------------------

def _run_tests(lib: Path, tests: str, *, asan: bool = False, separate: bool = False,
               nonempty: bool = False) -> tuple[int, str]:
    """Run some of this file's tests in a subprocess on another emulator library (a mutant
    may crash: that is a catch too). Returns (exit code, output)."""
    env = dict(os.environ, HPCLB_EMULATOR_LIB=str(lib), HPCLB_EMULATOR_SMALL="1",
               HPCLB_TEST_SEED=str(SEED))
    env.pop("LD_PRELOAD", None)
    if separate:
        env["HPCLB_EMULATOR_SEPARATE"] = "1"
    if nonempty:   # no null pointers: an off-by-one read then hits a canary, not address 0
        env["HPCLB_EMULATOR_NONEMPTY"] = "1"
    if asan:
        env.update(LD_PRELOAD=H.asan_runtime() or "",
                   ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-s", "-p",
                           "no:cacheprovider", "-p", "no:faulthandler", __file__, "-k", tests], env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    if proc.returncode < 0:
        out += f"\nkilled by signal {-proc.returncode} (a crash)"
    return proc.returncode, out


@pytest.mark.skipif(bool(os.environ.get("HPCLB_EMULATOR_LIB")), reason="runs the mutants")
def test_gate_catches_a_removed_barrier(libs):
    rc, out = _run_tests(libs["no_barrier"], "test_lars_sweep")
    assert rc == 1 and "rel err" in out, f"the mutant without the barrier passed: {out[-3000:]}"


@pytest.mark.skipif(bool(os.environ.get("HPCLB_EMULATOR_LIB")), reason="runs the mutants")
def test_gate_catches_an_off_by_one_read(libs):
    rc, out = _run_tests(libs["off_by_one"], "test_lars_sweep", nonempty=True)
    assert rc == 1 and "rel err" in out, f"the off-by-one mutant passed: {out[-3000:]}"
    rc, out = _run_tests(libs["off_by_one"], "test_lars_sweep")   # with an empty tensor
    assert rc != 0, out[-3000:]


ASAN_TESTS = ("test_lars_sweep or test_lars_step or test_lamb_step or test_lamb_norms or "
              "test_nonfinite or test_selftest_atomics or test_optimizer_step or "
              "test_step_leaves_nonfinite or test_clamp_in_the_kernel")


@pytest.mark.extended  # a slower variant: make test-extended
@pytest.mark.skipif(H.asan_runtime() is None, reason="no libasan")
@pytest.mark.skipif(bool(os.environ.get("HPCLB_EMULATOR_LIB")), reason="already in a subprocess")
def test_kernel_runs_clean_under_address_sanitizer(libs):
    rc, out = _run_tests(libs["asan"], ASAN_TESTS, asan=True, separate=True)
    assert rc == 0 and "Sanitizer" not in out, out[-4000:]
    assert re.search(r"\d+ passed", out), out[-2000:]


@pytest.mark.skipif(H.asan_runtime() is None, reason="no libasan")
@pytest.mark.skipif(bool(os.environ.get("HPCLB_EMULATOR_LIB")), reason="already in a subprocess")
def test_address_sanitizer_catches_the_off_by_one_read(libs):
    rc, out = _run_tests(libs["off_by_one_asan"], "test_lars_sweep", asan=True, separate=True)
    assert rc != 0 and "heap-buffer-overflow" in out, out[-4000:]
