"""Allreduce and gradient-sync benchmark (``make bench-allreduce``).

``python -m hpclb.bench.allreduce run --np 2 4`` launches the worker under the venv's
``mpirun`` once per rank count (plus a Horovod job where Horovod imports), merges the results
into ``results/bench_allreduce.json`` and plots bus bandwidth against message size into
``results/bench_allreduce.png``. Every ratio compares measurements of the same job, interleaved
round by round, so load from other processes on the machine hits both sides alike.

Measured (times in seconds, bandwidths in bytes/s; bus bandwidth = 2(p-1)/p * bytes / time,
the per-link traffic of a ring allreduce, NCCL-tests' convention):

* ``raw_mpi``: mpi4py ``Allreduce`` of one fp32 buffer, 4 KiB - 256 MiB.
* ``raw_gloo``: ``torch.distributed.all_reduce`` (Gloo) of the same buffers.
* ``sync``: ``GradientSync`` of real gradient lists (ResNet-50, PTB-large LSTM, MNIST-LSTM) for
  each overlap mode and fusion threshold, against one raw Allreduce of a flat buffer of the same
  total size; ``ratio_vs_raw`` = raw time / sync time (= ratio of achieved bandwidth).
* ``step``: a ResNet-50 training step (32x32 inputs, 16 samples per rank, SGD with momentum):
  compute only (no communication), hpclb with each overlap mode, torch DDP over Gloo; in the
  Horovod job also Horovod's ``DistributedOptimizer``. ``overlap_hidden_fraction`` =
  (blocking - overlapped) / (blocking - compute only): the share of the exposed communication
  time that overlapping hides.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from hpclb.bench.launch import run_mpi
from hpclb.bench.measure import Timer, best, busbw, conditions, interleaved, iterations, med

__all__ = ["add_run_arguments", "driver", "main", "summarize_steps", "worker"]

KiB, MiB = 2 ** 10, 2 ** 20
SIZES_BYTES = [4 * KiB * 4 ** i for i in range(9)]  # 4 KiB ... 256 MiB
SYNC_WORKLOADS = ("resnet50", "ptb_large", "mnist_lstm")
MODES = ("none", "thread", "nonblocking")
THRESHOLDS_BYTES = (4 * MiB, 25 * MiB, 64 * MiB)
STEP_IMAGE, STEP_BATCH = 32, 16


# --------------------------------------------------------------------------- worker parts
def bench_raw(comm, timer: Timer, sizes: list[int], quick: bool) -> list[dict]:
    out = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4)
        ts = interleaved({"x": lambda: comm.allreduce_(buf)}, timer, iterations(nbytes, quick))
        t, tmin = med(ts["x"]), best(ts["x"])
        out.append({"bytes": nbytes, "time_s": t, "time_min_s": tmin,
                    "busbw_Bps": busbw(nbytes, tmin, comm.world_size),
                    "busbw_median_Bps": busbw(nbytes, t, comm.world_size)})
    return out


def fake_grads(name: str, seed: int = 0) -> list[nn.Parameter]:
    from hpclb.bench.workloads import gradient_shapes
    g = torch.Generator().manual_seed(seed)
    params = []
    for _, shape in gradient_shapes(name):
        p = nn.Parameter(torch.empty(shape))
        p.grad = torch.randn(shape, generator=g)
        params.append(p)
    return params


def bench_sync(comm, timer: Timer, quick: bool) -> dict:
    """GradientSync of each workload's real gradient list vs one flat raw Allreduce."""
    from hpclb.sync.gradients import GradientSync
    out = {}
    for name in SYNC_WORKLOADS if not quick else ("resnet50", "mnist_lstm"):
        params = fake_grads(name, comm.rank)
        total = sum(p.numel() for p in params)
        flat = torch.ones(total)
        configs = [(m, t) for m in MODES for t in THRESHOLDS_BYTES] \
            if name == "resnet50" and not quick else \
            [(m, 25 * MiB) for m in ("thread", "nonblocking")]
        rows = []
        for mode, threshold in configs:
            sync = GradientSync(params, comm, overlap=mode, fusion_threshold_bytes=threshold)

            def hpclb_sync():
                sync.mark_all_ready()
                sync.synchronize()

            rounds = iterations(total * 4, quick) + (2 if name == "resnet50" else 0)
            ts = interleaved({"raw": lambda buf=flat: comm.allreduce_(buf), "hpclb": hpclb_sync},
                             timer, rounds)
            sync.close()
            t_raw, t_sync = best(ts["raw"]), best(ts["hpclb"])
            paired = med([r / h for r, h in zip(ts["raw"], ts["hpclb"])])
            rows.append({"overlap": mode, "fusion_threshold_bytes": threshold,
                         "buckets": len(sync.buckets), "raw_time_s": t_raw,
                         "sync_time_s": t_sync, "ratio_vs_raw": t_raw / t_sync,
                         "ratio_vs_raw_paired_median": paired,
                         "raw_times_s": ts["raw"], "sync_times_s": ts["hpclb"],
                         "sync_busbw_Bps": busbw(total * 4, t_sync, comm.world_size),
                         "raw_busbw_Bps": busbw(total * 4, t_raw, comm.world_size)})
        out[name] = {"bytes": total * 4, "tensors": len(params), "configs": rows}
        del params, flat
    return out


def step_setup(seed: int = 0):
    from hpclb.bench.workloads import resnet50
    torch.manual_seed(seed)
    model = resnet50(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def step_data(rank: int):
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(STEP_BATCH, 3, STEP_IMAGE, STEP_IMAGE, generator=g),
            torch.randint(0, 10, (STEP_BATCH,), generator=g))


def make_step(model, opt, x, y, after_backward: Callable[[], None] | None = None,
              zero: Callable[[], None] | None = None):
    zero = zero or (lambda: opt.zero_grad(set_to_none=False))

    def step():
        zero()
        nn.functional.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
    return step


def hpclb_steps(comm, x, y, modes=MODES) -> dict[str, Callable[[], None]]:
    from hpclb.sync.gradients import GradientSync
    variants = {}
    model, opt = step_setup()
    variants["compute_only"] = make_step(model, opt, x, y)
    for mode in modes:
        model, opt = step_setup()
        sync = GradientSync(model.named_parameters(), comm, overlap=mode)
        variants[f"hpclb_{mode}"] = make_step(model, opt, x, y, sync.synchronize)
    return variants


def bench_steps(comm, timer: Timer, rounds: int, with_ddp: bool) -> dict:
    x, y = step_data(comm.rank)
    variants = hpclb_steps(comm, x, y)
    if with_ddp:
        from hpclb.dist.torch_dist import TorchCommunicator
        TorchCommunicator(device="cpu")  # the default group DDP uses (Gloo)
        model, opt = step_setup()
        ddp = nn.parallel.DistributedDataParallel(model)
        variants["ddp_gloo"] = make_step(ddp, opt, x, y)
    times = interleaved(variants, timer, rounds)
    return summarize_steps(times, comm.world_size)


def summarize_steps(times: dict[str, list[float]], p: int) -> dict:
    """The ResNet-50 step benchmark summarized from each variant's round times (seconds) at ``p``
    ranks: fastest and median step per variant, samples/s (``STEP_BATCH * p`` / fastest step) and,
    when the blocking and an overlapped hpclb variant were timed, the fastest overlap mode and the
    share of the exposed communication it hides (None when blocking exposes less than 5% of the
    compute time)."""
    t = {k: best(v) for k, v in times.items()}
    res = {"model": f"resnet50 (10 classes), {STEP_IMAGE}x{STEP_IMAGE} inputs, "
                    f"{STEP_BATCH} samples per rank, SGD momentum",
           "min_step_s": t, "median_step_s": {k: med(v) for k, v in times.items()},
           "all_step_s": times,
           "samples_per_s": {k: STEP_BATCH * p / v for k, v in t.items()}}
    modes = [m for m in ("thread", "nonblocking") if f"hpclb_{m}" in t]
    if "hpclb_none" in t and modes:
        top = min(modes, key=lambda m: t[f"hpclb_{m}"])
        exposed = t["hpclb_none"] - t["compute_only"]
        res["best_overlap_mode"] = top
        res["hpclb_step_s"] = t[f"hpclb_{top}"]
        res["exposed_comm_blocking_s"] = exposed
        # a difference of small differences is noise: only when blocking exposes >= 5%
        meaningful = exposed > 0.05 * t["compute_only"]
        res["overlap_hidden_fraction"] = (t["hpclb_none"] - t[f"hpclb_{top}"]) / exposed \
            if meaningful else None
        res["hidden_fraction_by_mode"] = {m: (t["hpclb_none"] - t[f"hpclb_{m}"]) / exposed
                                          if meaningful else None for m in modes}
    return res


def bench_horovod(comm, timer: Timer, sizes: list[int], rounds: int, quick: bool) -> dict:
    """hpclb's step first (Horovod not yet started: its background thread would load the CPU),
    then Horovod's allreduce and DistributedOptimizer step, in the same job."""
    x, y = step_data(comm.rank)
    hp = interleaved(hpclb_steps(comm, x, y, modes=("thread", "nonblocking")), timer, rounds)
    import horovod
    import horovod.torch as hvd
    hvd.init()
    model, opt = step_setup()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hv = interleaved({"horovod": make_step(model, dopt, x, y, zero=dopt.zero_grad)}, timer,
                     rounds)
    raw = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4)
        ts = interleaved({"x": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="bench")}, timer,
                         iterations(nbytes, quick))
        t, tmin = med(ts["x"]), best(ts["x"])
        raw.append({"bytes": nbytes, "time_s": t, "time_min_s": tmin,
                    "busbw_Bps": busbw(nbytes, tmin, comm.world_size)})
    t = {k: best(v) for k, v in {**hp, **hv}.items()}
    top = min(("thread", "nonblocking"), key=lambda m: t[f"hpclb_{m}"])
    return {"horovod_version": horovod.__version__, "raw_horovod": raw,
            "min_step_s": t, "median_step_s": {k: med(v) for k, v in {**hp, **hv}.items()},
            "all_step_s": {**hp, **hv},
            "hpclb_best_mode": top, "hpclb_step_s": t[f"hpclb_{top}"],
            "horovod_step_s": t["horovod"],
            "hpclb_vs_horovod": t["horovod"] / t[f"hpclb_{top}"],
            "horovod_env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}}


def worker(args) -> int:
    """One rank of the ``mpirun`` job (``python -m hpclb.bench.allreduce worker``): the ``main``
    suite (raw mpi4py and Gloo Allreduce, GradientSync, step times with DDP) or the ``horovod``
    suite; rank 0 writes the results and the conditions to ``args.out`` as JSON. Returns 0."""
    from hpclb.dist.world import get_communicator
    comm = get_communicator("mpi")
    torch.set_num_threads(1)
    timer = Timer(comm)
    sizes = [s for s in SIZES_BYTES if s <= args.max_bytes]
    res = {"conditions": conditions(comm)}
    t0 = time.perf_counter()
    if args.suite == "main":
        res["raw_mpi"] = bench_raw(comm, timer, sizes, args.quick)
        from hpclb.dist.torch_dist import TorchCommunicator
        res["raw_gloo"] = bench_raw(TorchCommunicator(device="cpu"), timer, sizes, args.quick)
        res["sync"] = bench_sync(comm, timer, args.quick)
        res["step"] = bench_steps(comm, timer, args.rounds, with_ddp=True)
    else:
        res["horovod"] = bench_horovod(comm, timer, sizes, args.rounds, args.quick)
    res["conditions"]["loadavg_end"] = os.getloadavg()
    res["conditions"]["wall_s"] = time.perf_counter() - t0
    if comm.rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    comm.barrier()
    return 0


# --------------------------------------------------------------------------- driver
def launch(np_: int, suite: str, out: Path, args, timeout_s: float) -> dict | None:
    argv = ["worker", "--suite", suite, "--rounds", str(args.rounds), "--max-bytes",
            str(args.max_bytes)] + (["--quick"] if args.quick else [])
    return run_mpi(np_, "hpclb.bench.allreduce", argv, out, timeout_s, "bench-allreduce")


def headline(runs: dict) -> dict:
    """The numbers the issue asks for, from the 2-rank runs."""
    h: dict = {}
    main2 = runs.get("np2")
    if main2:
        rn = [c for c in main2["sync"]["resnet50"]["configs"]
              if c["fusion_threshold_bytes"] == 25 * MiB]
        top = max(rn, key=lambda c: c["ratio_vs_raw"])
        st = main2["step"]
        h["hpclb_vs_raw_allreduce"] = top["ratio_vs_raw"]
        h["hpclb_vs_raw_allreduce_paired_median"] = top["ratio_vs_raw_paired_median"]
        h["hpclb_vs_raw_allreduce_config"] = {k: top[k] for k in ("overlap", "buckets",
                                                                   "fusion_threshold_bytes")}
        h["hpclb_vs_ddp_gloo"] = st["min_step_s"]["ddp_gloo"] / st["hpclb_step_s"]
        h["hpclb_vs_ddp_gloo_median"] = st["median_step_s"]["ddp_gloo"] / \
            st["median_step_s"][f"hpclb_{st['best_overlap_mode']}"]
        h["overlap_hidden_fraction"] = st["overlap_hidden_fraction"]
        h["best_overlap_mode"] = st["best_overlap_mode"]
        h.update(paired(st["all_step_s"], f"hpclb_{st['best_overlap_mode']}"))
    main4 = runs.get("np4")
    if main4:
        st4 = main4["step"]
        h["np4"] = {"hpclb_vs_ddp_gloo": st4["min_step_s"]["ddp_gloo"] / st4["hpclb_step_s"],
                    "overlap_hidden_fraction": st4["overlap_hidden_fraction"],
                    **paired(st4["all_step_s"], f"hpclb_{st4['best_overlap_mode']}")}
    hv = runs.get("horovod_np2")
    h["hpclb_vs_horovod"] = hv["horovod"]["hpclb_vs_horovod"] if hv else None
    if hv:
        a = hv["horovod"]["all_step_s"]
        h["hpclb_vs_horovod_paired_median"] = med(
            [x / y for x, y in zip(a["horovod"], a[f"hpclb_{hv['horovod']['hpclb_best_mode']}"])])
    return h


def paired(a: dict[str, list[float]], mine: str) -> dict:
    """Ratios of rounds timed side by side (same round, so under the same load), their median:
    the estimate least moved by load that changes between rounds."""
    out = {"hpclb_vs_ddp_gloo_paired_median": med([d / x for d, x in zip(a["ddp_gloo"], a[mine])])}
    hid = [(n - x) / (n - c) for n, x, c in zip(a["hpclb_none"], a[mine], a["compute_only"])
           if n > c]
    out["overlap_hidden_fraction_paired_median"] = med(hid) if hid else None
    return out


def plot(runs: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench-allreduce] matplotlib not installed (make install): no plot")
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, run in sorted(runs.items()):
        if run is None:
            continue
        p = run["conditions"]["ranks"]
        series = {"mpi4py Allreduce": run.get("raw_mpi"), "torch Gloo all_reduce":
                  run.get("raw_gloo"),
                  "Horovod allreduce": (run.get("horovod") or {}).get("raw_horovod")}
        for label, pts in series.items():
            if pts:
                ax.plot([q["bytes"] for q in pts], [q["busbw_Bps"] / 1e9 for q in pts],
                        marker="o", label=f"{label}, {p} ranks")
        for name, s in (run.get("sync") or {}).items():
            top = max(s["configs"], key=lambda c: c["ratio_vs_raw"])
            ax.scatter([s["bytes"]], [top["sync_busbw_Bps"] / 1e9], marker="*", s=150,
                       label=f"hpclb GradientSync {name}, {p} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("Allreduce bus bandwidth on this machine (ranks share its cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def driver(args) -> int:
    """``hpclb bench allreduce``: one ``mpirun`` job per rank count in ``args.np`` (and a Horovod
    job where Horovod imports; with ``--reuse`` the last run's per-job files instead), then the
    headline ratios, their targets and the runs to ``args.out`` as JSON with a PNG beside it, and
    the report printed. Returns 0; a job that failed is None in ``runs``."""
    out = Path(args.out)
    tmp = out.parent / ".bench_allreduce"
    tmp.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    if args.reuse:  # derive again from the last run's worker files, measuring nothing
        for f in sorted(tmp.glob("*_np*.json")):
            suite, np_ = f.stem.split("_np")
            run = json.loads(f.read_text())
            if suite == "main":
                run["step"] = summarize_steps(run["step"]["all_step_s"], int(np_))
            runs[f"np{np_}" if suite == "main" else f"horovod_np{np_}"] = run
        args.no_horovod = True
    for np_ in args.np if not args.reuse else []:
        runs[f"np{np_}"] = launch(np_, "main", tmp / f"main_np{np_}.json", args, args.timeout)
    import importlib.util
    if args.reuse:
        pass
    elif importlib.util.find_spec("horovod") is not None and not args.no_horovod:
        for np_ in args.horovod_np:
            runs[f"horovod_np{np_}"] = launch(np_, "horovod", tmp / f"horovod_np{np_}.json", args,
                                              args.timeout)
    else:
        print("[bench-allreduce] Horovod not installed (make install-horovod): no Horovod runs")
    result = {**headline(runs), "targets": {
        "hpclb_vs_raw_allreduce": ">= 0.95", "hpclb_vs_ddp_gloo": ">= 1.0",
        "hpclb_vs_horovod": ">= 1.5", "overlap_hidden_fraction": ">= 0.5"},
        "definitions": {
            "hpclb_vs_raw_allreduce": "bandwidth of GradientSync on ResNet-50's 161 gradients "
            "(25 MiB buckets, best overlap mode) / one mpi4py Allreduce of a flat buffer of the "
            "same 102.2 MB, 2 ranks, interleaved in one job",
            "hpclb_vs_ddp_gloo": "DDP (Gloo) step time / hpclb step time, ResNet-50, 2 ranks",
            "hpclb_vs_horovod": "Horovod DistributedOptimizer step time / hpclb step time, "
            "ResNet-50, 2 ranks, same job",
            "overlap_hidden_fraction": "(blocking step - overlapped step) / (blocking step - "
            "compute-only step), ResNet-50, 2 ranks",
            "timing": "each variant's fastest of its rounds (other jobs on the machine only add "
            "time); *_paired_median: the median over rounds of the ratio within a round (same "
            "load for both sides); rounds in a shuffled order, same on every rank"},
        "runs": runs}
    out.write_text(json.dumps(result, indent=1) + "\n")
    drew = plot(runs, out.with_suffix(".png"))
    print(f"[bench-allreduce] wrote {out}" + (f" and {out.with_suffix('.png')}" if drew else ""))
    print(report(result))
    return 0


def report(result: dict) -> str:
    f = lambda v, fmt="{:.3f}": "n/a" if v is None else fmt.format(v)  # noqa: E731
    lines = ["", "ratios (same job, interleaved; >1 means hpclb is faster):"]
    for key, target in result["targets"].items():
        pm = result.get(f"{key}_paired_median")
        lines.append(f"  {key:26s} {f(result.get(key)):>8s}   paired-round median "
                     f"{f(pm):>6s}   (target {target})")
    if result.get("np4"):
        lines.append("  at 4 ranks: " + ", ".join(f"{k} {f(v)}" for k, v in
                                                   result["np4"].items()))
    for key, run in result["runs"].items():
        if not run or "step" not in run:
            continue
        st = run["step"]
        lines.append(f"  {key}: step s (min/median) " + ", ".join(
            f"{k} {v:.3f}/{st['median_step_s'][k]:.3f}" for k, v in st["min_step_s"].items()))
        rn = run["sync"]["resnet50"]["configs"]
        lines.append(f"  {key}: ResNet-50 sync / raw Allreduce: " + ", ".join(
            f"{c['overlap']}@{c['fusion_threshold_bytes'] // MiB}MiB {c['ratio_vs_raw']:.2f}"
            for c in rn))
    return "\n".join(lines)


def add_common(s: argparse.ArgumentParser) -> None:
    s.add_argument("--out", default="results/bench_allreduce.json")
    s.add_argument("--rounds", type=int, default=10, help="timed rounds per variant")
    s.add_argument("--max-bytes", type=int, default=256 * MiB)
    s.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")


def add_run_arguments(r: argparse.ArgumentParser) -> None:
    """Options of the driver (``hpclb bench allreduce``)."""
    add_common(r)
    r.add_argument("--np", type=int, nargs="+", default=[2, 4])
    r.add_argument("--horovod-np", type=int, nargs="+", default=[2])
    r.add_argument("--no-horovod", action="store_true")
    r.add_argument("--reuse", action="store_true", help="recompute the summary from the last "
                   "run's per-job files (results/.bench_allreduce) without measuring")
    r.add_argument("--timeout", type=float, default=1200.0, help="seconds per mpirun job")


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclb.bench.allreduce run|worker``: parses ``argv`` (default ``sys.argv[1:]``)
    and runs the driver or one worker; returns its exit status."""
    p = argparse.ArgumentParser(prog="python -m hpclb.bench.allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    add_run_arguments(sub.add_parser("run"))
    w = sub.add_parser("worker")
    add_common(w)
    w.add_argument("--suite", choices=("main", "horovod"), default="main")
    args = p.parse_args(argv)
    return driver(args) if args.cmd == "run" else worker(args)


if __name__ == "__main__":
    sys.exit(main())
