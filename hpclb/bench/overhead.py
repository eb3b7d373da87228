"""Framework overhead (``make bench-overhead``): ``hpclb train`` against a plain PyTorch loop.

Two comparisons, each on MNIST-LSTM (hpclb's recipe) and on the plug-in example's CNN
(``examples/plugin``), at the same global batch, epochs, seed, data order, Adam, LEGW schedule
and per-epoch evaluation:

* ``1proc``: ``hpclb train`` in one process against ``benchmarks/plain_loop.py`` (torch only);
* ``2ranks``: ``mpirun -n 2 hpclb train`` against the same loop under DistributedDataParallel
  over Gloo, started by ``torchrun --nproc-per-node 2``;
* ``compile``: ``hpclb train --compile`` (``torch.compile`` of the model's forward, inductor)
  against the same ``hpclb train`` run eager, 1 process (the time includes compiling).

Whole processes are timed (start to exit, seconds), in pairs: each round runs both, the order
alternating between rounds (AB, BA, ...), so load that drifts hits both sides alike. Reported:
each side's median and range, the ratio of medians and the median of the per-round ratios
(hpclb / baseline: below 1 hpclb is faster); targets: <= 1.02 against the plain loop, <= 1.0
against DDP, <= 1.0 compiled against eager. Both sides must end with the same test loss
(relative difference below ``LOSS_RTOL``): the same model trained on the same batches in the
same order, which is what makes the comparison fair. A failed run or a disagreeing result
makes the command exit 1.

Writes ``results/bench_overhead.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml

from hpclb.bench.launch import run_group, save
from hpclb.bench.measure import median_range, round_order
from hpclb.comm.launcher import mpirun_path

__all__ = ["LOSS_RTOL", "WORKLOADS", "add_run_arguments", "commands", "driver", "summarize"]

REPO = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-3  # relative test-loss difference allowed (2 ranks: sums in another order)
TARGETS = {"1proc": 1.02, "2ranks": 1.0, "compile": 1.0}
BASELINES = {"1proc": "plain PyTorch loop, 1 process",
             "2ranks": "plain loop under DDP (Gloo), torchrun, 2 ranks",
             "compile": "hpclb train eager (without --compile), 1 process"}
# what both sides train: the recipe hpclb reads and the plain loop's arguments
WORKLOADS = {
    "mnist-lstm": {"data": {"name": "mnist"}, "model": {"name": "mnist_lstm",
                                                         "hidden_size": 128}, "base_lr": 2e-3},
    "plugin-cnn": {"data": {"name": "my_data:mnist_digits"},
                   "model": {"name": "my_models:small_cnn", "channels": 8}, "base_lr": 5e-3},
}


def recipe(workload: str, args) -> dict:
    """The recipe of ``workload`` as ``hpclb train`` reads it (LEGW from B0 = 128, warmup 0.25
    epochs at B0, poly(2) decay to 0, Adam, no clipping)."""
    w = WORKLOADS[workload]
    data = dict(w["data"], **({"train_samples": args.train_samples} if args.train_samples
                              else {}))
    return {"name": f"overhead-{workload}", "data": data, "model": w["model"],
            "base_batch_size": 128, "epochs": args.epochs, "warmup_epochs": 0.25,
            "decay": {"name": "poly", "power": 2.0, "end_lr": 0.0}, "grad_clip_norm": None,
            "optimizer": "adam", "optimizers": {"adam": {"lr": w["base_lr"]}}}


def commands(workload: str, setting: str, args, where: Path) -> dict[str, tuple[list, Path]]:
    """``{"hpclb": (argv, summary path), "baseline": (argv, summary path)}`` of one round;
    ``where`` (a new directory per round: hpclb never overwrites a run) holds the recipe and
    the runs' outputs."""
    where.mkdir(parents=True)
    rec = where / "recipe.yaml"
    rec.write_text(yaml.safe_dump(recipe(workload, args), sort_keys=False))
    py = sys.executable
    train = ["-m", "hpclb", "train", str(rec), "--batch-size", str(args.batch_size),
             "--seed", "0", "--device", "cpu", "--out", str(where / "hpclb"),
             "--no-tensorboard"]  # the plain loop writes no event files either
    plain = [str(REPO / "benchmarks" / "plain_loop.py"), "--workload", workload,
             "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
             "--base-lr", str(WORKLOADS[workload]["base_lr"]), "--train-samples",
             str(args.train_samples or 0), "--out", str(where / "plain.json")]
    if setting == "1proc":
        return {"hpclb": ([py, *train], where / "hpclb" / "summary.json"),
                "baseline": ([py, *plain], where / "plain.json")}
    if setting == "compile":   # the same run with the model's forward compiled (inductor)
        eager = [*train[:train.index("--out") + 1], str(where / "eager"),
                 *train[train.index("--out") + 2:]]
        return {"hpclb": ([py, *train, "--compile"], where / "hpclb" / "summary.json"),
                "baseline": ([py, *eager], where / "eager" / "summary.json")}
    mpi = [mpirun_path(), "-n", "2", "--oversubscribe", "--bind-to", "none"]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return {"hpclb": ([*mpi, py, *train, "--expect-world-size", "2"],
                      where / "hpclb" / "summary.json"),
            "baseline": ([*torchrun, *plain, "--ddp"], where / "plain.json")}


def environment() -> dict[str, str]:
    """The runs' environment: this checkout and the plug-in example on the path, one thread
    per process (the ranks share the cores), Open MPI allowed to run as root."""
    path = [str(REPO), str(REPO / "examples" / "plugin"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")


def timed(argv: list, summary: Path, timeout_s: float) -> dict:
    """One whole process: ``{"wall_s", "final_test_loss", "final_test_accuracy"}``, or
    ``{"error": why}`` when it failed, timed out or wrote no summary."""
    summary.unlink(missing_ok=True)
    t0 = time.perf_counter()
    done = run_group(argv, environment(), timeout_s)
    wall = time.perf_counter() - t0
    if done is None:
        return {"error": f"timed out after {timeout_s:g} s: {' '.join(argv[:8])} ..."}
    rc, stdout, stderr = done
    if rc != 0 or not summary.exists():
        return {"error": f"exit {rc}: {(stdout + stderr)[-1500:]}"}
    s = json.loads(summary.read_text())
    return {"wall_s": wall, "final_test_loss": s["final_test_loss"],
            "final_test_accuracy": s["final_test_accuracy"]}


def summarize(runs: dict[str, list[dict]], setting: str) -> dict:
    """Medians, ranges and ratios (hpclb / baseline wall time) of one comparison's rounds, the
    target and whether both sides reached the same test loss and accuracy."""
    h = [r["wall_s"] for r in runs["hpclb"]]
    b = [r["wall_s"] for r in runs["baseline"]]
    paired = [x / y for x, y in zip(h, b)]
    lh, lb = runs["hpclb"][-1]["final_test_loss"], runs["baseline"][-1]["final_test_loss"]
    ratio = statistics.median(h) / statistics.median(b)
    return {"baseline": BASELINES[setting], "hpclb_wall_s": h, "baseline_wall_s": b,
            **median_range("hpclb_median_s", h, "hpclb_range_s"),
            **median_range("baseline_median_s", b, "baseline_range_s"),
            "ratio_of_medians": ratio, "paired_ratios": paired,
            **median_range("paired_ratio_median", paired, "paired_ratio_range"),
            "target": f"<= {TARGETS[setting]}", "target_met": ratio <= TARGETS[setting],
            "final_test_loss": {"hpclb": lh, "baseline": lb},
            "final_test_accuracy": {"hpclb": runs["hpclb"][-1]["final_test_accuracy"],
                                    "baseline": runs["baseline"][-1]["final_test_accuracy"]},
            "same_result": abs(lh - lb) <= LOSS_RTOL * abs(lb)}


def compare(workload: str, setting: str, args, where: Path) -> tuple[dict | None, list[str]]:
    """``args.rounds`` paired rounds of one workload and setting; the summary, or None and the
    errors when a run failed."""
    if where.exists():  # the last invocation's runs
        shutil.rmtree(where)
    runs: dict[str, list[dict]] = {"hpclb": [], "baseline": []}
    for r in range(args.rounds):
        cmds = commands(workload, setting, args, where / f"round{r + 1}")
        for side in round_order(["hpclb", "baseline"], r):
            res = timed(*cmds[side], args.timeout)
            if "error" in res:
                return None, [f"{workload}/{setting} {side}, round {r + 1}: {res['error']}"]
            runs[side].append(res)
            print(f"[bench-overhead] {workload} {setting} round {r + 1} {side}: "
                  f"{res['wall_s']:.2f} s, test loss {res['final_test_loss']:.4f}", flush=True)
    return summarize(runs, setting), []


def driver(args) -> int:
    """``hpclb bench overhead``: every workload and setting asked for, the summaries (with the
    conditions) to ``args.out`` as JSON, a table printed. Returns 0, or 1 when a run failed or
    the two sides disagree on the test loss (the targets are reported, not enforced: timings
    on a loaded machine vary)."""
    for need in (REPO / "benchmarks" / "plain_loop.py", REPO / "examples" / "plugin"):
        if not need.exists():
            print(f"error: {need} is missing: bench overhead runs from a source checkout",
                  file=sys.stderr)
            return 2
    out = Path(args.out)
    work = out.parent / ".bench_overhead"
    t0, load0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg()
    results, errors = {}, []
    for workload in args.workloads:
        for setting in args.settings:
            res, errs = compare(workload, setting, args, work / workload / setting)
            results[f"{workload}/{setting}"] = res
            errors += errs
    bad = [k for k, v in results.items() if v is not None and not v["same_result"]]
    doc = {"results": results, "errors": errors, "results_disagree": bad,
           "settings": {"global_batch_size": args.batch_size, "epochs": args.epochs,
                        "train_samples": args.train_samples or "all", "rounds": args.rounds,
                        "omp_num_threads": environment()["OMP_NUM_THREADS"]},
           "conditions": {"date": t0, "cpus": os.cpu_count(), "loadavg_start": load0,
                          "loadavg_end": os.getloadavg()}}
    print(f"[bench-overhead] {save(out, doc)}\n{report(results)}")
    for e in errors + [f"{k}: the two sides end with different test losses" for k in bad]:
        print(f"[bench-overhead] FAILED: {e}", file=sys.stderr)
    return 1 if errors or bad else 0


def report(results: dict) -> str:
    """One line per comparison: medians, ratio, paired-ratio median and range, target."""
    lines = [f"{'workload/setting':22s} {'hpclb s':>8s} {'base s':>8s} {'ratio':>6s} "
             f"{'paired':>6s} {'range':>11s}  target"]
    for k, v in results.items():
        if v is None:
            lines.append(f"{k:22s} failed")
            continue
        lo, hi = v["paired_ratio_range"]
        lines.append(f"{k:22s} {v['hpclb_median_s']:8.2f} {v['baseline_median_s']:8.2f} "
                     f"{v['ratio_of_medians']:6.3f} {v['paired_ratio_median']:6.3f} "
                     f"{lo:5.3f}-{hi:5.3f}  {v['target']} "
                     f"{'met' if v['target_met'] else 'MISSED'}")
    return "\n".join(lines)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpclb bench overhead``."""
    p.add_argument("--out", default="results/bench_overhead.json")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--settings", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--batch-size", type=int, default=1024, help="global batch (samples)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--train-samples", type=int, default=0, help="the first N training "
                   "samples (0: all 60,000)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds (hpclb, baseline)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
