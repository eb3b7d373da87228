"""An alpha-beta model of ring allreduce, calibrated on this machine's measurements, projecting
step time and scaling efficiency to 1-1024 nodes x 4 GPUs (``hpclb bench model``).

Ring allreduce of ``n`` bytes over ``p`` ranks (Patarasuk & Yuan 2009; Thakur et al. 2005)::

    T_ring(n, p) = 2 (p - 1) alpha + 2 (p - 1) / p * n * beta

``alpha``: seconds per ring step (latency), ``beta``: seconds per byte on the slowest link.
GradientSync reduces a step's gradients in B buckets, so the step pays the alpha term B times.

Calibration from ``results/bench_allreduce.json`` (``make bench-allreduce``):

* ``alpha_sw``, ``beta_local``: :func:`fit_local`, the formula as this machine runs it, fitted
  to the raw mpi4py Allreduce points measured at 2 and 4 ranks (relative error weighted): two
  bandwidth regimes (cache-resident messages and larger ones, the break fitted among the
  measured sizes) and the whole time stretched by ``p / cpus`` when ranks outnumber the cores
  (4 ranks on 2 cores). ``alpha_sw`` is the software cost of one ring step, which stays on a
  cluster; ``beta_local`` is this machine's shared memory and is reported, not projected. The
  plain two-parameter fit (:func:`fit_alpha_beta`) is reported beside it.
* ``sync_efficiency``: hpclb's bucketed sync of ResNet-50 gradients / raw Allreduce of one buffer
  of the same size (``hpclb_vs_flat_allreduce``), capped at 1.
* ``hidden_fraction``: the measured share of communication hidden behind backward
  (``overlap_hidden_fraction``); the projection also shows full overlap (everything that fits
  inside backward is hidden).

Projection for N nodes of 4 GPUs each, ``p = 4 N`` ranks, link speed L Gb/s per node::

    alpha = alpha_link + alpha_sw          (alpha_link: 2 us per InfiniBand hop, assumed)
    beta  = 8 / (eta * L * 1e9)            (eta = 0.90 of line rate, assumed)
    flat ring   T_comm = B * 2 (p-1) alpha + 2 (p-1)/p * n * beta / sync_efficiency
    hierarchical (NCCL/Horovod style: reduce-scatter inside the node over NVLink, ring across
    nodes on 1/4 of the data per GPU, the node's 4 GPUs sharing its links, allgather inside):
                T_comm = B * [2 (N-1) alpha + 2*3 alpha_nvlink]
                         + [2 (N-1)/N * n * beta + 2 * 3/4 * n / bw_nvlink] / sync_efficiency
    T_step = T_compute + T_comm - min(h * T_comm, backward share (2/3) * T_compute)
    with hpclb's schedule (:func:`schedule_step_time`, :mod:`hpclb.bench.schedule`): each
    bucket's allreduce starts when backward has produced its last gradient (the measured
    backward profile) and the previous bucket is done; T_step = max(T_compute, last end)
    efficiency(N) = T_step(1 GPU) / T_step(N)      (weak scaling: fixed batch per GPU)

Compute times per GPU step are assumptions (printed with their sources), not measurements.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from hpclb.bench.launch import cli_main, pyplot, save, save_png

__all__ = [
    "ALPHA_LINK_S", "ALPHA_NVLINK_S", "BACKWARD_SHARE", "DEFAULT_FUSION_BYTES", "GPUS_PER_NODE",
    "LINKS_GBPS", "LINK_EFFICIENCY", "NODES", "NVLINK_BPS", "Calibration", "LocalFit", "Workload",
    "add_arguments", "allreduce_time", "calibrate", "comm_time", "efficiency_panels",
    "fit_alpha_beta", "fit_local", "local_check", "main", "n_buckets", "plot", "project", "run",
    "schedule_step_time", "step_time", "table", "workloads"]

NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
LINKS_GBPS = [100, 200, 400]
GPUS_PER_NODE = 4
ALPHA_LINK_S = 2e-6
LINK_EFFICIENCY = 0.90
NVLINK_BPS = 150e9          # bytes/s per GPU inside a node (V100 NVLink2 ~ 150 GB/s one way)
ALPHA_NVLINK_S = 2e-6
BACKWARD_SHARE = 2 / 3
DEFAULT_FUSION_BYTES = 25 * 2 ** 20


@dataclass
class Workload:
    """A projected workload: its fp32 gradient bytes, the bytes of each gradient tensor
    (registration order), the assumed seconds of one GPU's step at ``batch_per_gpu`` and the source
    of that assumption."""
    name: str
    gradient_bytes: int
    tensors: list[int]          # bytes per gradient tensor (registration order)
    compute_s: float            # one GPU's forward+backward+update at batch_per_gpu
    batch_per_gpu: str
    source: str
    ready_fraction: list[float] | None = None   # measured backward profile, one per tensor


def workloads(gpu: str = "v100") -> dict[str, Workload]:
    """ResNet-50, PTB-large and GNMT with their real gradient shapes and assumed GPU compute."""
    from hpclb.bench.workloads import gradient_shapes

    def tensors(name):
        return [4 * math.prod(s) for _, s in gradient_shapes(name)]

    spec = {
        "resnet50": (0.223, "256 images",
                     "V100 mixed precision ~1150 img/s (NVIDIA DeepLearningExamples, "
                     "ResNet-50 v1.5 PyTorch)"),
        "ptb_large": (0.090, "128 x 35 tokens",
                      "assumed: ~1.35 TFLOP per step (2 x 1500 LSTM + 10k softmax, fwd+bwd) "
                      "at 15 TFLOP/s sustained on a V100"),
        "gnmt": (0.300, "128 sentence pairs",
                 "assumed: 8+8-layer GNMT ~ 3x the 4-layer GNMT v2 step (~0.1 s on a V100, "
                 "NVIDIA DeepLearningExamples)"),
    }
    if gpu == "p100-horovod":  # the Horovod paper's setting (Sergeev & Del Balso 2018)
        spec = {"resnet50": (64 / 220, "64 images", "P100 fp32 ~220 img/s, batch 64 per GPU "
                             "(Horovod paper's setting)")}
    def profile(name):
        from hpclb.bench.backward_profile import load_ready_fractions
        try:
            return load_ready_fractions(name)
        except KeyError:
            return None

    return {n: Workload(n, sum(tensors(n)), tensors(n), c, b, src, profile(n))
            for n, (c, b, src) in spec.items()}


def n_buckets(tensor_bytes: list[int], fusion_bytes: int) -> int:
    """How many buckets GradientSync makes of gradient tensors of ``tensor_bytes`` (bytes each,
    registration order) at fusion threshold ``fusion_bytes``
    (:func:`hpclb.sync.buckets.plan_buckets` with the default first bucket)."""
    from hpclb.sync.buckets import plan_buckets
    from hpclb.sync.options import DEFAULT_FIRST_BUCKET_BYTES
    return len(plan_buckets(tensor_bytes, fusion_bytes, DEFAULT_FIRST_BUCKET_BYTES))


def fit_alpha_beta(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares of t = 2(p-1) a + 2(p-1)/p n b over (n bytes, p ranks, t seconds), each
    point weighted by 1/t (relative error); a, b clipped at >= 0. Raises ValueError for fewer
    than two points."""
    rows = [(2 * (p - 1), 2 * (p - 1) / p * n, t) for n, p, t in points if p > 1 and t > 0]
    if len(rows) < 2:
        raise ValueError("need at least two measured points at >= 2 ranks to calibrate")
    s11 = sum((x / t) ** 2 for x, _, t in rows)
    s22 = sum((y / t) ** 2 for _, y, t in rows)
    s12 = sum((x / t) * (y / t) for x, y, t in rows)
    r1 = sum(x / t for x, _, t in rows)
    r2 = sum(y / t for _, y, t in rows)
    det = s11 * s22 - s12 ** 2
    a = (r1 * s22 - r2 * s12) / det
    b = (r2 * s11 - r1 * s12) / det
    if a < 0:
        a, b = 0.0, r2 / s22
    if b < 0:
        a, b = r1 / s11, 0.0
    return a, b


def _lstsq_rel(rows: list[tuple[list[float], float]]) -> list[float]:
    """Least squares of t = sum(c_k x_k) over ``(x, t)`` rows, each weighted by 1/t."""
    import numpy as np
    A = np.array([[x / t for x in xs] for xs, t in rows])
    c = np.linalg.lstsq(A, np.ones(len(rows)), rcond=None)[0]
    return [max(0.0, float(v)) for v in c]


@dataclass
class LocalFit:
    """The ring formula as this machine runs it: ``alpha_s`` per ring step, ``beta_cache`` /
    ``beta_memory`` seconds per byte below / above ``break_bytes`` (the message size where the
    measured bandwidth falls off a cliff: buffers leave the cache), and the whole time
    stretched by ``max(1, p / cpus)`` when more ranks than cores share the machine (each rank
    copies and reduces its share on a core of its own only while ``p <= cpus``)."""
    alpha_s: float
    beta_cache: float
    beta_memory: float
    break_bytes: int
    cpus: int

    def time_s(self, nbytes: float, p: int) -> float:
        beta = self.beta_cache if nbytes <= self.break_bytes else self.beta_memory
        return max(1.0, p / self.cpus) * (2 * (p - 1) * self.alpha_s +
                                          2 * (p - 1) / p * nbytes * beta)


def fit_local(points: list[tuple[int, int, float]], cpus: int) -> LocalFit:
    """:class:`LocalFit` of (n bytes, p ranks, t seconds) points measured on ``cpus`` cores:
    relative least squares for each candidate break (every measured size), the one with the
    smallest median relative error kept. Raises ValueError for fewer than four points."""
    pts = [(n, p, t) for n, p, t in points if p > 1 and t > 0]
    if len(pts) < 4:
        raise ValueError("need at least four measured points at >= 2 ranks to calibrate")
    best = None
    for brk in sorted({n for n, _, _ in pts}):
        rows = [([max(1.0, p / cpus) * 2 * (p - 1)] +
                 [max(1.0, p / cpus) * 2 * (p - 1) / p * n * (n <= brk),
                  max(1.0, p / cpus) * 2 * (p - 1) / p * n * (n > brk)], t) for n, p, t in pts]
        a, bc, bm = _lstsq_rel(rows)
        fit = LocalFit(a, bc, bm or bc, brk, cpus)
        err = _median_error(pts, fit.time_s)
        if best is None or err < best[0]:
            best = (err, fit)
    return best[1]


def _median_error(pts: list[tuple[int, int, float]], model) -> float:
    """Median of |model(n, p) - t| / t over the points."""
    errs = sorted(abs(model(n, p) - t) / t for n, p, t in pts)
    return errs[len(errs) // 2]


@dataclass
class Calibration:
    """What the model takes from measurements: ``alpha_sw_s`` (seconds per ring step),
    ``beta_local_s_per_byte`` (this machine's seconds per byte, cache-resident messages),
    ``sync_efficiency`` and ``hidden_fraction`` (both in [0, 1]), their source, the number of
    fitted points with the fit's median relative error (:func:`fit_local`), the plain alpha-beta
    fit's median error for comparison, and the local fit itself."""
    alpha_sw_s: float
    beta_local_s_per_byte: float
    sync_efficiency: float
    hidden_fraction: float
    source: str
    fit_points: int
    fit_rel_error_median: float
    fit_rel_error_median_alpha_beta: float = float("nan")
    local_fit: dict | None = None


def _measured_points(res: dict) -> tuple[list[tuple[int, int, float]], int]:
    """(bytes, ranks, fastest seconds) of every raw Allreduce in a bench_allreduce.json, and
    the machine's core count (its ``conditions.cpus``)."""
    pts, cpus = [], 0
    for key, run in res.get("runs", {}).items():
        if run and run.get("raw_mpi") and key.startswith("np"):
            p = run["conditions"]["ranks"]
            cpus = cpus or int(run["conditions"].get("cpus") or 0)
            pts += [(q["bytes"], p, q.get("time_min_s", q["time_s"])) for q in run["raw_mpi"]]
    return pts, cpus or max(p for _, p, _ in pts)


def calibrate(path: Path | None) -> Calibration:
    """From ``bench_allreduce.json``; defaults (stated) when it is missing."""
    if path is None or not path.exists():
        return Calibration(10e-6, 1 / 5e9, 0.95, 0.5, "defaults (no measurements: run make "
                           "bench-allreduce)", 0, float("nan"))
    res = json.loads(path.read_text())
    pts, cpus = _measured_points(res)
    fit = fit_local(pts, cpus)
    a, b = fit_alpha_beta(pts)
    plain = _median_error(pts, lambda n, p: 2 * (p - 1) * a + 2 * (p - 1) / p * n * b)
    if fit.alpha_s > 1e-4:
        print(f"warning: fitted alpha {fit.alpha_s * 1e6:.0f} us per ring step: the "
              f"measurements were taken on a busy machine (scheduling delays, not MPI); rerun "
              f"make bench-allreduce when it is quieter", file=sys.stderr)
    # the documented definition: against one flat Allreduce (files before 2026-12-01 stored it
    # as hpclb_vs_raw_allreduce, which now means the fastest raw schedule)
    eff = min(1.0, res.get("hpclb_vs_flat_allreduce") or res.get("hpclb_vs_raw_allreduce") or 0.95)
    hid = res.get("overlap_hidden_fraction")
    hid = 0.0 if hid is None else max(0.0, min(1.0, hid))
    return Calibration(fit.alpha_s, fit.beta_cache, eff, hid, str(path), len(pts),
                       _median_error(pts, fit.time_s), plain, asdict(fit))


def allreduce_time(nbytes: float, nodes: int, link_gbps: float, cal: Calibration,
                   topology: str, link_load: int = 1) -> float:
    """Modeled seconds of one allreduce of ``nbytes`` (one bucket) on ``nodes`` nodes of
    GPUS_PER_NODE GPUs with ``link_gbps`` Gb/s per node: the flat ring (``topology="flat"``; 0
    on one GPU) or else the hierarchical one of the module docstring. ``link_load``: the most
    ring flows that share one network link (:func:`hpclb.bench.fattree.ring_link_load`; 1 on
    an uncontended network): the ring runs at the busiest link's share of its bandwidth."""
    n, p = nbytes / cal.sync_efficiency, nodes * GPUS_PER_NODE
    alpha = ALPHA_LINK_S + cal.alpha_sw_s
    beta = 8 * link_load / (LINK_EFFICIENCY * link_gbps * 1e9)
    if topology == "flat":
        return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
    g = GPUS_PER_NODE
    intra = 2 * (g - 1) * ALPHA_NVLINK_S + 2 * (g - 1) / g * n / NVLINK_BPS
    return intra + (0.0 if nodes == 1 else 2 * (nodes - 1) * alpha +
                    2 * (nodes - 1) / nodes * n * beta)


def comm_time(w: Workload, nodes: int, link_gbps: float, cal: Calibration, fusion_bytes: int,
              topology: str, fp16: bool = False) -> float:
    """Modeled seconds of one step's gradient allreduce for ``w`` (:func:`allreduce_time` of
    every bucket of :func:`hpclb.sync.buckets.plan_buckets`, back to back); ``fp16`` halves the
    bytes."""
    from hpclb.sync.buckets import plan_buckets
    from hpclb.sync.options import DEFAULT_FIRST_BUCKET_BYTES
    scale = 0.5 if fp16 else 1.0
    return sum(allreduce_time(scale * sum(w.tensors[i] for i in g), nodes, link_gbps, cal,
                              topology)
               for g in plan_buckets(w.tensors, fusion_bytes, DEFAULT_FIRST_BUCKET_BYTES))


def step_time(w: Workload, t_comm: float, hidden_fraction: float) -> float:
    """Modeled seconds per step: compute + ``t_comm`` - the hidden part (``hidden_fraction`` of
    ``t_comm``, at most the backward share of the compute time)."""
    hidden = min(hidden_fraction * t_comm, BACKWARD_SHARE * w.compute_s)
    return w.compute_s + t_comm - hidden


def schedule_step_time(w: Workload, nodes: int, link_gbps: float, cal: Calibration,
                       fusion_bytes: int, topology: str = "hierarchical",
                       fp16: bool = False, link_load: int = 1,
                       first_bucket_bytes: int | None = None) -> float | None:
    """Modeled seconds per step with hpclb's schedule (:mod:`hpclb.bench.schedule`): each bucket
    released when backward (the measured profile, scaled to ``BACKWARD_SHARE`` of the compute
    time) has finished its last gradient, reduced after the previous one in
    :func:`allreduce_time`; the step ends with compute or with the last bucket. None without a
    backward profile for ``w``; ``link_load`` as in :func:`allreduce_time`; ``first_bucket_bytes``
    as in :func:`hpclb.bench.schedule.bucket_schedule`."""
    from hpclb.bench.schedule import bucket_schedule, pipeline_end
    if w.ready_fraction is None:
        return None
    buckets = bucket_schedule(w.tensors, w.ready_fraction, w.compute_s, BACKWARD_SHARE,
                              fusion_bytes, 0.5 if fp16 else 1.0, first_bucket_bytes)
    end = pipeline_end(buckets, lambda n: allreduce_time(n, nodes, link_gbps, cal, topology,
                                                         link_load))
    return max(w.compute_s, end)


def project(cal: Calibration, gpu: str = "v100", fusion_bytes: int = DEFAULT_FUSION_BYTES,
            nodes: list[int] = NODES, links: list[float] = LINKS_GBPS,
            fp16: bool = False) -> list[dict]:
    """The projection: one row per workload (:func:`workloads` of ``gpu``), link speed (Gb/s),
    topology (hierarchical, flat) and node count, with ``comm_s``, ``compute_s`` and, with the
    measured and with full overlap, step time (s) and efficiency (``compute_s`` / step time)."""
    rows = []
    for w in workloads(gpu).values():
        for link in links:
            for topo in ("hierarchical", "flat"):
                for N in nodes:
                    tc = comm_time(w, N, link, cal, fusion_bytes, topo, fp16)
                    row = {"workload": w.name, "link_gbps": link, "topology": topo, "nodes": N,
                           "gpus": N * GPUS_PER_NODE, "comm_s": tc, "compute_s": w.compute_s}
                    for label, h in (("measured_overlap", cal.hidden_fraction),
                                     ("full_overlap", 1.0)):
                        t = step_time(w, tc, h)
                        row[f"step_s_{label}"] = t
                        row[f"efficiency_{label}"] = w.compute_s / t
                    t = schedule_step_time(w, N, link, cal, fusion_bytes, topo, fp16)
                    row["step_s_schedule"] = t
                    row["efficiency_schedule"] = None if t is None else w.compute_s / t
                    rows.append(row)
    return rows


def local_check(cal: Calibration, path: Path | None) -> list[dict]:
    """How well the fitted model (:func:`fit_local`) reproduces this machine's raw Allreduce
    times: one row per measured point with ``measured_s`` and ``model_s``."""
    if path is None or not path.exists() or cal.local_fit is None:
        return []
    fit = LocalFit(**cal.local_fit)
    pts, _ = _measured_points(json.loads(path.read_text()))
    return [{"ranks": p, "bytes": n, "measured_s": t, "model_s": fit.time_s(n, p)}
            for n, p, t in pts]


def table(rows: list[dict], link: float, topo: str) -> str:
    """:func:`project` rows for one link speed (Gb/s) and topology as text: per node count, each
    workload's efficiency in percent with the measured / full overlap."""
    names = sorted({r["workload"] for r in rows})
    head = f"{'nodes':>6s} {'GPUs':>6s} " + " ".join(f"{n + ' eff':>26s}" for n in names)
    lines = [f"link {link:g} Gb/s, {topo} ring; efficiency with measured overlap / full overlap "
             f"/ hpclb's bucket schedule over the measured backward profile",
             head]
    for N in sorted({r["nodes"] for r in rows}):
        cells = []
        for n in names:
            r = next(r for r in rows if r["workload"] == n and r["nodes"] == N and
                     r["link_gbps"] == link and r["topology"] == topo)
            sched = r.get("efficiency_schedule")
            cells.append(f"{100 * r['efficiency_measured_overlap']:5.1f}% /"
                         f"{100 * r['efficiency_full_overlap']:6.1f}% /" +
                         (f"{100 * sched:6.1f}%" if sched is not None else "     - "))
        lines.append(f"{N:6d} {N * GPUS_PER_NODE:6d} " + " ".join(f"{c:>26s}" for c in cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """Efficiency (%) against GPUs of the hierarchical rows of :func:`project`, one panel per
    workload and a line per link speed and overlap, as a PNG at ``path``; False (nothing drawn)
    without matplotlib."""
    def draw(ax, mine: list[dict]) -> None:
        for link in sorted({r["link_gbps"] for r in rows}):
            pts = [r for r in mine if r["link_gbps"] == link and r["topology"] == "hierarchical"]
            ax.plot([r["gpus"] for r in pts], [100 * r["efficiency_measured_overlap"]
                                               for r in pts], marker="o",
                    label=f"{link:g} Gb/s, measured overlap")
            ax.plot([r["gpus"] for r in pts], [100 * r["efficiency_full_overlap"] for r in pts],
                    linestyle="--", label=f"{link:g} Gb/s, full overlap")
    return efficiency_panels(rows, path, "GPUs (4 per node)", draw)


def efficiency_panels(rows: list[dict], path: Path, xlabel: str,
                      draw: Callable[[object, list[dict]], None]) -> bool:
    """Weak-scaling efficiency (%) against GPUs (log scale), one panel per workload of ``rows``:
    ``draw(ax, the workload's rows)`` draws its lines, ``xlabel`` formatted with the panel's
    first row labels its x axis; a PNG at ``path``; False (nothing drawn) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        pts = [r for r in rows if r["workload"] == name]
        draw(ax, pts)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_xlabel(xlabel.format(**pts[0]))
        ax.set_ylabel("weak-scaling efficiency (%)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_png(fig, path, 110)


def _print_setup(cal: Calibration, args: argparse.Namespace) -> None:
    """The calibration, the assumptions and the workloads of a projection."""
    print("alpha-beta ring allreduce model (hpclb bench model)")
    local_gbs = (1 / cal.beta_local_s_per_byte / 1e9 if cal.beta_local_s_per_byte
                 else float("inf"))
    print(f"calibration from {cal.source}: alpha_sw = {cal.alpha_sw_s * 1e6:.1f} us per ring "
          f"step, local beta = {local_gbs:.2f} GB/s "
          f"(shared memory; not projected), fit over {cal.fit_points} points, median "
          f"relative error {100 * cal.fit_rel_error_median:.0f}% (plain alpha-beta fit: "
          f"{100 * cal.fit_rel_error_median_alpha_beta:.0f}%); hpclb sync efficiency vs raw "
          f"{cal.sync_efficiency:.2f}; measured hidden fraction {cal.hidden_fraction:.2f}")
    print(f"assumptions: {GPUS_PER_NODE} GPUs per node; alpha_link {ALPHA_LINK_S * 1e6:g} us; "
          f"links at {100 * LINK_EFFICIENCY:.0f}% of line rate; NVLink {NVLINK_BPS / 1e9:g} GB/s "
          f"per GPU; backward = {BACKWARD_SHARE:.2f} of compute (the most overlap can hide); "
          f"fusion threshold {args.fusion_threshold_bytes / 2 ** 20:g} MiB; gradients "
          f"{'fp16' if args.fp16 else 'fp32'}")
    for w in workloads().values():
        print(f"  {w.name}: {w.gradient_bytes / 1e6:.1f} MB of gradients in "
              f"{n_buckets(w.tensors, args.fusion_threshold_bytes)} buckets; compute "
              f"{w.compute_s * 1e3:.0f} ms per step at {w.batch_per_gpu} per GPU ({w.source})")


def _results(args: argparse.Namespace, cal: Calibration, rows: list[dict], key: dict, hvr: dict,
             measured: Path | None) -> dict:
    """The projection and what it assumed (the JSON ``hpclb bench model`` writes)."""
    return {"calibration": asdict(cal), "assumptions": {
        "gpus_per_node": GPUS_PER_NODE, "alpha_link_s": ALPHA_LINK_S,
        "link_efficiency": LINK_EFFICIENCY, "nvlink_Bps": NVLINK_BPS,
        "backward_share": BACKWARD_SHARE, "fusion_threshold_bytes": args.fusion_threshold_bytes,
        "fp16": args.fp16, "workloads": {n: {k: v for k, v in asdict(w).items() if k != "tensors"}
                                         for n, w in workloads().items()}},
        "resnet50_256x4_200gbps": key, "horovod_paper_setting": hvr,
        "local_check": local_check(cal, measured), "projection": rows}


def run(args: argparse.Namespace) -> int:
    """``hpclb bench model``: calibrates from ``args.measurements`` (stated defaults when missing),
    prints the setup, the efficiency tables per link speed, ResNet-50 at 1024 GPUs and the Horovod
    paper's setting, writes the JSON to ``args.out`` and a PNG beside it; returns 0. ValueError when
    the measurements hold fewer than two usable points."""
    measured = Path(args.measurements) if args.measurements else None
    cal = calibrate(measured)
    if args.hidden_fraction is not None:
        cal.hidden_fraction = args.hidden_fraction
    rows = project(cal, fusion_bytes=args.fusion_threshold_bytes, fp16=args.fp16)
    _print_setup(cal, args)
    for link in LINKS_GBPS:
        print()
        print(table(rows, link, "hierarchical"))
    key = next(r for r in rows if r["workload"] == "resnet50" and r["nodes"] == 256 and
               r["link_gbps"] == 200 and r["topology"] == "hierarchical")
    flat = next(r for r in rows if r["workload"] == "resnet50" and r["nodes"] == 256 and
                r["link_gbps"] == 200 and r["topology"] == "flat")
    print()
    print(f"ResNet-50 at 256 nodes x 4 GPUs (1024 GPUs), 200 Gb/s: modeled efficiency "
          f"{100 * key['efficiency_measured_overlap']:.1f}% with the measured overlap "
          f"({cal.hidden_fraction:.2f}), {100 * key['efficiency_full_overlap']:.1f}% with full "
          f"overlap (hierarchical ring: comm {key['comm_s'] * 1e3:.1f} ms vs compute "
          f"{key['compute_s'] * 1e3:.0f} ms); a flat ring over all 1024 GPUs: "
          f"{100 * flat['efficiency_measured_overlap']:.1f}% / "
          f"{100 * flat['efficiency_full_overlap']:.1f}% (its latency term "
          f"{flat['comm_s'] * 1e3:.1f} ms total comm)")
    hv_cal = Calibration(**{**asdict(cal)})
    hv = project(hv_cal, gpu="p100-horovod", nodes=[128], links=[25],
                 fusion_bytes=args.fusion_threshold_bytes)
    hvr = next(r for r in hv if r["topology"] == "hierarchical")
    print(f"Horovod paper setting (Sergeev & Del Balso 2018: P100, fp32, 64 images per GPU, "
          f"25 Gb/s RoCE, 128 nodes x 4 = 512 GPUs): modeled "
          f"{100 * hvr['efficiency_measured_overlap']:.1f}% (measured overlap) / "
          f"{100 * hvr['efficiency_full_overlap']:.1f}% (full overlap); published ~90%")
    print(save(args.out, _results(args, cal, rows, key, hvr, measured),
               plot=lambda png: plot(rows, png)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpclb bench model``: the measurements to calibrate from, the output JSON, the
    fusion threshold (bytes), an override of the hidden fraction, fp16 gradients."""
    p.add_argument("--measurements", default="results/bench_allreduce.json",
                   help="bench_allreduce.json to calibrate from (default: %(default)s)")
    p.add_argument("--out", default="results/bench_model.json")
    p.add_argument("--fusion-threshold-bytes", type=int, default=DEFAULT_FUSION_BYTES)
    p.add_argument("--hidden-fraction", type=float,
                   help="override the measured share of communication hidden by overlap")
    p.add_argument("--fp16", action="store_true", help="fp16-compressed gradients")


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclb.bench.model``: parses ``argv`` (default ``sys.argv[1:]``) and runs
    :func:`run`; returns its exit status."""
    return cli_main("hpclb.bench.model", __doc__, argv, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
