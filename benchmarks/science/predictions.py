"""The k-map's registered predictions (docs/science.md, "Where LEGW breaks").

    predictions.py OUT.json WORKLOAD=B0_RUN_DIR ...
        adds to OUT.json the prediction of `hpclb advise B0_RUN_DIR --json` for each workload
        whose B0 noise-scale run has finished and whose LR probe is in B0_RUN_DIR/lr_probe/, and
        copies its inputs (metrics.jsonl, config.json, summary.json, lr_probe.json) beside
        OUT.json under b0-noise/WORKLOAD/; a workload already in OUT.json is kept as it is (a
        registered prediction is never redone)
    predictions.py --best DIAG_DIR PREFIX
        prints the name of the best seed-0 diagnostic run DIAG_DIR/PREFIX*-s0 (by its metric)
    predictions.py --stable-eta0 LR_PROBE.json BATCH
        prints the B0 LR whose LEGW peak at BATCH is the probe's stable LR: stable / sqrt(k)
    predictions.py --near-b0 SWEEP.json B1,B2,...
        prints the batches among B1,B2,... whose LEGW seed-0 point lies within twice the
        tolerance of the B0 mean (the PTB k-map runs seeds 1-2 there)
"""
from __future__ import annotations

import datetime
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

from hpclb.config import load_recipe
from hpclb.tools.sweep import metric_of
from hpclb.tools.verdict import base_cell, cells, tolerance


def add(out: Path, pairs: list[str]) -> int:
    """Add each finished workload's prediction to ``out``; 0."""
    doc = json.loads(out.read_text()) if out.is_file() else {
        "rule": "docs/science.md, 'Where LEGW breaks': k_max = min(budget, warmup, stability)",
        "workloads": {}}
    for pair in pairs:
        name, run = pair.split("=", 1)
        if name in doc["workloads"]:
            print(f"{name}: registered {doc['workloads'][name]['registered']}; kept")
            continue
        if not (Path(run) / "summary.json").is_file() or \
                not (Path(run) / "lr_probe" / "lr_probe.json").is_file():
            print(f"{name}: {run} has no finished B0 run with its LR probe yet; left out")
            continue
        done = subprocess.run([sys.executable, "-m", "hpclb", "advise", run, "--json"],
                              capture_output=True, text=True, check=True)
        p = json.loads(done.stdout)
        doc["workloads"][name] = {
            "registered": datetime.datetime.now(datetime.timezone.utc).strftime("%FT%TZ"),
            "b0_run": run, "k_max": p["prediction"]["k_max"],
            "batch": p["prediction"]["batch"], "bounds": p["prediction"]["bounds"],
            "binding": p["prediction"]["binding"], **p}
        keep = out.parent / "b0-noise" / name
        keep.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "config.json", "summary.json", "lr_probe/lr_probe.json"):
            shutil.copy(Path(run) / f, keep / Path(f).name)
        cfg = json.loads((keep / "config.json").read_text())
        cfg["data_root"] = "data"  # this machine's absolute path stays out of the repository
        (keep / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        print(f"{name}: k_max {p['prediction']['k_max']} (bounds {p['prediction']['bounds']})")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def near_b0(sweep: Path, batches: str) -> int:
    """Print the batches whose LEGW seed 0 is within twice the tolerance of B0; 0."""
    rows = json.loads(sweep.read_text())
    recipe = load_recipe(sweep.stem)
    metric, mode = metric_of(recipe)
    table = cells(rows)
    base = base_cell(rows, recipe["base_batch_size"])
    tol = tolerance(base, metric, mode)
    for b in map(int, batches.split(",")):
        c = table.get((b, "legw"))
        v = None if c is None else c.values.get(0)
        if v is not None and (v - base.mean if mode == "min" else base.mean - v) <= 2 * tol:
            print(b)
    return 0


def best(diag: Path, prefix: str) -> int:
    """Print the best seed-0 run's name under ``diag`` starting with ``prefix``; 0."""
    scored = []
    for f in sorted(diag.glob(f"{prefix}*-s0/summary.json")):
        s = json.loads(f.read_text())
        metric = s["metric_name"]
        v = s.get("final_" + metric)
        if v is not None:
            scored.append((-v if "perplexity" in metric or "loss" in metric else v,
                           f.parent.name))
    if not scored:
        raise SystemExit(f"no finished {prefix}*-s0 run under {diag}")
    print(max(scored)[1])
    return 0


def stable_eta0(probe: Path, batch: int) -> int:
    """Print ``stable_lr / sqrt(batch / B0)`` of the probe; 0. B0 is the recipe's, from the B0
    run's ``config.json`` beside the probe (the committed record: the probe's own ``experiment``
    names a recipe copy under the runs folder, not kept), else from that recipe."""
    p = json.loads(probe.read_text())
    config = probe.parent / "config.json"
    b0 = (json.loads(config.read_text())["recipe"]["base_batch_size"] if config.is_file()
          else load_recipe(p["experiment"])["base_batch_size"])
    print(f"{p['stable_lr'] / math.sqrt(batch / b0):.6g}")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--near-b0":
        sys.exit(near_b0(Path(sys.argv[2]), sys.argv[3]))
    if sys.argv[1] == "--best":
        sys.exit(best(Path(sys.argv[2]), sys.argv[3]))
    if sys.argv[1] == "--stable-eta0":
        sys.exit(stable_eta0(Path(sys.argv[2]), int(sys.argv[3])))
    sys.exit(add(Path(sys.argv[1]), sys.argv[2:]))
