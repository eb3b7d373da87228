"""``hpclb bench host-overhead``: the host time hpclb adds per step over a plain torch loop.

A tiny model whose compute is nearly free (``n`` parameter tensors of 4 x 4 and 4 elements,
alternating weights and biases; the loss is ``sum((cat(params) * x)**2)``) is stepped by two
loops in one process, in interleaved blocks of ``--steps`` steps (the order alternating between
rounds, so drifting load hits both alike):

* ``plain``: ``zero_grad``, ``backward``, the LR set by hand (LEGW's formula), ``step`` of the
  bare optimizer; at more than one rank it averages the gradients itself with one flat mpi4py
  ``Allreduce`` of all of them per step (``torch.cat``, ``Allreduce`` in place, divide, copy
  back), the least a hand-written data-parallel loop does;
* ``hpclb``: the library API, :class:`hpclb.DistributedOptimizer` over the same optimizer and
  :func:`hpclb.legw`'s scheduler (``zero_grad``, ``backward``, ``step``, ``sched.step``).

Both sides use the same optimizer classes (torch's SGD with momentum and Adam, hpclb's LARS and
LAMB), so the difference is what the framework adds. Per optimizer and tensor count: each side's
microseconds per step (median and range over rounds), ``added_us`` (median of the per-round
differences hpclb - plain, and their range) and ``added_us_per_tensor``; the aims of issue 26
beside them (figures, not verdicts: 1 process <= 50 us at 16 tensors, <= 200 at 160; 2 ranks
<= 100 and <= 300). ``--np 1 2``: one process here, two ranks under ``mpirun -n 2`` (launched by
this command). Writes ``results/bench_host_overhead.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from hpclb.bench.launch import run_mpi, save
from hpclb.bench.measure import median_range, round_order

__all__ = ["AIMS_US", "OPTIMIZERS", "TinyModel", "add_run_arguments", "driver", "worker"]

OPTIMIZERS = ("sgd", "adam", "lars", "lamb")
#: (world size, parameter tensors) -> the aim for the added host time per step (us)
AIMS_US = {(1, 16): 50.0, (1, 160): 200.0, (2, 16): 100.0, (2, 160): 300.0}
BASE_BATCH, BATCH, SAMPLES, EPOCHS, WARMUP = 128, 1024, 1024 * 1000, 10.0, 0.25


class TinyModel(torch.nn.Module):
    """``n`` parameter tensors (4 x 4 weights and 4-element biases, alternating); ``forward(x)``
    with ``x`` fp32 ``[numel]`` returns the 0-d loss ``sum((cat(params) * x)**2)``."""

    def __init__(self, n: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn((4, 4) if i % 2 == 0 else (4,), generator=g))
            for i in range(n))
        self._flat = list(self.ps)   # ParameterList's indexing costs ~1.5 us a tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.cat([p.reshape(-1) for p in self._flat]) * x).square().sum()


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    """SGD (momentum 0.9), Adam (both ``foreach``: torch's per-tensor loop is its CPU default),
    LARS or LAMB over ``params`` at small LRs."""
    from hpclb.optim import LAMB, LARS

    makers = {"sgd": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
              "adam": lambda: torch.optim.Adam(params, lr=1e-4, foreach=True),
              "lars": lambda: LARS(params, lr=1e-3), "lamb": lambda: LAMB(params, lr=1e-4)}
    return makers[kind]()


def lr_at(step: int, base_lr: float) -> float:
    """LEGW's LR at ``step`` (sqrt scaling, linear warmup, poly(2) decay), by hand."""
    k = BATCH / BASE_BATCH
    total, warmup = int(EPOCHS * SAMPLES / BATCH), int(WARMUP * k * SAMPLES / BATCH)
    ramp = min(1.0, step / warmup)
    return ramp * base_lr * k ** 0.5 * (1 - max(0.0, (step - warmup) / (total - warmup))) ** 2


def plain_step(model, opt, x, comm, base_lr: float):
    """The plain loop's step function ``f(i)`` (see the module docstring)."""
    from mpi4py import MPI

    params = list(model.parameters())
    world = comm.Get_size()

    def step(i: int) -> None:
        opt.zero_grad()
        model(x).backward()
        if world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            comm.Allreduce(MPI.IN_PLACE, flat.numpy())
            flat /= world
            torch._foreach_copy_([p.grad for p in params],
                                 [t.view_as(p) for t, p in zip(flat.split(
                                     [p.numel() for p in params]), params)])
        for g in opt.param_groups:
            g["lr"] = lr_at(i, base_lr)
        opt.step()
    return step


def hpclb_step(model, opt, x):
    """hpclb's step function ``f(i)``: DistributedOptimizer and the LEGW scheduler."""
    import hpclb

    dist = hpclb.DistributedOptimizer(opt, model)
    sched = hpclb.legw(dist, base_batch_size=BASE_BATCH, batch_size=BATCH, num_samples=SAMPLES,
                       epochs=EPOCHS, base_warmup_epochs=WARMUP)

    def step(i: int) -> None:
        dist.zero_grad()
        model(x).backward()
        dist.step()
        sched.step()
    step.close = dist.close   # one GradientSync per communicator: closed after its blocks
    return step


def _block_us(step, start: int, steps: int, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        step(i)
    return (time.perf_counter() - t0) * 1e6 / steps


def measure(kind: str, n: int, steps: int, rounds: int, comm) -> dict:
    """Both sides of one optimizer and tensor count, interleaved (module docstring)."""
    base_lr = make_optimizer(kind, [torch.nn.Parameter(torch.zeros(1))]).defaults["lr"]
    x = torch.randn(sum(16 if i % 2 == 0 else 4 for i in range(n)),
                    generator=torch.Generator().manual_seed(1))
    models = {s: TinyModel(n) for s in ("plain", "hpclb")}
    steps_of = {"plain": plain_step(models["plain"], make_optimizer(kind, models[
        "plain"].parameters()), x, comm, base_lr),
        "hpclb": hpclb_step(models["hpclb"], make_optimizer(kind, models["hpclb"].parameters()),
                            x)}
    us: dict[str, list[float]] = {"plain": [], "hpclb": []}
    for side in us:                      # warm-up: state, plans, buckets
        _block_us(steps_of[side], 0, 3, comm)
    for r in range(rounds):
        for side in round_order(["plain", "hpclb"], r):
            us[side].append(_block_us(steps_of[side], 3 + r * steps, steps, comm))
    steps_of["hpclb"].close()
    added = median_range("added_us", [h - p for h, p in zip(us["hpclb"], us["plain"])])
    return {**median_range("plain_us", us["plain"]), **median_range("hpclb_us", us["hpclb"]),
            **added, "added_us_per_tensor": added["added_us"] / n,
            "aim_added_us": AIMS_US.get((comm.Get_size(), n))}


def worker(args: argparse.Namespace) -> dict:
    """Every optimizer and tensor count at this process's world size (``mpi4py``'s world);
    rank 0 writes the JSON to ``args.out`` when given. Returns the result."""
    from mpi4py import MPI

    import hpclb

    torch.set_num_threads(1)
    hpclb.init()
    comm = MPI.COMM_WORLD
    res = {kind: {str(n): measure(kind, n, args.steps, args.rounds, comm)
                  for n in args.tensors} for kind in args.optimizers}
    doc = {"world_size": comm.Get_size(), "steps": args.steps, "rounds": args.rounds,
           "results": res}
    if comm.Get_rank() == 0 and args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def report(doc: dict) -> str:
    """One line per world size, optimizer and tensor count."""
    lines = [f"{'np':>3s} {'opt':5s} {'tensors':>7s} {'plain us':>9s} {'hpclb us':>9s} "
             f"{'added us':>9s} {'range':>15s} {'per tensor':>10s}  aim"]
    for key, run in doc["runs"].items():
        for kind, rows in (run or {}).get("results", {}).items():
            for n, v in rows.items():
                lo, hi = v["added_us_range"]
                aim = "-" if v["aim_added_us"] is None else f"<= {v['aim_added_us']:g}"
                lines.append(f"{key[2:]:>3s} {kind:5s} {n:>7s} {v['plain_us']:9.0f} "
                             f"{v['hpclb_us']:9.0f} {v['added_us']:9.0f} {lo:7.0f}-{hi:<7.0f} "
                             f"{v['added_us_per_tensor']:10.2f}  {aim}")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    """``hpclb bench host-overhead``: ``--np 1`` in this process, larger world sizes under
    ``mpirun`` (:func:`hpclb.bench.launch.run_mpi`); the JSON to ``args.out``, a table printed.
    Returns 0, or 1 when a world size failed (the aims are reported, not enforced)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--tensors",
              *map(str, args.tensors), "--optimizers", *args.optimizers]
    load0, runs = os.getloadavg(), {}
    for np_ in args.np:
        if np_ == 1:
            runs["np1"] = worker(argparse.Namespace(**{**vars(args), "out": None}))
        else:
            runs[f"np{np_}"] = run_mpi(np_, "hpclb.bench.host_overhead", common,
                                       out.with_suffix(f".np{np_}.json"), args.timeout,
                                       "bench-host-overhead")
            out.with_suffix(f".np{np_}.json").unlink(missing_ok=True)
    doc = {"benchmark": "host-overhead", "runs": runs, "torch": torch.__version__,
           "conditions": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
                          "loadavg_start": load0, "loadavg_end": os.getloadavg()}}
    print(f"{report(doc)}\n{save(out, doc)}")
    return 1 if any(v is None for v in runs.values()) else 0


def add_run_arguments(p: argparse.ArgumentParser, *, worker_only: bool = False) -> None:
    """Options of ``hpclb bench host-overhead`` (and of its ``mpirun`` worker)."""
    p.add_argument("--steps", type=int, default=200, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=7, help="interleaved blocks per side")
    p.add_argument("--tensors", type=int, nargs="+", default=[16, 160],
                   help="parameter tensors of the tiny model")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    if worker_only:
        p.add_argument("--out")
        return
    p.add_argument("--np", type=int, nargs="+", default=[1, 2], help="world sizes")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mpirun job")
    p.add_argument("--out", default="results/bench_host_overhead.json")


if __name__ == "__main__":   # the mpirun worker
    _p = argparse.ArgumentParser(prog="python -m hpclb.bench.host_overhead")
    add_run_arguments(_p, worker_only=True)
    worker(_p.parse_args())
    sys.exit(0)
