"""Rewrite each sweep's tables under results/science/ with the seeds' means and the verdict
(hpclb/tools/verdict.py, the rules of docs/science.md), and print one line per workload.

    .venv/bin/python benchmarks/science/report.py [results/science]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hpclb.config import load_recipe
from hpclb.tools.sweep import metric_of
from hpclb.tools.sweep_report import write_results
from hpclb.tools.verdict import cells, verdict


def main() -> int:
    """Rewrite every sweep's .md/.png under the folder given and print the verdicts; 0."""
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/science")
    for path in sorted(root.glob("*/*.json")):
        rows = json.loads(path.read_text())
        if not isinstance(rows, list) or not rows or "scheme" not in rows[0]:
            continue
        recipe = load_recipe(path.stem)
        metric, mode = metric_of(recipe)
        b0 = recipe["base_batch_size"]
        write_results(rows, path.parent, path.stem, metric, mode, b0)
        for opt in dict.fromkeys(r["optimizer"] for r in rows):
            sub = [r for r in rows if r["optimizer"] == opt]
            try:
                v = verdict(sub, metric=metric, mode=mode, base_batch=b0)
            except ValueError as e:
                print(f"{path.parent.name} ({opt}): no verdict yet: {e}")
                continue
            shown = {k: (None if c.mean is None else round(c.mean, 5), len(c.values))
                     for k, c in sorted(cells(sub).items())}
            print(f"{path.parent.name} ({opt}): tolerance {v['tolerance']:.4g}; holds "
                  f"{v['holds']}; loses {v['loses']}; claim at {v['largest_batch']}: "
                  f"{v['supported']}; means (mean, seeds) {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
