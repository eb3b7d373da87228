"""Step-time scaling benchmark (``make bench-scaling``): MNIST-LSTM and ResNet-50 at 1, 2 and 4
ranks (4 oversubscribes a 2-core machine), weak and strong scaling, with a compute /
communication / overlap breakdown. Writes ``results/bench_scaling.json`` and a PNG.

For each model and scaling mode, one job per rank count (the sequence 1, 2, 4 run ``--repeat``
times, rounds pooled) times, interleaved round by round (each number is the fastest round: on a
shared machine other processes only add time; the medians are in the JSON too):

* ``compute_s``: forward + backward + optimizer step, no communication;
* ``blocking_s``: the same with ``GradientSync(overlap="none")`` (all communication after
  backward);
* ``overlapped_s``: with the default overlap (``auto``: ``thread`` for MPI when the gradients
  make more than one bucket, ``nonblocking`` for one);
* ``comm_s``: the synchronisation alone (gradients ready, ``mark_all_ready()`` +
  ``synchronize()``).

Derived: ``exposed_comm_s`` = overlapped - compute; ``hidden_fraction`` = (blocking -
overlapped) / (blocking - compute); samples/s = global batch / overlapped step; efficiency: weak
= t(1) / t(p) at a fixed per-rank batch; strong = t(1) / (p t(p)) at a fixed global batch.
Inputs are random tensors of the models' real shapes (the step time does not depend on values).
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

from hpclb.bench.launch import cli_main, pyplot, run_mpi, save, save_png, write_rank0
from hpclb.bench.measure import Timer, best, conditions, interleaved, med

__all__ = [
    "BATCHES", "IMAGE", "add_common", "add_run_arguments", "batch", "build", "derive", "driver",
    "efficiencies", "main", "make_step", "measure", "merge", "plot", "report", "sync_steps",
    "worker"]

# model -> (per-rank batch for weak scaling, global batch for strong scaling)
BATCHES = {"mnist_lstm": (128, 512), "resnet50": (16, 32)}
IMAGE = 32


def build(name: str):
    """Workload ``name`` of :data:`hpclb.bench.workloads.WORKLOADS` (ResNet-50 with 10 classes),
    initialized from seed 0, and its SGD optimizer (lr 0.01, momentum 0.9) as ``(model,
    optimizer)``; KeyError for an unknown name."""
    from hpclb.bench.workloads import WORKLOADS
    torch.manual_seed(0)
    model = WORKLOADS[name]() if name != "resnet50" else WORKLOADS[name](num_classes=10)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def batch(name: str, n: int, rank: int):
    """A random batch of ``n`` samples seeded by ``rank``: float32 inputs ``[n, 28, 28]`` for
    ``mnist_lstm``, else ``[n, 3, IMAGE, IMAGE]``, and int64 labels ``[n]`` in 0-9."""
    g = torch.Generator().manual_seed(rank)
    if name == "mnist_lstm":
        x = torch.randn(n, 28, 28, generator=g)
    else:
        x = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
    return x, torch.randint(0, 10, (n,), generator=g)


def make_step(model, opt, x, y, after_backward: Callable[[], None] | None = None,
              zero: Callable[[], None] | None = None) -> Callable[[], None]:
    """One training step of ``model`` on the batch ``(x, y)`` as a function: ``zero()``
    (default ``opt.zero_grad(set_to_none=False)``), cross-entropy forward and backward,
    ``after_backward()`` when given (a GradientSync's ``synchronize``), ``opt.step()``."""
    zero = zero or (lambda: opt.zero_grad(set_to_none=False))

    def step():
        zero()
        nn.functional.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
    return step


def sync_steps(comm, name: str, x, y, modes: dict[str, str | None],
               compute: str) -> tuple[dict, list]:
    """The steps of model ``name`` on ``(x, y)`` timed side by side: compute only (key
    ``compute``) and one per key of ``modes`` with a GradientSync of that overlap mode, each on
    its own duplicate of ``comm`` (one communicator carries one GradientSync, MPI_Comm_dup):
    ``(variants by key, the syncs)``; the caller closes the syncs."""
    from hpclb.sync.gradients import GradientSync
    variants, syncs = {compute: make_step(*build(name), x, y)}, []
    for key, mode in modes.items():
        m, o = build(name)
        syncs.append(GradientSync(m.named_parameters(), comm.dup(), overlap=mode))
        variants[key] = make_step(m, o, x, y, syncs[-1].synchronize)
    return variants, syncs


def measure(comm, timer: Timer, name: str, per_rank: int, rounds: int) -> dict:
    """Model ``name`` at ``per_rank`` samples per rank, ``rounds`` interleaved rounds of compute
    only, blocking and overlapped GradientSync steps and the sync alone (seconds, slowest rank);
    returns :func:`derive` of them with the batch sizes, ranks, overlap mode, buckets and gradient
    bytes."""
    x, y = batch(name, per_rank, comm.rank)
    variants, syncs = sync_steps(comm, name, x, y, {"blocking_s": "none", "overlapped_s": None},
                                 "compute_s")
    sync_only = syncs[-1]

    def comm_only():
        sync_only.mark_all_ready()
        sync_only.synchronize()
    variants["comm_s"] = comm_only
    times = interleaved(variants, timer, rounds)
    res = derive({"per_rank_batch": per_rank, "global_batch": per_rank * comm.world_size,
                  "ranks": comm.world_size, "overlap": sync_only.overlap,
                  "buckets": len(sync_only.buckets), "gradient_bytes": sync_only.nbytes,
                  "all_s": times})
    for s in syncs:
        s.close()
    return res


def derive(entry: dict) -> dict:
    """Fill in the fastest round of each variant and what follows from them. The hidden
    fraction is left out (None) when blocking exposes less than 5% of the compute time: a
    difference of such small differences is noise."""
    times, p = entry["all_s"], entry["ranks"]
    t = {k: best(v) for k, v in times.items()}
    blocking_exposed = t["blocking_s"] - t["compute_s"]
    meaningful = p > 1 and blocking_exposed > 0.05 * t["compute_s"]
    return {**entry, **t,
            "exposed_comm_s": t["overlapped_s"] - t["compute_s"],
            "hidden_fraction": ((t["blocking_s"] - t["overlapped_s"]) / blocking_exposed
                                if meaningful else None),
            "samples_per_s": entry["global_batch"] / t["overlapped_s"],
            "median_s": {k: med(v) for k, v in times.items()}}


def merge(a: dict | None, b: dict | None) -> dict | None:
    """Two runs of the same rank count: every variant's rounds pooled, derived again."""
    if a is None or b is None:
        return a or b
    out = json.loads(json.dumps(a))
    for name, modes in b["models"].items():
        for mode, entry in modes.items():
            mine = out["models"][name][mode]
            for k, v in entry["all_s"].items():
                mine["all_s"][k] = mine["all_s"][k] + v
            out["models"][name][mode] = derive(mine)
    out["conditions"]["repeats"] = out["conditions"].get("repeats", 1) + 1
    out["conditions"]["loadavg_end"] = b["conditions"]["loadavg_end"]
    return out


def worker(args) -> int:
    """One rank of an ``mpirun`` job (``python -m hpclb.bench.scaling worker``): weak and strong
    :func:`measure` of each of ``args.models``; rank 0 writes them with the conditions to
    ``args.out`` as JSON. Returns 0."""
    from hpclb.comm.world import get_communicator
    comm = get_communicator("mpi")
    torch.set_num_threads(1)
    timer = Timer(comm)
    res = {"conditions": conditions(comm), "models": {}}
    t0 = time.perf_counter()
    for name in args.models:
        weak_b, strong_global = BATCHES[name]
        res["models"][name] = {
            "weak": measure(comm, timer, name, weak_b, args.rounds),
            "strong": measure(comm, timer, name, max(1, strong_global // comm.world_size),
                              args.rounds)}
    res["conditions"]["loadavg_end"] = os.getloadavg()
    res["conditions"]["wall_s"] = time.perf_counter() - t0
    write_rank0(comm, args.out, res)
    return 0


def efficiencies(runs: dict[int, dict]) -> dict:
    """Per model and mode: step time, samples/s and efficiency at each rank count."""
    table: dict = {}
    if 1 not in runs or runs[1] is None:
        return table
    for name in runs[1]["models"]:
        for mode in ("weak", "strong"):
            base = runs[1]["models"][name][mode]["overlapped_s"]
            rows = []
            for p, run in sorted(runs.items()):
                if run is None:
                    continue
                r = run["models"][name][mode]
                eff = base / r["overlapped_s"] if mode == "weak" else \
                    base / (p * r["overlapped_s"])
                rows.append({"ranks": p, "step_s": r["overlapped_s"],
                             "samples_per_s": r["samples_per_s"], "efficiency": eff,
                             "compute_s": r["compute_s"], "comm_s": r["comm_s"],
                             "exposed_comm_s": r["exposed_comm_s"],
                             "hidden_fraction": r["hidden_fraction"]})
            table[f"{name}/{mode}"] = rows
    return table


def report(table: dict) -> str:
    """The :func:`efficiencies` table as text: a line per model/mode and rank count (seconds,
    samples/s, efficiency, hidden fraction or ``-``)."""
    lines = [f"{'model/mode':20s} {'ranks':>5s} {'step s':>8s} {'samples/s':>10s} {'eff':>6s} "
             f"{'compute s':>9s} {'comm s':>8s} {'exposed s':>9s} {'hidden':>7s}"]
    for key, rows in table.items():
        for r in rows:
            hid = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.2f}"
            lines.append(f"{key:20s} {r['ranks']:5d} {r['step_s']:8.3f} "
                         f"{r['samples_per_s']:10.1f} {r['efficiency']:6.2f} "
                         f"{r['compute_s']:9.3f} {r['comm_s']:8.3f} "
                         f"{r['exposed_comm_s']:9.3f} {hid:>7s}")
    return "\n".join(lines)


def plot(table: dict, path: Path) -> bool:
    """Stacked bars per model/mode and rank count of compute, exposed and hidden communication
    (seconds per step), as a PNG at ``path``; False (nothing drawn) without matplotlib or
    without a row (every job failed)."""
    plt = pyplot() if table else None
    if plt is None:
        return False
    keys = list(table)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = table[key]
        xs = [str(r["ranks"]) for r in rows]
        comp = [r["compute_s"] for r in rows]
        exp_ = [max(0.0, r["exposed_comm_s"]) for r in rows]
        hid = [max(0.0, r["comm_s"] - max(0.0, r["exposed_comm_s"])) if r["ranks"] > 1 else 0
               for r in rows]
        ax.bar(xs, comp, label="compute")
        ax.bar(xs, exp_, bottom=comp, label="exposed comm")
        ax.bar(xs, hid, bottom=[c + e for c, e in zip(comp, exp_)], label="hidden comm",
               alpha=0.4)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("ranks")
        ax.set_ylabel("seconds per step")
    axes[0][0].legend(fontsize=7)
    return save_png(fig, path, 110)


def driver(args) -> int:
    """``hpclb bench scaling``: ``args.repeat`` passes of one ``mpirun`` job per rank count in
    ``args.np`` (rounds pooled across passes), then the efficiency table and the runs to
    ``args.out`` as JSON with a PNG beside it, and the table printed. Returns 0, or 1 when a job
    failed."""
    out = Path(args.out)
    tmp = out.parent / ".bench_scaling"
    tmp.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict | None] = {}
    for rep in range(args.repeat):  # alternate the rank counts: load from others hits all alike
        for np_ in args.np:
            run = run_mpi(np_, "hpclb.bench.scaling",
                          ["worker", "--rounds", str(args.rounds), "--models", *args.models],
                          tmp / f"np{np_}_{rep}.json", args.timeout, "bench-scaling")
            runs[np_] = merge(runs.get(np_), run) if rep else run
    table = efficiencies(runs)
    result = {"table": table, "runs": {f"np{p}": r for p, r in runs.items()},
              "note": "ranks share this machine's cores (os.cpu_count() = "
                      f"{os.cpu_count()}): beyond that many ranks compute time per rank grows "
                      "and strong scaling cannot improve; weak-scaling efficiency there "
                      "mostly measures the oversubscription"}
    print(f"[bench-scaling] {save(out, result, plot=lambda png: plot(table, png))}")
    print(report(table))
    return 0 if all(r is not None for r in runs.values()) else 1


def add_common(s: argparse.ArgumentParser) -> None:
    """Options of both the driver and the worker: the output JSON, timed rounds per variant, the
    models."""
    s.add_argument("--out", default="results/bench_scaling.json")
    s.add_argument("--rounds", type=int, default=5, help="timed rounds per variant")
    s.add_argument("--models", nargs="+", default=list(BATCHES), choices=list(BATCHES))


def add_run_arguments(r: argparse.ArgumentParser) -> None:
    """Options of the driver (``hpclb bench scaling``)."""
    add_common(r)
    r.add_argument("--np", type=int, nargs="+", default=[1, 2, 4])
    r.add_argument("--repeat", type=int, default=2, help="passes over the rank counts; each "
                   "variant's rounds are pooled across passes")
    r.add_argument("--timeout", type=float, default=1200.0, help="seconds per mpirun job")


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclb.bench.scaling run|worker`` (:func:`hpclb.bench.launch.cli_main`): the
    driver or one worker; returns its exit status."""
    return cli_main("hpclb.bench.scaling", __doc__, argv, add_run_arguments, driver,
                    add_common, worker)


if __name__ == "__main__":
    sys.exit(main())
