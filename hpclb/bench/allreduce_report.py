"""The headline of ``make bench-allreduce``: hpclb against the fastest raw mpi4py schedule, DDP
over Gloo and Horovod, from the runs of :mod:`hpclb.bench.allreduce`; the text report and the
bandwidth plot."""
from __future__ import annotations

from pathlib import Path

from hpclb.bench.launch import pyplot, save_png
from hpclb.bench.measure import med
from hpclb.bench.raw import SUM_ONLY

__all__ = ["TARGETS", "headline", "paired", "plot", "report", "sync_headline"]

MiB = 2 ** 20
TARGETS = {"hpclb_vs_raw_allreduce": ">= 0.95", "hpclb_vs_ddp_gloo": ">= 1.0",
           "hpclb_vs_horovod": ">= 1.5", "overlap_hidden_fraction": ">= 0.5"}
DEFINITIONS = {
    "hpclb_vs_raw_allreduce": "fastest raw mpi4py schedule of the same gradients (one flat "
    "Allreduce, back-to-back Allreduce of hpclb's buckets, pipelined Iallreduce of them; at "
    "every fusion threshold timed) / hpclb's fastest GradientSync setting, first sync "
    "workload (ResNet-50's 161 gradients by default), interleaved in one job",
    "hpclb_vs_raw_mean_allreduce": "back-to-back Allreduce of hpclb's buckets, each then divided "
    "by the world size (the mean GradientSync delivers: like for like) / hpclb (its fastest "
    "setting; with loss_prescaled the loss carries 1/world_size and nothing is divided)",
    "hpclb_divided_vs_raw_mean_allreduce": "the same for hpclb's fastest setting that divides "
    "each bucket after the sum (no loss_prescaled)",
    "hpclb_vs_flat_allreduce": "one Allreduce of a flat buffer of the same bytes / hpclb (the "
    "slowest raw schedule on Open MPI; kept for comparison with earlier runs)",
    "hpclb_vs_ddp_gloo": "DDP (Gloo, bucket_cap_mb 25) step time / hpclb step time (25 MiB "
    "buckets, best overlap mode), same job",
    "hpclb_vs_horovod": "Horovod DistributedOptimizer step time / hpclb step time, same job",
    "overlap_hidden_fraction": "(blocking step - overlapped step) / (blocking step - "
    "compute-only step)",
    "timing": "each variant's fastest of its rounds (other jobs on the machine only add "
    "time); *_paired_median: the median over rounds of the ratio within a round (same "
    "load for both sides); rounds in a shuffled order, same on every rank"}


def sync_headline(sync: dict) -> dict:
    """From one job's ``sync`` section: hpclb's fastest setting against the fastest raw schedule
    across all settings (each with the bucket sizes it used), and against the flat Allreduce."""
    name = next(iter(sync))
    rows = sync[name]["configs"]
    top = min(rows, key=lambda c: c["sync_time_s"])
    raw_row, raw_name = min(((c, k) for c in rows for k in c["raw"] if k in SUM_ONLY),
                            key=lambda ck: ck[0]["raw"][ck[1]]["time_s"])
    raw_t = raw_row["raw"][raw_name]["time_s"]
    flat_t = min(c["raw"]["flat_allreduce"]["time_s"] for c in rows)
    mean_t = min(c["raw"]["bucket_allreduce_mean"]["time_s"] for c in rows)
    return {"hpclb_vs_raw_allreduce": raw_t / top["sync_time_s"],
            "hpclb_vs_raw_allreduce_paired_median": top["ratio_vs_fastest_raw_paired_median"],
            "hpclb_vs_flat_allreduce": flat_t / top["sync_time_s"],
            "hpclb_vs_raw_mean_allreduce": mean_t / top["sync_time_s"],
            **_divided(rows, mean_t),
            "sync_workload": name,
            "hpclb_sync_config": {"overlap": top["overlap"], "buckets": top["buckets"],
                                  "loss_prescaled": top.get("loss_prescaled", False),
                                  "fusion_threshold_bytes": top["fusion_threshold_bytes"],
                                  "time_s": top["sync_time_s"]},
            "fastest_raw_config": {"schedule": raw_name, "time_s": raw_t,
                                   "messages": raw_row["raw"][raw_name]["messages"],
                                   "fusion_threshold_bytes": raw_row["fusion_threshold_bytes"]
                                   if raw_name != "flat_allreduce" else None}}


def _divided(rows: list[dict], mean_t: float) -> dict:
    """The same ratio for the fastest setting that divides after the sum (no
    ``loss_prescaled``): what a library user gets who does not scale the loss."""
    div = [c for c in rows if not c.get("loss_prescaled")]
    if not div or len(div) == len(rows):
        return {}
    best = min(div, key=lambda c: c["sync_time_s"])
    return {"hpclb_divided_vs_raw_mean_allreduce": mean_t / best["sync_time_s"]}


def step_headline(st: dict) -> dict:
    """From one job's ``step`` section: hpclb against DDP and the hidden fraction."""
    mine = f"hpclb_{st['best_overlap_mode']}"
    return {"hpclb_vs_ddp_gloo": st["min_step_s"]["ddp_gloo"] / st["hpclb_step_s"],
            "hpclb_vs_ddp_gloo_median": st["median_step_s"]["ddp_gloo"]
            / st["median_step_s"][mine],
            "overlap_hidden_fraction": st["overlap_hidden_fraction"],
            "best_overlap_mode": st["best_overlap_mode"], "step_workload": st.get("workload"),
            "bucket_bytes": {"hpclb": 25 * MiB, "ddp_gloo": 25 * MiB},
            **paired(st["all_step_s"], mine)}


def headline(runs: dict) -> dict:
    """The numbers the benchmark is for, from the 2-rank runs (and a 4-rank summary); a part
    whose job failed is missing (None)."""
    h: dict = {"definitions": DEFINITIONS}
    main2 = runs.get("np2")
    if main2 and main2.get("sync"):
        h.update(sync_headline(main2["sync"]))
    if main2 and main2.get("step"):
        h.update(step_headline(main2["step"]))
    main4 = runs.get("np4")
    if main4 and main4.get("step") and main4.get("sync"):
        s4 = step_headline(main4["step"])
        h["np4"] = {k: s4[k] for k in ("hpclb_vs_ddp_gloo", "overlap_hidden_fraction",
                                       "hpclb_vs_ddp_gloo_paired_median")}
        h["np4"]["hpclb_vs_raw_allreduce"] = sync_headline(main4["sync"])[
            "hpclb_vs_raw_allreduce"]
    hv = (runs.get("horovod_np2") or {}).get("horovod")
    h["hpclb_vs_horovod"] = hv["hpclb_vs_horovod"] if hv else None
    if hv:
        a = hv["all_step_s"]
        h["hpclb_vs_horovod_paired_median"] = med(
            [x / y for x, y in zip(a["horovod"], a[f"hpclb_{hv['hpclb_best_mode']}"])])
        h.setdefault("bucket_bytes", {})["horovod"] = hv["horovod_fusion_threshold_bytes"]
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
    """Bus bandwidth against message size (raw mpi4py, Gloo, Horovod; hpclb's sync and the
    fastest raw schedule of the same gradients as points) as a PNG at ``path``; False without
    matplotlib or without a finished job."""
    if not any(runs.values()):
        return False
    plt = pyplot()
    if plt is None:
        print("[bench-allreduce] matplotlib not installed (make install): no plot")
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for _, run in sorted(runs.items()):
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
            top = min(s["configs"], key=lambda c: c["sync_time_s"])
            ax.scatter([s["bytes"]], [top["sync_busbw_Bps"] / 1e9], marker="*", s=150,
                       label=f"hpclb GradientSync {name}, {p} ranks")
            ax.scatter([s["bytes"]], [max(c["fastest_raw_busbw_Bps"] for c in s["configs"])
                                      / 1e9], marker="x", s=80,
                       label=f"fastest raw schedule {name}, {p} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("Allreduce bus bandwidth on this machine (ranks share its cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_png(fig, path, 120)


def report(result: dict) -> str:
    """The headline ratios with their targets and each job's step and sync times, as text."""
    f = lambda v, fmt="{:.3f}": "n/a" if v is None else fmt.format(v)  # noqa: E731
    lines = ["", "ratios (same job, interleaved; >1 means hpclb is faster):"]
    for key, target in result["targets"].items():
        pm = result.get(f"{key}_paired_median")
        lines.append(f"  {key:26s} {f(result.get(key)):>8s}   paired-round median "
                     f"{f(pm):>6s}   (target {target})")
    if result.get("hpclb_vs_raw_mean_allreduce") is not None:
        lines.append(f"  {'hpclb_vs_raw_mean_allreduce':26s} "
                     f"{f(result['hpclb_vs_raw_mean_allreduce']):>8s}   (like for like: raw "
                     f"Allreduce per bucket + divide)")
    if result.get("hpclb_divided_vs_raw_mean_allreduce") is not None:
        lines.append(f"  {'  hpclb dividing itself':26s} "
                     f"{f(result['hpclb_divided_vs_raw_mean_allreduce']):>8s}   (no "
                     f"loss_prescaled)")
    for key in ("hpclb_sync_config", "fastest_raw_config", "bucket_bytes"):
        if result.get(key):
            lines.append(f"  {key}: {result[key]}")
    if result.get("np4"):
        lines.append("  at 4 ranks: " + ", ".join(f"{k} {f(v)}" for k, v in
                                                   result["np4"].items()))
    for key, run in result["runs"].items():
        if not run:
            continue
        st = run.get("step")
        if st:
            lines.append(f"  {key}: step s (min/median) " + ", ".join(
                f"{k} {v:.3f}/{st['median_step_s'][k]:.3f}" for k, v in
                st["min_step_s"].items()))
        if run.get("sync"):
            name, s = next(iter(run["sync"].items()))
            lines.append(f"  {key}: {name} sync / fastest raw schedule: " + ", ".join(
                f"{c['overlap']}@{c['fusion_threshold_bytes'] // MiB}MiB"
                f"{' prescaled' if c.get('loss_prescaled') else ''} "
                f"{c['ratio_vs_fastest_raw']:.2f} ({c['fastest_raw']})" for c in s["configs"]))
    lines += [f"  note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)
