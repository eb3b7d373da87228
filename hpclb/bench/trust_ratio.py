"""``hpclb bench trust-ratio``: per-layer norms + LARS trust ratios for real parameter sets.

For ResNet-50's and BERT-large's parameter shapes (:mod:`hpclb.bench.shapes`; fresh random
weights and gradients, fp32 by default) it times one call that yields every layer's ``‖w‖``,
``‖g‖`` and LARS ratio:

- CPU: the torch path of :mod:`hpclb.optim.trust` (two ``torch._foreach_norm`` calls) vs a
  per-layer loop (two norms and a ``.item()`` per layer);
- GPU (CUDA + CuPy): the fused kernel (:mod:`hpclb.optim.fused`, one launch) vs the torch path vs
  the per-layer loop, plus a whole LARS optimizer step (fused vs torch path), against the bytes
  moved (every weight and gradient read once) and the measured device-to-device copy bandwidth
  (``dst.copy_(src)`` of 1 GiB, counted as read + write).

Times are medians of ``--repeat`` runs after ``--warmup`` runs (CUDA events on the GPU,
``time.perf_counter`` on the CPU), in milliseconds. Prints a table, writes JSON (``--out``) with
``cpu`` and, when measured, ``gpu`` objects holding per parameter set ``fused_ms``,
``foreach_ms``, ``loop_ms``, ``fraction_of_copy_bandwidth`` (GPU) or ``torch_ms``, ``loop_ms``
(CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from hpclb.bench.shapes import SETS

ETA, WD, EPS = 1e-3, 1e-4, 1e-9
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextmanager
def _backend(name: str) -> Iterator[None]:
    before = os.environ.get("HPCLB_TRUST_BACKEND")
    os.environ["HPCLB_TRUST_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HPCLB_TRUST_BACKEND", None)
        else:
            os.environ["HPCLB_TRUST_BACKEND"] = before


def _make_tensors(shapes, device, dtype, seed: int = 0) -> tuple[list, list]:
    """Random weights and gradients (the gradients scaled by 1e-2) of the ``(name, shape)`` list
    ``shapes``: drawn in float32 on ``device`` from a generator seeded with ``seed``, then cast to
    ``dtype``; returns ``(weights, gradients)``."""
    g = torch.Generator(device=device).manual_seed(seed)
    ws = [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype)
          for _, s in shapes]
    gs = [torch.randn(s, generator=g, device=device, dtype=torch.float32).mul_(1e-2).to(dtype)
          for _, s in shapes]
    return ws, gs


def _adapt_flags(shapes) -> list[bool]:
    """Which layers LARS adapts: True for a parameter of two or more dimensions, False for biases
    and other vectors."""
    return [len(s) >= 2 for _, s in shapes]


def loop_ratios(ws, gs, adapt) -> list[float]:
    """The per-layer baseline: two norms and a host sync (``.item()``) per layer."""
    out = []
    for w, g, a in zip(ws, gs, adapt):
        wn, gn = w.norm(dtype=torch.float32), g.norm(dtype=torch.float32)
        r = ETA * wn / (gn + WD * wn + EPS) if a else torch.ones((), device=w.device)
        out.append(float(r.item()))
    return out


def foreach_ratios(ws, gs, adapt):
    """hpclb's torch path: two torch._foreach_norm calls and element-wise ratios."""
    from hpclb.optim.trust import lars_trust_ratios

    with _backend("torch"):
        return lars_trust_ratios(ws, gs, trust_coefficient=ETA, weight_decay=WD, eps=EPS,
                                 adapt=adapt)


def _time_cpu(fn: Callable, repeat: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeat`` calls after ``warmup`` untimed
    ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _time_cuda(fn: Callable, repeat: int, warmup: int) -> float:
    """Median time of ``fn()`` in milliseconds by CUDA events over ``repeat`` calls, after
    ``warmup`` untimed ones and a device synchronisation."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def copy_bandwidth_gbs(device, nbytes: int = 1 << 30, repeat: int = 20) -> float:
    """Measured device-to-device copy bandwidth, GB/s (1e9 B/s), read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _time_cuda(lambda: dst.copy_(src), repeat, 3)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _bench_cpu(name, shapes, dtype, repeat, warmup) -> dict:
    """CPU timings of one parameter set: the torch path and the per-layer loop (ms), bytes read
    (weights + gradients), tensor and parameter counts, GB/s and speed-up; asserts that both give
    the same ratios."""
    ws, gs = _make_tensors(shapes, "cpu", dtype)
    adapt = _adapt_flags(shapes)
    nbytes = sum(w.numel() * w.element_size() * 2 for w in ws)
    torch_ms = _time_cpu(lambda: foreach_ratios(ws, gs, adapt), repeat, warmup)
    loop_ms = _time_cpu(lambda: loop_ratios(ws, gs, adapt), repeat, warmup)
    # both give the same ratios (a sanity check, not a test)
    ref = torch.tensor(loop_ratios(ws, gs, adapt))
    assert torch.allclose(foreach_ratios(ws, gs, adapt)[0], ref, rtol=1e-4)
    return dict(n_tensors=len(ws), n_params=sum(w.numel() for w in ws), bytes_moved=nbytes,
                torch_ms=torch_ms, loop_ms=loop_ms, torch_gb_s=nbytes / torch_ms / 1e6,
                speedup_vs_loop=loop_ms / torch_ms)


def _bench_gpu(name, shapes, dtype, repeat, warmup, copy_gbs) -> dict:
    """GPU timings of one parameter set on the current CUDA device: fused kernel, torch path and
    per-layer loop (ms), a LARS step fused and on the torch path (ms), GB/s, the fraction of
    ``copy_gbs`` (GB/s) the fused kernel reaches and its largest relative difference from the torch
    path's ratios. RuntimeError when the fused kernel is unavailable."""
    from hpclb.optim import LARS
    from hpclb.optim import fused as kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    fused = kernels.fused_for(dev)
    if fused is None:
        raise RuntimeError("the fused kernel is unavailable (CuPy missing or "
                           "HPCLB_TRUST_BACKEND=torch)")
    ws, gs = _make_tensors(shapes, dev, dtype)
    adapt = _adapt_flags(shapes)
    nbytes = sum(w.numel() * w.element_size() * 2 for w in ws)

    def run_fused():
        return fused.lars_ratios(ws, gs, trust_coefficient=ETA, weight_decay=WD, eps=EPS,
                                 adapt=adapt)

    fused_ms = _time_cuda(run_fused, repeat, warmup)
    foreach_ms = _time_cuda(lambda: foreach_ratios(ws, gs, adapt), repeat, warmup)
    loop_ms = _time_cuda(lambda: loop_ratios(ws, gs, adapt), max(3, repeat // 4), 1)
    r_fused, r_torch = run_fused().ratio, foreach_ratios(ws, gs, adapt)[0]
    max_rel = float(((r_fused - r_torch).abs() / r_torch.abs().clamp_min(1e-30)).max())

    params = [torch.nn.Parameter(w.clone()) for w in ws]
    for p, g in zip(params, gs):
        p.grad = g
    step_ms = {}
    for backend in ("cupy", "torch"):
        opt = LARS(params, lr=0.1)
        with _backend("auto" if backend == "cupy" else "torch"):
            step_ms[backend] = _time_cuda(opt.step, max(3, repeat // 2), 2)
    del params
    fused_gbs = nbytes / fused_ms / 1e6
    return dict(n_tensors=len(ws), n_params=sum(w.numel() for w in ws), bytes_moved=nbytes,
                fused_ms=fused_ms, foreach_ms=foreach_ms, loop_ms=loop_ms,
                fused_gb_s=fused_gbs, foreach_gb_s=nbytes / foreach_ms / 1e6,
                fraction_of_copy_bandwidth=fused_gbs / copy_gbs,
                speedup_vs_foreach=foreach_ms / fused_ms, speedup_vs_loop=loop_ms / fused_ms,
                lars_step_fused_ms=step_ms["cupy"], lars_step_torch_ms=step_ms["torch"],
                max_rel_diff_fused_vs_torch=max_rel)


def _format_table(result: dict) -> str:
    """The result of :func:`run` as a text table: the CPU and GPU rows measured, or why the GPU was
    not measured."""
    lines = []
    if "cpu" in result:
        c = result["cpu"]
        lines.append(f"CPU ({c['threads']} threads, {result['dtype']}): torch path (two "
                     "_foreach_norm) vs per-layer loop")
        lines.append(f"{'set':<12}{'tensors':>8}{'params':>13}{'MB read':>9}{'torch ms':>10}"
                     f"{'GB/s':>7}{'loop ms':>10}{'loop/torch':>11}")
        for k, v in c["sets"].items():
            lines.append(f"{k:<12}{v['n_tensors']:>8}{v['n_params']:>13,}"
                         f"{v['bytes_moved'] / 1e6:>9.0f}{v['torch_ms']:>10.2f}"
                         f"{v['torch_gb_s']:>7.1f}{v['loop_ms']:>10.2f}"
                         f"{v['speedup_vs_loop']:>10.2f}x")
    if "gpu" in result:
        g = result["gpu"]
        lines.append(f"GPU {g['device']} ({result['dtype']}): copy bandwidth "
                     f"{g['copy_bandwidth_gb_s']:.0f} GB/s (read + write)")
        lines.append(f"{'set':<12}{'MB read':>9}{'fused ms':>10}{'GB/s':>7}{'% copy':>8}"
                     f"{'foreach ms':>12}{'loop ms':>10}{'vs foreach':>11}{'vs loop':>9}"
                     f"{'step fused':>11}{'step torch':>11}")
        for k, v in g["sets"].items():
            lines.append(f"{k:<12}{v['bytes_moved'] / 1e6:>9.0f}{v['fused_ms']:>10.3f}"
                         f"{v['fused_gb_s']:>7.0f}{100 * v['fraction_of_copy_bandwidth']:>7.1f}%"
                         f"{v['foreach_ms']:>12.3f}{v['loop_ms']:>10.2f}"
                         f"{v['speedup_vs_foreach']:>10.1f}x{v['speedup_vs_loop']:>8.1f}x"
                         f"{v['lars_step_fused_ms']:>11.3f}{v['lars_step_torch_ms']:>11.3f}")
    if "gpu_skipped" in result:
        lines.append(f"GPU: not measured ({result['gpu_skipped']})")
    return "\n".join(lines)


def run(sets: list[str], *, dtype: str = "float32", repeat: int = 5, warmup: int = 1,
        cpu: bool = True, gpu: bool = True, gpu_repeat: int = 20) -> dict:
    """Times the parameter sets ``sets`` of :data:`hpclb.bench.shapes.SETS` in ``dtype`` (a key of
    ``DTYPES``): on the CPU (``repeat`` timed runs after ``warmup``) and, with CUDA and CuPy, on the
    GPU (``gpu_repeat`` runs); returns the result described in the module docstring (``gpu_skipped``
    says why the GPU was not measured). ValueError for an unknown set."""
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise ValueError(f"unknown parameter sets {unknown}; known: {sorted(SETS)}")
    dt = DTYPES[dtype]
    result: dict = dict(benchmark="trust-ratio", dtype=dtype, torch=torch.__version__,
                        python=platform.python_version(), machine=platform.machine(),
                        eta=ETA, weight_decay=WD, eps=EPS)
    if cpu:
        result["cpu"] = dict(threads=torch.get_num_threads(), sets={
            s: _bench_cpu(s, SETS[s], dt, repeat, warmup) for s in sets})
    if gpu:
        from hpclb.optim import fused as kernels

        if not torch.cuda.is_available():
            result["gpu_skipped"] = "no CUDA device"
        elif not kernels.cupy_available():
            result["gpu_skipped"] = "CuPy not installed (pip install -e '.[gpu]')"
        else:
            copy_gbs = copy_bandwidth_gbs("cuda")
            import cupy

            result["gpu"] = dict(device=torch.cuda.get_device_name(), cupy=cupy.__version__,
                                 copy_bandwidth_gb_s=copy_gbs, sets={
                                     s: _bench_gpu(s, SETS[s], dt, gpu_repeat, 3, copy_gbs)
                                     for s in sets})
            for s, v in result["gpu"]["sets"].items():   # the flat keys too
                result["gpu"][s] = {k: v[k] for k in ("fused_ms", "foreach_ms", "loop_ms",
                                                      "fraction_of_copy_bandwidth")}
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpclb bench trust-ratio``: parameter sets, dtype, CPU and GPU repeats, warm-up
    runs, skipping either device, the output JSON."""
    p.add_argument("--sets", default="resnet50,bert_large",
                   help=f"comma-separated parameter sets ({', '.join(SETS)})")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--repeat", type=int, default=5, help="timed CPU runs (median)")
    p.add_argument("--gpu-repeat", type=int, default=20, help="timed GPU runs (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU measurements")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU measurements")
    p.add_argument("--out", help="write the JSON here (e.g. results/bench_trust_ratio.json)")


def main_args(args: argparse.Namespace) -> int:
    """Runs the benchmark with parsed options, prints the table and writes the JSON to ``args.out``
    when given; returns 0. ValueError for an unknown parameter set."""
    result = run([s for s in args.sets.split(",") if s], dtype=args.dtype, repeat=args.repeat,
                 warmup=args.warmup, cpu=not args.no_cpu, gpu=not args.no_gpu,
                 gpu_repeat=args.gpu_repeat)
    print(_format_table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
        print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclb.bench.trust_ratio``: parses ``argv`` (default ``sys.argv[1:]``) and runs
    :func:`main_args`; returns its exit status."""
    p = argparse.ArgumentParser(prog="python -m hpclb.bench.trust_ratio", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
