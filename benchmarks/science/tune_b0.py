"""Tune one optimizer's peak LR of a recipe at its base batch B0 only (the protocol of
docs/science.md): one ``hpclb train`` per LR of a fixed grid, at B0, ``--scaling none``, one
seed. Resumable: an LR already in the results JSON is skipped, a cut run resumes from its
checkpoint. The rule, fixed before the runs: the LR with the best final value of the recipe's
metric wins; a diverged run (exit 3) loses.

    python benchmarks/science/tune_b0.py mnist-lstm --optimizer momentum \
        --lrs 0.05,0.1,0.2,0.5 --out results/tuning/mnist-lstm-momentum.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hpclb._io import write_json
from hpclb.config import load_recipe
from hpclb.tools.sweep import metric_of


def _train(args, lr: float, run_dir: Path) -> dict:
    """Run (or resume, or read back) one LR; its row."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        recipe = load_recipe(args.experiment)
        cmd = [sys.executable, "-m", "hpclb", "train", args.experiment, "--batch-size",
               str(recipe["base_batch_size"]), "--scaling", "none", "--optimizer",
               args.optimizer, "--lr", repr(lr), "--seed", str(args.seed), "--out", str(run_dir)]
        if (run_dir / "checkpoint.pt").exists():
            cmd.append("--resume")
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, text=True, stderr=subprocess.PIPE)
        if proc.returncode == 3:
            return {"lr": lr, "metric": None, "diverged": True,
                    "error": proc.stderr.strip().splitlines()[-1]}
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    s = json.loads(summary.read_text())
    metric = s["metric_name"]
    return {"lr": lr, "metric": s[f"final_{metric}"], "best": s[f"best_{metric}"],
            "steps": s["steps"], "wall_time_s": s["wall_time_s"], "diverged": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment")
    ap.add_argument("--optimizer", required=True)
    ap.add_argument("--lrs", required=True, help="comma-separated peak LRs at B0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--runs-dir", default="runs/tuning")
    args = ap.parse_args()
    metric, mode = metric_of(load_recipe(args.experiment))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    grid = [float(x) for x in args.lrs.split(",")]
    for lr in grid:
        if any(r["lr"] == lr for r in rows):
            continue
        run_dir = Path(args.runs_dir) / args.experiment / f"{args.optimizer}-lr{lr:g}-s{args.seed}"
        rows.append(_train(args, lr, run_dir))
        rows.sort(key=lambda r: r["lr"])
        ok = [r for r in rows if r["metric"] is not None]
        best = (max if mode == "max" else min)(ok, key=lambda r: r["metric"]) if ok else None
        complete = all(any(r["lr"] == g for r in rows) for g in grid)
        # best_lr only once the whole grid is run: a cut tuning chooses nothing
        write_json(out, {"experiment": args.experiment, "optimizer": args.optimizer,
                         "seed": args.seed, "metric": metric, "mode": mode,
                         "rule": "best final metric at B0 over the whole grid; diverged runs "
                                 "lose", "grid": grid,
                         "best_lr": best["lr"] if best and complete else None, "rows": rows})
        print(f"tune {args.experiment} {args.optimizer}: lr {lr:g} -> {rows}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
