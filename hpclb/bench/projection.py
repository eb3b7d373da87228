"""The closed form checked by SimGrid (``hpclb bench model --simulate``).

For each workload with a measured backward profile (ResNet-50, PTB-large), 4 GPUs a node, 16 to
1024 nodes on 200 Gb/s (HDR) links, it puts the closed form's step time with hpclb's schedule
(:func:`hpclb.bench.model.schedule_step_time`) beside the SimGrid replay of the same schedule
(:mod:`hpclb.bench.simulate`) and their ratio. First it validates the replay on the Horovod
paper's setting (Sergeev & Del Balso 2018, arXiv 1802.05799: 128 nodes x 4 P100, 25 Gb/s RoCE,
64 images per GPU, about 90 % scaling efficiency at 512 GPUs). Results: JSON at ``out`` and a
PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from hpclb.bench import model
from hpclb.bench.model import (
    BACKWARD_SHARE,
    GPUS_PER_NODE,
    LINK_EFFICIENCY,
    Calibration,
    Workload,
    schedule_step_time,
    workloads,
)
from hpclb.bench.schedule import bucket_schedule
from hpclb.bench.simulate import SimSetting, SimulatorMissing, require, simulate_many

__all__ = ["DIFFER", "HOROVOD_PUBLISHED", "SIM_NODES", "add_arguments", "compare",
           "horovod_check", "plot_compare", "run", "sim_setting"]

SIM_NODES = [16, 32, 64, 128, 256, 512, 1024]
DIFFER = 0.10               # closed form and simulation "differ" beyond this relative gap
HOROVOD_PUBLISHED = 0.90     # Sergeev & Del Balso 2018, 512 GPUs (Inception V3, ResNet-101)


def sim_setting(w: Workload, nodes: int, link_gbps: float, cal: Calibration, fusion_bytes: int,
                fp16: bool = False, max_messages: int = 16) -> SimSetting:
    """The SimGrid replay of one step of ``w`` on ``nodes`` nodes: hpclb's buckets released
    along the measured backward profile, the calibrated per-message software cost."""
    buckets = bucket_schedule(w.tensors, w.ready_fraction, w.compute_s, BACKWARD_SHARE,
                              fusion_bytes, 0.5 if fp16 else 1.0)
    return SimSetting([[n / cal.sync_efficiency, r] for n, r in buckets], w.compute_s, nodes,
                      link_gbps, cal.alpha_sw_s, LINK_EFFICIENCY, gpus_per_node=GPUS_PER_NODE,
                      max_messages=max_messages)


def _row(w: Workload, nodes: int, link: float, cal: Calibration, fusion_bytes: int, fp16: bool,
         sim: dict) -> dict:
    """One comparison row: closed form and simulation step times, efficiencies and ratio."""
    closed = schedule_step_time(w, nodes, link, cal, fusion_bytes, "hierarchical", fp16)
    return {"workload": w.name, "nodes": nodes, "gpus": nodes * GPUS_PER_NODE,
            "link_gbps": link, "compute_s": w.compute_s, "closed_step_s": closed,
            "sim_step_s": sim["step_s"], "closed_efficiency": w.compute_s / closed,
            "sim_efficiency": sim["efficiency"], "ratio_closed_over_sim": closed / sim["step_s"],
            "sim_exposed_comm_s": sim["exposed_comm_s"], "sim_wall_s": sim["sim_wall_s"]}


def compare(cal: Calibration, fusion_bytes: int, fp16: bool = False,
            nodes: list[int] = SIM_NODES, link_gbps: float = 200,
            names: tuple[str, ...] = ("resnet50", "ptb_large")) -> list[dict]:
    """Closed form and SimGrid replay for every workload of ``names`` and node count; one row
    each (:func:`_row`). Raises SimulatorMissing without SimGrid."""
    ws = [workloads()[n] for n in names]
    jobs = [(w, N) for w in ws for N in nodes]
    sims = simulate_many([sim_setting(w, N, link_gbps, cal, fusion_bytes, fp16) for w, N in jobs])
    return [_row(w, N, link_gbps, cal, fusion_bytes, fp16, s) for (w, N), s in zip(jobs, sims)]


def horovod_check(cal: Calibration, fusion_bytes: int) -> dict:
    """The replay in the Horovod paper's setting (128 nodes x 4 P100, 25 Gb/s, ResNet-50 at 64
    images per GPU, hpclb's buckets), against the published ~90 %: ``within_10_points``."""
    w = workloads("p100-horovod")["resnet50"]
    t0 = time.perf_counter()
    row = _row(w, 128, 25, cal, fusion_bytes, False,
               simulate_many([sim_setting(w, 128, 25, cal, fusion_bytes)])[0])
    row.update(published_efficiency=HOROVOD_PUBLISHED, wall_s=time.perf_counter() - t0,
               within_10_points=abs(row["sim_efficiency"] - HOROVOD_PUBLISHED) <= 0.10)
    return row


def plot_compare(rows: list[dict], path: Path) -> bool:
    """Efficiency (%) against GPUs, closed form and simulation, one panel per workload, as a
    PNG at ``path``; False (nothing drawn) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        pts = [r for r in rows if r["workload"] == name]
        gpus = [r["gpus"] for r in pts]
        ax.plot(gpus, [100 * r["closed_efficiency"] for r in pts], marker="o",
                label="closed form (hpclb schedule)")
        ax.plot(gpus, [100 * r["sim_efficiency"] for r in pts], marker="s", linestyle="--",
                label="SimGrid replay")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_xlabel(f"GPUs ({GPUS_PER_NODE} per node), {pts[0]['link_gbps']:g} Gb/s fat tree")
        ax.set_ylabel("weak-scaling efficiency (%)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def _print_compare(rows: list[dict], hv: dict) -> None:
    """The Horovod validation line and the side-by-side table."""
    print(f"\nSimGrid check, Horovod paper's setting (128 nodes x 4 P100, 25 Gb/s, ResNet-50 at "
          f"64 images per GPU, hpclb's buckets): replay {100 * hv['sim_efficiency']:.1f}%, "
          f"closed form {100 * hv['closed_efficiency']:.1f}%, published ~"
          f"{100 * HOROVOD_PUBLISHED:.0f}%: {'within' if hv['within_10_points'] else 'NOT within'}"
          f" 10 points")
    print(f"\nclosed form (hpclb schedule) vs SimGrid replay, 200 Gb/s fat tree, "
          f"{GPUS_PER_NODE} GPUs a node; efficiency and step time (ms)")
    print(f"{'workload':>10s} {'nodes':>6s} {'GPUs':>6s} {'closed':>8s} {'SimGrid':>8s} "
          f"{'closed ms':>10s} {'sim ms':>9s} {'ratio':>6s} {'sim wall s':>10s}")
    for r in rows:
        flag = "  differs > 10%" if abs(r["ratio_closed_over_sim"] - 1) > DIFFER else ""
        print(f"{r['workload']:>10s} {r['nodes']:6d} {r['gpus']:6d} "
              f"{100 * r['closed_efficiency']:7.1f}% {100 * r['sim_efficiency']:7.1f}% "
              f"{1e3 * r['closed_step_s']:10.1f} {1e3 * r['sim_step_s']:9.1f} "
              f"{r['ratio_closed_over_sim']:6.3f} {r['sim_wall_s']:10.1f}{flag}")


def run(args: argparse.Namespace) -> int:
    """``hpclb bench model [--simulate]``: the closed form (:func:`hpclb.bench.model.run`); with
    ``--simulate`` first checks SimGrid imports (else prints how to install it and returns 2),
    then validates on the Horovod setting, prints the comparison and writes ``args.sim_out``
    (JSON) and a PNG beside it. Returns 1 when the Horovod check misses by more than 10 points."""
    if args.simulate:
        try:
            require()
        except SimulatorMissing as e:
            print(f"error: --simulate: {e}", file=sys.stderr)
            return 2
    status = model.run(args)
    if not args.simulate or status:
        return status
    cal = model.calibrate(Path(args.measurements) if args.measurements else None)
    t0 = time.perf_counter()
    hv = horovod_check(cal, args.fusion_threshold_bytes)
    rows = compare(cal, args.fusion_threshold_bytes, args.fp16, args.sim_nodes)
    _print_compare(rows, hv)
    out = Path(args.sim_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"calibration": asdict(cal), "horovod_check": hv,
                               "comparison": rows, "wall_s": time.perf_counter() - t0},
                              indent=1) + "\n")
    drew = plot_compare(rows, out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if drew else "") +
          f"; simulations took {time.perf_counter() - t0:.0f} s")
    return 0 if hv["within_10_points"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The closed form's options (:func:`hpclb.bench.model.add_arguments`) and the replay's."""
    model.add_arguments(p)
    p.add_argument("--simulate", action="store_true",
                   help="also replay hpclb's sync schedule on SimGrid (python3-simgrid: make "
                        "install-simgrid) and print it beside the closed form")
    p.add_argument("--sim-out", default="results/bench_model_sim.json")
    p.add_argument("--sim-nodes", type=int, nargs="+", default=SIM_NODES,
                   help="node counts to simulate (default: %(default)s)")
