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
import sys
import time
from dataclasses import asdict
from pathlib import Path

from hpclb.bench import model
from hpclb.bench.fattree import PLACEMENTS, host_order, ring_link_load
from hpclb.bench.launch import save
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

__all__ = ["DIFFER", "HOROVOD_FUSION_BYTES", "HOROVOD_PUBLISHED", "SIM_NODES", "add_arguments",
           "compare", "horovod_check", "plot_compare", "run", "sim_setting"]

SIM_NODES = [16, 32, 64, 128, 256, 512, 1024]
DIFFER = 0.10               # closed form and simulation "differ" beyond this relative gap
HOROVOD_FUSION_BYTES = 64 * 2 ** 20   # Horovod's default HOROVOD_FUSION_THRESHOLD
HOROVOD_PUBLISHED = 0.90     # Sergeev & Del Balso 2018, 512 GPUs (Inception V3, ResNet-101)


def sim_setting(w: Workload, nodes: int, link_gbps: float, cal: Calibration, fusion_bytes: int,
                fp16: bool = False, placement: str = "contiguous") -> SimSetting:
    """The SimGrid replay of one step of ``w`` on ``nodes`` nodes: hpclb's buckets released
    along the measured backward profile, the calibrated per-message software cost, the nodes
    ``placement``d on the fat tree (seed 0)."""
    buckets = bucket_schedule(w.tensors, w.ready_fraction, w.compute_s, BACKWARD_SHARE,
                              fusion_bytes, 0.5 if fp16 else 1.0)
    return SimSetting([[n / cal.sync_efficiency, r] for n, r in buckets], w.compute_s, nodes,
                      link_gbps, cal.alpha_sw_s, LINK_EFFICIENCY, gpus_per_node=GPUS_PER_NODE,
                      placement=placement)


def _row(w: Workload, nodes: int, link: float, cal: Calibration, fusion_bytes: int, fp16: bool,
         sim: dict, scattered: dict | None = None) -> dict:
    """One comparison row: the closed forms (the single hidden fraction; hpclb's schedule,
    uncontended and with the scattered placement's busiest link) beside the replays; step times
    (s), efficiencies, ratios closed / simulated."""
    closed = schedule_step_time(w, nodes, link, cal, fusion_bytes, "hierarchical", fp16)
    flat = model.step_time(w, model.comm_time(w, nodes, link, cal, fusion_bytes, "hierarchical",
                                              fp16), cal.hidden_fraction)
    row = {"workload": w.name, "nodes": nodes, "gpus": nodes * GPUS_PER_NODE,
           "link_gbps": link, "compute_s": w.compute_s, "closed_step_s": closed,
           "sim_step_s": sim["step_s"], "closed_efficiency": w.compute_s / closed,
           "sim_efficiency": sim["efficiency"], "ratio_closed_over_sim": closed / sim["step_s"],
           "hidden_fraction_efficiency": w.compute_s / flat,
           "ratio_hidden_fraction_over_sim": flat / sim["step_s"], "sim_wall_s": sim["sim_wall_s"]}
    if scattered is not None:
        load = ring_link_load(host_order(nodes, "scattered", 0))
        contended = schedule_step_time(w, nodes, link, cal, fusion_bytes, "hierarchical", fp16,
                                       load)
        row.update(scattered_link_load=load, scattered_sim_efficiency=scattered["efficiency"],
                   scattered_closed_efficiency=w.compute_s / contended,
                   ratio_scattered_closed_over_sim=contended / scattered["step_s"],
                   ratio_uncontended_closed_over_scattered_sim=closed / scattered["step_s"],
                   sim_wall_s=sim["sim_wall_s"] + scattered["sim_wall_s"])
    return row


def compare(cal: Calibration, fusion_bytes: int, fp16: bool = False,
            nodes: list[int] = SIM_NODES, link_gbps: float = 200,
            names: tuple[str, ...] = ("resnet50", "ptb_large")) -> list[dict]:
    """Closed forms and SimGrid replays (contiguous and scattered nodes) for every workload of
    ``names`` and node count; one row each (:func:`_row`). Raises SimulatorMissing without
    SimGrid."""
    ws = [workloads()[n] for n in names]
    jobs = [(w, N) for w in ws for N in nodes]
    sims = simulate_many([sim_setting(w, N, link_gbps, cal, fusion_bytes, fp16, placement)
                          for w, N in jobs for placement in PLACEMENTS])
    return [_row(w, N, link_gbps, cal, fusion_bytes, fp16, sims[2 * i], sims[2 * i + 1])
            for i, (w, N) in enumerate(jobs)]


def horovod_check(cal: Calibration, fusion_bytes: int) -> dict:
    """The replay in the Horovod paper's setting (128 nodes x 4 P100, 25 Gb/s, ResNet-50 at 64
    images per GPU) against the published ~90 %, twice: with the schedule Horovod ran then (one
    flat NCCL 2 ring over all 512 GPUs, 64 MiB fusion buffer, no small first bucket), which is
    the validation (``within_10_points``), and with hpclb's (hierarchical ring, ``fusion_bytes``
    with the 1 MiB first bucket)."""
    w = workloads("p100-horovod")["resnet50"]
    variants = {"horovod_2017": ("flat", HOROVOD_FUSION_BYTES, HOROVOD_FUSION_BYTES),
                "hpclb": ("hierarchical", fusion_bytes, None)}
    settings = []
    for topo, fusion, first in variants.values():
        buckets = bucket_schedule(w.tensors, w.ready_fraction, w.compute_s, BACKWARD_SHARE,
                                  fusion, 1.0, first)
        settings.append(SimSetting([[n / cal.sync_efficiency, r] for n, r in buckets],
                                   w.compute_s, 128, 25, cal.alpha_sw_s, LINK_EFFICIENCY,
                                   gpus_per_node=GPUS_PER_NODE, topology=topo))
    out = {"published_efficiency": HOROVOD_PUBLISHED, "nodes": 128, "link_gbps": 25}
    for (name, (topo, fusion, first)), sim in zip(variants.items(), simulate_many(settings)):
        closed = schedule_step_time(w, 128, 25, cal, fusion, topo, first_bucket_bytes=first)
        out[name] = {"topology": topo, "fusion_threshold_bytes": fusion,
                     "sim_efficiency": sim["efficiency"],
                     "closed_efficiency": w.compute_s / closed, "sim_wall_s": sim["sim_wall_s"]}
    out["within_10_points"] = abs(out["horovod_2017"]["sim_efficiency"] -
                                  HOROVOD_PUBLISHED) <= 0.10
    return out


_CURVES = [
    ("hidden_fraction_efficiency", dict(color="grey", marker="x", linestyle=":"),
     "closed form, one hidden fraction (before)"),
    ("closed_efficiency", dict(color="C0", marker="o"), "closed form, hpclb schedule"),
    ("sim_efficiency", dict(color="C1", marker="s", linestyle="--", fillstyle="none"),
     "SimGrid replay"),
    ("scattered_closed_efficiency", dict(color="C2", marker="o"),
     "closed form, scattered nodes (busiest link)"),
    ("scattered_sim_efficiency", dict(color="C3", marker="s", linestyle="--", fillstyle="none"),
     "SimGrid replay, scattered nodes")]


def plot_compare(rows: list[dict], path: Path) -> bool:
    """Efficiency (%) against GPUs, closed form and simulation, one panel per workload, as a
    PNG at ``path`` (:func:`hpclb.bench.model.efficiency_panels`); False (nothing drawn)
    without matplotlib."""
    def draw(ax, pts: list[dict]) -> None:
        for key, style, label in _CURVES:
            if key in pts[0]:
                ax.plot([r["gpus"] for r in pts], [100 * r[key] for r in pts], label=label,
                        **style)
    return model.efficiency_panels(
        rows, path, f"GPUs ({GPUS_PER_NODE} per node), {{link_gbps:g}} Gb/s fat tree", draw)


def _effects(r: dict) -> str:
    """Which effect separates a closed form from the replay by more than DIFFER, if any."""
    out = []
    if abs(r["ratio_hidden_fraction_over_sim"] - 1) > DIFFER:
        out.append("overlap (single hidden fraction)")
    if abs(r.get("ratio_uncontended_closed_over_scattered_sim", 1) - 1) > DIFFER:
        out.append(f"contention (scattered: {r['scattered_link_load']} flows/link)")
    if abs(r["ratio_closed_over_sim"] - 1) > DIFFER:
        out.append("latency terms / schedule")
    return "; ".join(out)


def _print_compare(rows: list[dict], hv: dict) -> None:
    """The Horovod validation line and the side-by-side table."""
    h, o = hv["horovod_2017"], hv["hpclb"]
    print(f"\nSimGrid check, Horovod paper's setting (128 nodes x 4 P100, 25 Gb/s, ResNet-50 at "
          f"64 images per GPU; published ~{100 * HOROVOD_PUBLISHED:.0f}%): Horovod's 2017 "
          f"schedule (flat ring, 64 MiB fusion) replay {100 * h['sim_efficiency']:.1f}% "
          f"(closed form {100 * h['closed_efficiency']:.1f}%): "
          f"{'within' if hv['within_10_points'] else 'NOT within'} 10 points; hpclb's schedule "
          f"(hierarchical, 25 MiB) {100 * o['sim_efficiency']:.1f}% (closed form "
          f"{100 * o['closed_efficiency']:.1f}%)")
    print(f"\nweak-scaling efficiency, 200 Gb/s fat tree, {GPUS_PER_NODE} GPUs a node. h: closed "
          f"form with one hidden fraction; sched: closed form with hpclb's bucket schedule; sim: "
          f"SimGrid replay; ratio = closed / sim step time; scattered: nodes spread at random")
    print(f"{'workload':>9s} {'nodes':>5s} {'GPUs':>5s} {'h':>6s} {'sched':>6s} {'sim':>6s} "
          f"{'ratio':>6s} | {'scattered: sched':>16s} {'sim':>6s} {'ratio':>6s} "
          f"{'wall s':>6s}  >10% apart")
    for r in rows:
        print(f"{r['workload']:>9s} {r['nodes']:5d} {r['gpus']:5d} "
              f"{100 * r['hidden_fraction_efficiency']:5.1f}% "
              f"{100 * r['closed_efficiency']:5.1f}% {100 * r['sim_efficiency']:5.1f}% "
              f"{r['ratio_closed_over_sim']:6.3f} | {100 * r['scattered_closed_efficiency']:15.1f}%"
              f" {100 * r['scattered_sim_efficiency']:5.1f}% "
              f"{r['ratio_scattered_closed_over_sim']:6.3f} {r['sim_wall_s']:6.1f}  {_effects(r)}")


def run(args: argparse.Namespace) -> int:
    """``hpclb bench model [--simulate]``: the closed form (:func:`hpclb.bench.model.run`); with
    ``--simulate`` first checks SimGrid imports (else prints how to install it and returns 2),
    then validates on the Horovod setting, prints the comparison and writes ``args.sim_out``
    (JSON) and a PNG beside it. Returns 2 for node counts outside 1..4096, 1 when the Horovod
    check misses by more than 10 points."""
    if args.simulate:
        if any(n < 1 or n > 4096 for n in args.sim_nodes):
            print(f"error: --sim-nodes {' '.join(map(str, args.sim_nodes))}: node counts must "
                  f"be 1..4096 (default {' '.join(map(str, SIM_NODES))})", file=sys.stderr)
            return 2
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
    wrote = save(args.sim_out, {"calibration": asdict(cal), "horovod_check": hv,
                                "comparison": rows, "wall_s": time.perf_counter() - t0},
                 plot=lambda png: plot_compare(rows, png))
    print(f"{wrote}; simulations took {time.perf_counter() - t0:.0f} s")
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
