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
  each overlap mode and fusion threshold, interleaved with the raw mpi4py schedules of the same
  buckets (:mod:`hpclb.bench.raw`: one flat ``Allreduce``, back-to-back ``Allreduce`` per bucket,
  pipelined ``Iallreduce``); ``ratio_vs_fastest_raw`` = fastest raw time / sync time (> 1:
  hpclb faster). The headline ``hpclb_vs_raw_allreduce`` is hpclb's fastest setting against
  the fastest raw schedule of any setting (:mod:`hpclb.bench.allreduce_report`).
* ``step``: a ResNet-50 training step (32x32 inputs, 16 samples per rank, SGD with momentum;
  ``--step-model mnist_lstm`` for a smoke test): compute only (no communication), hpclb with
  each overlap mode (25 MiB buckets), torch DDP over Gloo (``bucket_cap_mb`` 25); in the
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

import torch
from torch import nn

from hpclb.bench.launch import cli_main, run_mpi, save, write_rank0
from hpclb.bench.measure import Timer, best, busbw, conditions, interleaved, iterations, med
from hpclb.bench.scaling import BATCHES, batch, build, make_step, sync_steps

__all__ = ["add_run_arguments", "bench_sync", "driver", "main", "run_suite", "summarize_steps",
           "sync_row", "worker"]

KiB, MiB = 2 ** 10, 2 ** 20
SIZES_BYTES = [4 * KiB * 4 ** i for i in range(9)]  # 4 KiB ... 256 MiB
SYNC_WORKLOADS = ("resnet50", "ptb_large", "mnist_lstm")
MODES = ("none", "thread", "nonblocking")
PARTS = ("raw_mpi", "raw_gloo", "sync", "step")
THRESHOLDS_BYTES = (4 * MiB, 25 * MiB, 64 * MiB)
DDP_BUCKET_MB = 25  # torch DDP's default bucket_cap_mb
HOROVOD_FUSION_DEFAULT_BYTES = 64 * MiB  # Horovod 0.28's default HOROVOD_FUSION_THRESHOLD


# --------------------------------------------------------------------------- worker parts
def bench_raw(comm, timer: Timer, sizes: list[int], quick: bool, reduce=None) -> list[dict]:
    """One row per message size in ``sizes``: the median and fastest round of ``reduce(buffer)``
    (default ``comm.allreduce_``) and the bus bandwidth; with a ``reduce`` (Horovod's) the
    median's bus bandwidth is left out."""
    fn, out = reduce or comm.allreduce_, []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4)
        ts = interleaved({"x": lambda: fn(buf)}, timer, iterations(nbytes, quick))
        t, tmin = med(ts["x"]), best(ts["x"])
        row = {"bytes": nbytes, "time_s": t, "time_min_s": tmin,
               "busbw_Bps": busbw(nbytes, tmin, comm.world_size)}
        if reduce is None:
            row["busbw_median_Bps"] = busbw(nbytes, t, comm.world_size)
        out.append(row)
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


def sync_configs(name: str, quick: bool) -> list[tuple[str, int, bool]]:
    """``(overlap, fusion threshold bytes, loss_prescaled)`` timed for workload ``name``: every
    mode and threshold for ResNet-50, each mode at 25 MiB also with ``loss_prescaled`` (the
    mean at the price of a sum: no division pass, what ``hpclb train`` uses when world size
    times accumulation steps is a power of two); else the two overlapped modes at 25 MiB, the
    thread mode also prescaled."""
    if name == "resnet50" and not quick:
        return [(m, t, False) for m in MODES for t in THRESHOLDS_BYTES] + \
            [(m, 25 * MiB, True) for m in MODES]
    return [(m, 25 * MiB, False) for m in ("thread", "nonblocking")] + \
        [("thread", 25 * MiB, True)]


def bench_sync(comm, timer: Timer, quick: bool, rounds: int,
               workloads=SYNC_WORKLOADS) -> dict:
    """GradientSync of each workload's real gradient list against the raw mpi4py schedules of
    the same buckets (:mod:`hpclb.bench.raw`), interleaved round by round in one job,
    ``rounds`` timed rounds per setting (``--rounds``)."""
    out = {}
    for name in workloads:
        params = fake_grads(name, comm.rank)
        rows = [sync_config(comm, timer, params, mode, threshold, rounds, prescaled)
                for mode, threshold, prescaled in sync_configs(name, quick)]
        out[name] = {"bytes": sum(p.numel() for p in params) * 4, "tensors": len(params),
                     "configs": rows}
        del params
    return out


def sync_config(comm, timer: Timer, params, mode: str, threshold: int, rounds: int,
                prescaled: bool = False) -> dict:
    """One GradientSync setting against the raw schedules of its own bucket sizes.
    ``prescaled``: ``loss_prescaled=True`` (the caller's loss carries 1/world_size; nothing is
    divided after the sum)."""
    from hpclb.bench.raw import RawSchedules
    from hpclb.sync.gradients import GradientSync
    sync = GradientSync(params, comm, overlap=mode, fusion_threshold_bytes=threshold,
                        loss_prescaled=prescaled)
    raw = RawSchedules(sync.bucket_sizes_bytes)

    def hpclb_sync():
        sync.mark_all_ready()
        sync.synchronize()

    try:
        ts = interleaved({**raw.variants(), "hpclb": hpclb_sync}, timer, rounds)
    finally:
        sync.close()
        raw.close()
    return {**sync_row(ts, raw.describe(), mode, threshold, sync.bucket_sizes_bytes,
                       comm.world_size), "loss_prescaled": prescaled}


def sync_row(ts: dict[str, list[float]], described: dict, mode: str, threshold: int,
             bucket_bytes: list[int], p: int) -> dict:
    """The JSON row of one GradientSync setting from its interleaved round times (seconds):
    each raw schedule's fastest and median round, the fastest schedule, and hpclb's ratio to it
    (> 1: hpclb faster), best-of-rounds and the median of the per-round ratios (the round's
    fastest raw schedule over hpclb's time in that round)."""
    from hpclb.bench.raw import SUM_ONLY
    t = {k: best(v) for k, v in ts.items()}
    raw_keys = [k for k in ts if k != "hpclb"]
    sum_only = [k for k in raw_keys if k[4:] in SUM_ONLY]
    fastest = min(sum_only, key=t.__getitem__)
    per_round = [min(ts[k][i] for k in sum_only) for i in range(len(ts["hpclb"]))]
    nbytes = sum(bucket_bytes)
    return {"overlap": mode, "fusion_threshold_bytes": threshold, "buckets": len(bucket_bytes),
            "bucket_bytes": bucket_bytes,
            "raw": {k[4:]: {"time_s": t[k], "median_s": med(ts[k]), "times_s": ts[k],
                            **described[k[4:]]} for k in raw_keys},
            "fastest_raw": fastest[4:], "fastest_raw_time_s": t[fastest],
            "sync_time_s": t["hpclb"], "sync_times_s": ts["hpclb"],
            "ratio_vs_fastest_raw": t[fastest] / t["hpclb"],
            "ratio_vs_fastest_raw_paired_median": med(
                [r / h for r, h in zip(per_round, ts["hpclb"])]),
            "ratio_vs_flat_allreduce": t["raw_flat_allreduce"] / t["hpclb"],
            "ratio_vs_raw_mean": t["raw_bucket_allreduce_mean"] / t["hpclb"],
            "sync_busbw_Bps": busbw(nbytes, t["hpclb"], p),
            "fastest_raw_busbw_Bps": busbw(nbytes, t[fastest], p)}


def timed_steps(comm, timer: Timer, rounds: int, model: str, x, y, modes=MODES,
                extra: dict | None = None) -> dict[str, list[float]]:
    """The compute-only step and one hpclb step per overlap mode of ``model``
    (:func:`hpclb.bench.scaling.sync_steps`: ``compute_only``, ``hpclb_<mode>``) and the
    ``extra`` variants, interleaved for ``rounds`` rounds; the syncs closed afterwards, also on
    error."""
    variants, syncs = sync_steps(comm, model, x, y, {f"hpclb_{m}": m for m in modes},
                                 "compute_only")
    try:
        return interleaved({**variants, **(extra or {})}, timer, rounds)
    finally:
        for s in syncs:
            s.close()


def step_data(comm, model: str):
    """This rank's batch for the step benchmark of ``model`` (its per-rank weak-scaling batch
    of :data:`hpclb.bench.scaling.BATCHES`)."""
    return batch(model, BATCHES[model][0], comm.rank)


def bench_steps(comm, timer: Timer, rounds: int, model: str, with_ddp: bool) -> dict:
    """Step times of ``model``: compute only, hpclb per overlap mode and DDP over Gloo
    (``bucket_cap_mb`` 25, its default), interleaved."""
    x, y = step_data(comm, model)
    extra = {}
    if with_ddp:
        from hpclb.comm.torch_dist import TorchCommunicator
        TorchCommunicator(device="cpu")  # the default group DDP uses (Gloo)
        net, opt = build(model)
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=DDP_BUCKET_MB)
        extra["ddp_gloo"] = make_step(ddp, opt, x, y)
    times = timed_steps(comm, timer, rounds, model, x, y, extra=extra)
    return summarize_steps(times, comm.world_size, model, len(x))


def summarize_steps(times: dict[str, list[float]], p: int, model: str = "resnet50",
                    per_rank: int = 16) -> dict:
    """The step benchmark summarized from each variant's round times (seconds) at ``p``
    ranks: fastest and median step per variant, samples/s (``per_rank * p`` / fastest step) and,
    when the blocking and an overlapped hpclb variant were timed, the fastest overlap mode and the
    share of the exposed communication it hides (None when blocking exposes less than 5% of the
    compute time)."""
    t = {k: best(v) for k, v in times.items()}
    res = {"model": f"{model}, {per_rank} samples per rank, SGD momentum", "workload": model,
           "per_rank_batch": per_rank,
           "min_step_s": t, "median_step_s": {k: med(v) for k, v in times.items()},
           "all_step_s": times,
           "samples_per_s": {k: per_rank * p / v for k, v in t.items()}}
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


def bench_horovod(comm, timer: Timer, sizes: list[int], rounds: int, quick: bool,
                  model: str = "resnet50") -> dict:
    """hpclb's step first (Horovod not yet started: its background thread would load the CPU),
    then Horovod's allreduce and DistributedOptimizer step, in the same job."""
    from functools import partial
    x, y = step_data(comm, model)
    hp = timed_steps(comm, timer, rounds, model, x, y, modes=("thread", "nonblocking"))
    import horovod
    import horovod.torch as hvd
    hvd.init()
    net, opt = build(model)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    hv = interleaved({"horovod": make_step(net, dopt, x, y, zero=dopt.zero_grad)}, timer,
                     rounds)
    raw = bench_raw(comm, timer, sizes, quick, partial(hvd.allreduce_, op=hvd.Sum, name="bench"))
    t = {k: best(v) for k, v in {**hp, **hv}.items()}
    top = min(("thread", "nonblocking"), key=lambda m: t[f"hpclb_{m}"])
    return {"horovod_version": horovod.__version__, "raw_horovod": raw, "workload": model,
            "min_step_s": t, "median_step_s": {k: med(v) for k, v in {**hp, **hv}.items()},
            "all_step_s": {**hp, **hv},
            "hpclb_best_mode": top, "hpclb_step_s": t[f"hpclb_{top}"],
            "horovod_step_s": t["horovod"],
            "hpclb_vs_horovod": t["horovod"] / t[f"hpclb_{top}"],
            "horovod_fusion_threshold_bytes": int(os.environ.get(
                "HOROVOD_FUSION_THRESHOLD", HOROVOD_FUSION_DEFAULT_BYTES)),
            "horovod_env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}}


def worker(args) -> int:
    """One rank of the ``mpirun`` job (``python -m hpclb.bench.allreduce worker``): the ``main``
    suite (raw mpi4py and Gloo Allreduce, GradientSync against the raw schedules, step times
    with DDP) or the ``horovod`` suite; rank 0 writes the results and the conditions to
    ``args.out`` as JSON. Returns 0; a failing part raises (the job fails, the driver says so)."""
    from hpclb.comm.world import get_communicator
    comm = get_communicator("mpi")
    torch.set_num_threads(1)
    write_rank0(comm, args.out, run_suite(comm, args))
    return 0


def run_suite(comm, args) -> dict:
    """The measurements of ``args.suite`` on ``comm`` with their conditions (what
    :func:`worker` writes)."""
    timer = Timer(comm)
    sizes = [s for s in SIZES_BYTES if s <= args.max_bytes]
    res = {"conditions": conditions(comm)}
    t0 = time.perf_counter()
    parts = {"raw_mpi": lambda: bench_raw(comm, timer, sizes, args.quick),
             "raw_gloo": lambda: bench_raw(gloo(), timer, sizes, args.quick),
             "sync": lambda: bench_sync(comm, timer, args.quick, args.rounds,
                                        args.sync_workloads),
             "step": lambda: bench_steps(comm, timer, args.rounds, args.step_model, True)} \
        if args.suite == "main" else \
        {"horovod": lambda: bench_horovod(comm, timer, sizes, args.rounds, args.quick,
                                          args.step_model)}
    res["conditions"]["part_wall_s"] = {}
    if args.suite == "main":
        parts = {k: v for k, v in parts.items() if k in args.parts}
    for key, part in parts.items():
        t = time.perf_counter()
        res[key] = part()
        res["conditions"]["part_wall_s"][key] = time.perf_counter() - t
    res["conditions"]["loadavg_end"] = os.getloadavg()
    res["conditions"]["wall_s"] = time.perf_counter() - t0
    return res


def gloo():
    """The Gloo communicator of ``torch.distributed`` (created on first use)."""
    from hpclb.comm.torch_dist import TorchCommunicator
    return TorchCommunicator(device="cpu")


# --------------------------------------------------------------------------- driver
def launch(np_: int, suite: str, out: Path, args, timeout_s: float) -> dict | None:
    argv = ["worker", "--suite", suite, "--rounds", str(args.rounds), "--max-bytes",
            str(args.max_bytes), "--step-model", args.step_model, "--sync-workloads",
            *args.sync_workloads, "--parts", *args.parts] + (["--quick"] if args.quick else [])
    return run_mpi(np_, "hpclb.bench.allreduce", argv, out, timeout_s, "bench-allreduce")


def reuse_runs(tmp: Path) -> dict:
    """The last run's per-job files in ``tmp``, summarized again (``--reuse``)."""
    runs = {}
    for f in sorted(tmp.glob("*_np*.json")):
        suite, np_ = f.stem.split("_np")
        run = json.loads(f.read_text())
        if suite == "main":
            st = run["step"]
            run["step"] = summarize_steps(st["all_step_s"], int(np_),
                                          st.get("workload", "resnet50"),
                                          st.get("per_rank_batch", 16))
        runs[f"np{np_}" if suite == "main" else f"horovod_np{np_}"] = run
    return runs


def measure_runs(args, tmp: Path) -> tuple[dict, list[str]]:
    """One job per rank count (and the Horovod jobs where Horovod imports): the runs by key,
    and a note per part skipped."""
    import importlib.util
    runs: dict = {}
    notes = []
    for np_ in args.np:
        runs[f"np{np_}"] = launch(np_, "main", tmp / f"main_np{np_}.json", args, args.timeout)
    if args.no_horovod:
        notes.append("Horovod left out (--no-horovod)")
    elif importlib.util.find_spec("horovod") is None:
        notes.append("Horovod not installed (make install-horovod): hpclb_vs_horovod skipped")
    else:
        for np_ in args.horovod_np:
            runs[f"horovod_np{np_}"] = launch(np_, "horovod", tmp / f"horovod_np{np_}.json",
                                              args, args.timeout)
    return runs, notes


def driver(args) -> int:
    """``hpclb bench allreduce``: one ``mpirun`` job per rank count in ``args.np`` (and a Horovod
    job where Horovod imports; with ``--reuse`` the last run's per-job files instead), then the
    headline ratios, their targets and the runs to ``args.out`` as JSON with a PNG beside it, and
    the report printed. Returns 0, or 1 when any job failed or a headline ratio is missing."""
    from hpclb.bench.allreduce_report import TARGETS, headline, plot, report
    out = Path(args.out)
    tmp = out.parent / ".bench_allreduce"
    tmp.mkdir(parents=True, exist_ok=True)
    if args.reuse:  # derive again from the last run's worker files, measuring nothing
        runs, notes = reuse_runs(tmp), ["--reuse: summarized from the last run's job files"]
    else:
        runs, notes = measure_runs(args, tmp)
    failed = sorted(k for k, r in runs.items() if r is None)
    result = {**headline(runs), "targets": TARGETS, "notes": notes, "failed_jobs": failed,
              "runs": runs}
    wanted = [k for k, part in (("hpclb_vs_raw_allreduce", "sync"),
                                ("hpclb_vs_ddp_gloo", "step")) if part in args.parts]
    missing = [k for k in wanted if result.get(k) is None]
    print(f"[bench-allreduce] {save(out, result, plot=lambda png: plot(runs, png))}")
    print(report(result))
    if failed or missing:
        print(f"[bench-allreduce] FAILED: jobs {failed or 'none'} failed; ratios missing: "
              f"{missing or 'none'}", file=sys.stderr)
        return 1
    return 0


def add_common(s: argparse.ArgumentParser) -> None:
    s.add_argument("--out", default="results/bench_allreduce.json")
    s.add_argument("--rounds", type=int, default=10,
                   help="timed rounds per variant of the sync, step and Horovod parts (the raw "
                        "size sweep picks its own by message size)")
    s.add_argument("--max-bytes", type=int, default=256 * MiB)
    s.add_argument("--quick", action="store_true", help="fewer iterations (smoke test)")
    s.add_argument("--step-model", default="resnet50", choices=("resnet50", "mnist_lstm"),
                   help="model of the step benchmark (hpclb, DDP, Horovod); default %(default)s")
    s.add_argument("--sync-workloads", nargs="+", default=list(SYNC_WORKLOADS),
                   choices=SYNC_WORKLOADS, help="gradient lists of the sync benchmark; the "
                   "headline uses the first")
    s.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                   help="what the main job measures (default: all); e.g. --parts sync for "
                   "GradientSync against the raw schedules alone")


def add_run_arguments(r: argparse.ArgumentParser) -> None:
    """Options of the driver (``hpclb bench allreduce``)."""
    add_common(r)
    r.add_argument("--np", type=int, nargs="+", default=[2, 4])
    r.add_argument("--horovod-np", type=int, nargs="+", default=[2])
    r.add_argument("--no-horovod", action="store_true")
    r.add_argument("--reuse", action="store_true", help="recompute the summary from the last "
                   "run's per-job files (results/.bench_allreduce) without measuring")
    r.add_argument("--timeout", type=float, default=1200.0, help="seconds per mpirun job")


def add_worker_arguments(w: argparse.ArgumentParser) -> None:
    """Options of one rank of the ``mpirun`` job: the common ones and the suite it runs."""
    add_common(w)
    w.add_argument("--suite", choices=("main", "horovod"), default="main")


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclb.bench.allreduce run|worker`` (:func:`hpclb.bench.launch.cli_main`): the
    driver or one worker; returns its exit status."""
    return cli_main("hpclb.bench.allreduce", __doc__, argv, add_run_arguments, driver,
                    add_worker_arguments, worker)


if __name__ == "__main__":
    sys.exit(main())
