"""``hpclb bench trust-ratio``: whole LARS/LAMB optimizer steps measured against the copy limit.

For ResNet-50's and BERT-large's parameter shapes (:mod:`hpclb.bench.shapes`; fresh random
weights and gradients, fp32 by default) it times ``--steps`` K back-to-back ``optimizer.step()``
calls of :class:`hpclb.optim.LARS` and :class:`hpclb.optim.LAMB`, with the kernel tables built
once (the untimed warm-up steps build and cache them).

GPU (CUDA + CuPy), per set and optimizer:

- ``kernel_ms``: device time per fused step. The stream is first held by ``torch.cuda._sleep``
  long enough for the host to queue all K steps, so the CUDA events around the K steps see the
  kernels back to back, without host gaps.
- ``host_us``: host wall time per ``step()`` call (validation, table look-up, hyper-parameter
  upload, the two launches), measured while the device is held, so no device work is in it.
  ``host_synced`` is true when a call waited for the device (the host time then includes the
  hold and is not a host overhead).
- ``bytes_per_step``: what the two kernels read and write, in words of the parameters' dtype
  per parameter: LARS 7 (pass 1 reads w, g; pass 2 reads w, g, v and writes v, w), LAMB 11
  (pass 1 reads w, g, m, v; pass 2 reads w, g, m, v and writes m, v, w); see
  ``kernels/trust_ratio.cu``. ``fraction_of_copy_bandwidth``: ``bytes_per_step / kernel time``
  over ``copy_bandwidth_gb_s``, K back-to-back ``dst.copy_(src)`` of half those bytes (a copy
  reads and writes each byte), timed the same way (``copy_gb_s`` per row;
  ``copy_bandwidth_gb_s`` the largest).
- ``step_ms_fused`` and ``step_ms_torch``: wall time per step of K steps ended by a device
  synchronisation, on the fused path and with ``HPCLB_TRUST_BACKEND=torch`` (the
  ``torch._foreach`` path); ``speedup_vs_torch`` their ratio.

Host path, on every machine: ``host_us_per_step`` of the fused step with a launcher that does
nothing (:func:`host_path`: the step plan reused) beside ``host_us_per_step_planless`` (the plan
rebuilt every step, what each step did before plans), interleaved blocks, medians and ranges;
aim <= ``host_target_us`` (100 us), a figure.

CPU: ``step_ms_torch`` (the only path there) and the bytes; the GPU fields are null and
``gpu_skipped`` says why. ``targets`` (GPU only; null with the reason on the CPU): fused step
>= 90 % of copy bandwidth on both sets, host overhead <= 50 us per step and whole step >= 1.5x
the torch path on ResNet-50. Prints a table and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Callable
from unittest.mock import patch

import torch

from hpclb.bench.launch import cli_main, save
from hpclb.bench.shapes import SETS
from hpclb.extras import gpu_extra

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: words of the parameters' dtype each fused step reads + writes per parameter
WORDS_PER_PARAM = {"lars": 7, "lamb": 11}
#: the targets asserted on a GPU: (set, optimizer or "*", field, comparison, bound)
TARGETS = [(s, o, "fraction_of_copy_bandwidth", ">=", 0.9)
           for s in ("resnet50", "bert_large") for o in ("lars", "lamb")] + \
          [("resnet50", o, "host_us", "<=", 50.0) for o in ("lars", "lamb")] + \
          [("resnet50", o, "speedup_vs_torch", ">=", 1.5) for o in ("lars", "lamb")]
#: the aim for the fused step's host time with a launcher that does nothing (a figure, not a
#: verdict: it depends on the CPU)
HOST_TARGET_US = 100.0
GPU_FIELDS = ("kernel_ms", "host_us", "host_synced", "gb_s", "copy_gb_s",
              "fraction_of_copy_bandwidth",
              "step_ms_fused", "speedup_vs_torch", "path")


def make_params(shapes, device, dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of the ``(name, shape)`` list ``shapes`` on ``device`` in ``dtype``, each with a
    gradient (weights ~ N(0, 1), gradients ~ N(0, 1e-4)), drawn in float32 from a generator
    seeded with ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g, device=device).to(dtype))
        p.grad = torch.randn(s, generator=g, device=device).mul_(1e-2).to(dtype)
        params.append(p)
    return params


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    """LARS (lr 0.1, momentum 0.9, wd 1e-4) or LAMB (lr 1e-3, wd 0.01) over ``params``."""
    from hpclb.optim import LAMB, LARS

    if kind == "lars":
        return LARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    if kind == "lamb":
        return LAMB(params, lr=1e-3, weight_decay=0.01)
    raise ValueError(f"optimizer {kind!r}: expected lars or lamb")


def bytes_per_step(kind: str, params) -> int:
    """Bytes the fused ``kind`` step reads and writes (:data:`WORDS_PER_PARAM` words/param)."""
    return sum(WORDS_PER_PARAM[kind] * p.numel() * p.element_size() for p in params)


def wall_ms_per_step(fn: Callable[[], object], steps: int, sync: Callable[[], None]) -> float:
    """Wall milliseconds per call of ``steps`` back-to-back ``fn()`` calls, ``sync()`` before the
    clock starts and before it stops."""
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps


def _sleep_cycles_per_ms() -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / max(a.elapsed_time(b), 1e-3)


def held_device_ms(fn: Callable[[], object], steps: int, host_ms_guess: float,
                   cycles_per_ms: float) -> tuple[float, float, bool]:
    """``(device ms per call, host us per call, host waited)`` for ``steps`` back-to-back
    ``fn()`` calls queued while ``torch.cuda._sleep`` holds the stream (sized from
    ``host_ms_guess``, ms per call), so that CUDA events around them time the device work alone
    and the host clock times the calls alone."""
    hold_ms = min(1.5 * host_ms_guess * steps + 20.0, 5000.0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(hold_ms * cycles_per_ms))
    a.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps, host_ms * 1e3 / steps, host_ms >= hold_ms


def copy_bandwidth_gb_s(nbytes: int, steps: int, cycles_per_ms: float) -> float:
    """GB/s (1e9 B/s, read + write counted) of ``steps`` back-to-back device-to-device copies of
  ``nbytes // 2`` bytes, timed like the optimizer steps (:func:`held_device_ms`)."""
    src = torch.ones(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms, _, _ = held_device_ms(lambda: dst.copy_(src), steps, 0.05, cycles_per_ms)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def _bench_one(kind: str, shapes, device, dtype, steps: int, warmup: int,
               cycles_per_ms: float | None) -> dict:
    params = make_params(shapes, device, dtype)
    nbytes = bytes_per_step(kind, params)
    row: dict = dict(n_tensors=len(params), n_params=sum(p.numel() for p in params),
                     bytes_per_step=nbytes, **{k: None for k in GPU_FIELDS})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with patch.dict(os.environ, {"HPCLB_TRUST_BACKEND": "torch"}):
        opt = make_optimizer(kind, params)
        wall_ms_per_step(opt.step, warmup, sync)
        row["step_ms_torch"] = wall_ms_per_step(opt.step, steps, sync)
    if cycles_per_ms is None:
        return row
    opt = make_optimizer(kind, params)
    wall_ms_per_step(opt.step, 1, sync)  # compiles the kernel, builds and caches the tables
    host_guess = wall_ms_per_step(opt.step, warmup, sync)
    row["path"] = opt.path
    row["kernel_ms"], row["host_us"], row["host_synced"] = \
        held_device_ms(opt.step, steps, host_guess, cycles_per_ms)
    row["gb_s"] = nbytes / (row["kernel_ms"] * 1e-3) / 1e9
    row["copy_gb_s"] = copy_bandwidth_gb_s(nbytes, steps, cycles_per_ms)
    row["fraction_of_copy_bandwidth"] = row["gb_s"] / row["copy_gb_s"]
    row["step_ms_fused"] = wall_ms_per_step(opt.step, steps, sync)
    row["speedup_vs_torch"] = row["step_ms_torch"] / row["step_ms_fused"]
    return row


class NullLauncher:
    """The fused kernel's launcher interface on the CPU that runs nothing: what is left of a
    step is the host work (plan check, rows, two launch calls)."""

    name, device = "null", torch.device("cpu")

    def stream_key(self) -> int:
        return 0

    def grid_for(self, n_chunks: int, block: int, kernel: str | None = None) -> int:
        return n_chunks

    def launch(self, name: str, grid: int, block: int, args) -> None:
        """Nothing."""


def _null_optimizer(kind: str, shapes) -> torch.optim.Optimizer:
    """``kind`` over parameters of ``shapes`` whose gradients and state are allocated but never
    written (no kernel runs: the pages are not even touched, BERT-large fits)."""
    params = []
    for _, s in shapes:
        p = torch.nn.Parameter(torch.empty(s))
        p.grad = torch.empty(s)
        params.append(p)
    opt = make_optimizer(kind, params)
    for p in params:
        opt.state[p].update({"momentum_buffer": torch.empty_like(p)} if kind == "lars" else
                            {"step": 0, "exp_avg": torch.empty_like(p),
                             "exp_avg_sq": torch.empty_like(p)})
    return opt


def host_path(kind: str, shapes, steps: int, rounds: int) -> dict:
    """Host microseconds per ``step()`` of ``kind`` on the fused path with :class:`NullLauncher`:
    ``host_us_per_step`` (the step plan reused, median of ``rounds`` blocks of ``steps`` steps)
    and ``host_us_per_step_planless`` (the plan rebuilt every step, as every step did before
    plans: layers gathered, flags, rows, table looked up by the tensors' addresses), blocks
    interleaved; ``planless_over_plan`` their ratio; ``*_range`` [min, max] over blocks."""
    from hpclb.optim import fused as kernels

    opt = _null_optimizer(kind, shapes)
    times: dict[str, list[float]] = {"plan": [], "planless": []}

    def planless() -> None:
        opt.invalidate_plan()
        opt.step()

    with kernels.use_fused("cpu", kernels.FusedTrust(NullLauncher())):
        opt.step()
        for _ in range(rounds):
            for name, fn in (("plan", opt.step), ("planless", planless)):
                opt.step()   # untimed: a plan left by the other block is rebuilt here
                times[name].append(1e3 * wall_ms_per_step(fn, steps, lambda: None))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return dict(host_us_per_step=med["plan"], host_us_per_step_range=[min(times["plan"]),
                                                                       max(times["plan"])],
                host_us_per_step_planless=med["planless"],
                host_us_per_step_planless_range=[min(times["planless"]),
                                                 max(times["planless"])],
                planless_over_plan=med["planless"] / med["plan"], host_path=opt.path)


def check_targets(result: dict) -> dict:
    """``{"asserted": bool, "reason": str | None, "failed": [...], "checks": [...]}`` for
    :data:`TARGETS` against ``result["sets"]``; asserted only for a GPU result (a CPU result, or
    a set not measured, gives ``asserted`` False and the reason). A row that did not run the
    fused kernel (``path`` other than ``cupy``) or a set not measured misses its targets."""
    if result.get("gpu_skipped"):
        return dict(asserted=False, reason=f"no GPU measurement: {result['gpu_skipped']}",
                    failed=[], checks=[])
    checks, failed = [], []
    for s, o, field, op, bound in TARGETS:
        row = result["sets"].get(s, {}).get(o, {})
        v = row.get(field)
        ok = v is not None and (v >= bound if op == ">=" else v <= bound) and \
            row.get("path") == "cupy" and not (field == "host_us" and row.get("host_synced"))
        checks.append(dict(set=s, optimizer=o, field=field, value=v, target=f"{op} {bound}",
                           ok=ok))
        if not ok:
            failed.append(f"{s} {o} {field} {v} (target {op} {bound})")
    return dict(asserted=True, reason=None, failed=failed, checks=checks)


def _gpu_state() -> tuple[str | None, float | None]:
    from hpclb.optim import fused as kernels

    if not torch.cuda.is_available():
        return "no CUDA device", None
    if not kernels.cupy_available():
        return f"CuPy not installed (pip install {gpu_extra()})", None
    if os.environ.get("HPCLB_TRUST_BACKEND") == "torch":
        return "HPCLB_TRUST_BACKEND=torch", None
    return None, _sleep_cycles_per_ms()


def run(sets: list[str], *, optimizers=("lars", "lamb"), dtype: str = "float32",
        steps: int = 50, warmup: int = 3, device: str = "auto", host_rounds: int = 5) -> dict:
    """Times ``optimizers`` on the parameter sets ``sets`` (keys of
    :data:`hpclb.bench.shapes.SETS`) in ``dtype`` (a key of :data:`DTYPES`) on ``device``
    (``auto``: CUDA when available), and the host path (:func:`host_path`, ``host_rounds``
    blocks of each kind; 0 skips it); returns the result of the module docstring. ValueError
    for an unknown set, optimizer or a step count < 1."""
    unknown = [s for s in sets if s not in SETS] + \
        [o for o in optimizers if o not in WORDS_PER_PARAM]
    if unknown or steps < 1 or warmup < 1:
        raise ValueError(f"unknown sets/optimizers {unknown} (known: {sorted(SETS)}, "
                         f"{sorted(WORDS_PER_PARAM)}) or --steps/--warmup < 1")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    skipped, cycles = _gpu_state() if dev.type == "cuda" else ("device is the CPU", None)
    result: dict = dict(benchmark="trust-ratio", dtype=dtype, device=str(dev), steps=steps,
                        torch=torch.__version__, python=platform.python_version(),
                        words_per_param=WORDS_PER_PARAM, gpu_skipped=skipped,
                        device_name=torch.cuda.get_device_name() if dev.type == "cuda" else
                        platform.processor() or platform.machine(), copy_bandwidth_gb_s=None)
    result["sets"] = {s: {o: _bench_one(o, SETS[s], dev, DTYPES[dtype], steps, warmup, cycles)
                          for o in optimizers} for s in sets}
    result["host_rounds"], result["host_target_us"] = host_rounds, HOST_TARGET_US
    for s in sets if host_rounds else ():
        for o in optimizers:
            result["sets"][s][o].update(host_path(o, SETS[s], steps, host_rounds))
    if cycles is not None:
        result["copy_bandwidth_gb_s"] = max(v["copy_gb_s"] for r in result["sets"].values()
                                            for v in r.values())
    result["targets"] = check_targets(result)
    return result


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(result: dict) -> str:
    """The result of :func:`run` as text: one row per set and optimizer, then the targets."""
    lines = [f"{result['device']} ({result['device_name']}, {result['dtype']}, K = "
             f"{result['steps']} steps): copy bandwidth "
             f"{_fmt(result['copy_bandwidth_gb_s'], '.0f')} GB/s",
             f"{'set':<11}{'opt':<5}{'MB/step':>8}{'kernel ms':>10}{'host us':>9}{'GB/s':>7}"
             f"{'% copy':>7}{'step fused':>11}{'step torch':>11}{'speed-up':>9}"]
    for s, r in result["sets"].items():
        for o, v in r.items():
            frac = v["fraction_of_copy_bandwidth"]
            lines.append(f"{s:<11}{o:<5}{v['bytes_per_step'] / 1e6:>8.0f}"
                         f"{_fmt(v['kernel_ms'], '.3f'):>10}{_fmt(v['host_us'], '.0f'):>9}"
                         f"{_fmt(v['gb_s'], '.0f'):>7}{_fmt(frac and 100 * frac, '.1f'):>7}"
                         f"{_fmt(v['step_ms_fused'], '.3f'):>11}{v['step_ms_torch']:>11.3f}"
                         f"{_fmt(v['speedup_vs_torch'], '.2f'):>9}")
    for s, r in result["sets"].items() if result.get("host_rounds") else ():
        for o, v in r.items():
            lines.append(f"host path {s} {o}: {v['host_us_per_step']:.0f} us per step with the "
                         f"plan, {v['host_us_per_step_planless']:.0f} us rebuilt every step "
                         f"(x{v['planless_over_plan']:.1f}; aim <= {HOST_TARGET_US:.0f} us)")
    t = result["targets"]
    lines.append("targets: " + ("not asserted (" + t["reason"] + ")" if not t["asserted"] else
                                "all met" if not t["failed"] else "MISSED " +
                                "; ".join(t["failed"])))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpclb bench trust-ratio``: parameter sets, optimizers, dtype, device, steps
    K, warm-up steps, asserting the targets, the output JSON."""
    p.add_argument("--sets", default="resnet50,bert_large",
                   help=f"comma-separated parameter sets ({', '.join(SETS)})")
    p.add_argument("--optimizers", default="lars,lamb", help="comma-separated: lars, lamb")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=50, help="K back-to-back steps timed")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (build tables)")
    p.add_argument("--host-rounds", type=int, default=5,
                   help="interleaved blocks of the host-path timing (null launcher); 0 skips")
    p.add_argument("--assert-targets", action="store_true",
                   help="exit 1 when a GPU target is missed (never on the CPU)")
    p.add_argument("--out", help="write the JSON here (e.g. results/bench_trust_ratio.json)")


def main_args(args: argparse.Namespace) -> int:
    """Runs the benchmark with parsed options, prints the table, writes the JSON to ``args.out``
    when given; returns 1 when ``--assert-targets`` and a GPU target was missed, else 0."""
    split = [s for s in args.sets.split(",") if s]
    result = run(split, optimizers=[o for o in args.optimizers.split(",") if o],
                 dtype=args.dtype, steps=args.steps, warmup=args.warmup, device=args.device,
                 host_rounds=args.host_rounds)
    print(format_table(result))
    if args.out:
        print(save(args.out, result, indent=2))
    return 1 if args.assert_targets and result["targets"]["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclb.bench.trust_ratio``: parses ``argv`` (default ``sys.argv[1:]``) and runs
    :func:`main_args`; returns its exit status."""
    return cli_main("hpclb.bench.trust_ratio", __doc__, argv, add_arguments, main_args)


if __name__ == "__main__":
    sys.exit(main())
