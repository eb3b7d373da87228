"""``hpclb sweep``: results under the run directory unless ``--out-dir`` says otherwise (never
into the committed ``results/sweeps``), one table per budget, and a non-zero exit naming every
point that failed (before: results/sweeps/<exp>.json by default, budgets merged into one table,
exit 0 with a rejected point)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import quick_recipe

from hpclb.tools import sweep_report
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)


def _row(batch, epochs, metric, scheme="legw"):
    return {"batch_size": batch, "scheme": scheme, "metric_name": "test_accuracy",
            "metric": metric, "best_metric": metric, "epochs": epochs, "ranks": 1, "seed": 0,
            "optimizer": "adam", "wall_time_s": 1.0, "steps": 40, "steps_per_epoch": 4,
            "time_to_target_s": None, "batch_ratio_k": batch / 128, "peak_lr": 0.002,
            "warmup_steps": 2, "warmup_epochs": 0.5, "decay": {"name": "constant"},
            "note": None, "error": None}


def test_each_budget_gets_its_own_table_and_line(tmp_path):
    rows = [_row(128, 1.0, 0.90), _row(256, 1.0, 0.80), _row(128, 5.0, 0.97),
            _row(256, 5.0, 0.96)]
    md = sweep_report.markdown_table(rows, "toy", "test_accuracy", "max")
    assert md.count("| batch | legw |") == 2
    one, five = md.split("## 5 epochs, 1 rank(s), seed 0, adam")
    assert "## 1 epochs, 1 rank(s), seed 0, adam" in one
    assert "| 256 | 80.00% (-10.00) |" in one and "97.00%" not in one
    assert "| 256 | 96.00% (-1.00) |" in five and "90.00%" not in five
    fig = sweep_report.plot(rows, tmp_path / "toy.png", "toy", "test_accuracy")
    lines = {ln.get_label(): ln.get_xydata().tolist() for ln in fig.axes[0].get_lines()}
    assert lines["legw, 1 epochs, 1 rank(s), seed 0, adam"] == [[128, 90.0], [256, 80.0]]
    assert lines["legw, 5 epochs, 1 rank(s), seed 0, adam"] == [[128, 97.0], [256, 96.0]]


def test_one_budget_keeps_the_single_table():
    md = sweep_report.markdown_table([_row(128, 1.0, 0.9)], "toy", "test_accuracy", "max")
    assert md.startswith("# Sweep: toy") and "##" not in md


def test_cli_writes_under_runs_dir_and_fails_on_a_rejected_point(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    env = {**os.environ, "HPCLB_DATA": str(mnist_dir.parent),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "hpclb", "sweep", recipe, "--batch-sizes", "512",
                        "--schemes", "legw", "--epochs", "1", "--runs-dir", "runs"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "hpclb: error: sweep point failed: B=512 legw seed 0: " in p.stderr and "warmup" in p.stderr
    assert "Traceback" not in p.stderr
    results = tmp_path / "runs" / "mnist-lstm" / "mnist-lstm.json"
    assert json.loads(results.read_text())[0]["error"]
    assert not (tmp_path / "results").exists()


def test_a_point_directory_names_every_part_of_its_identity_off_the_default():
    """Two points that differ in epochs or ranks never share a run directory (before, a re-run
    at another --epochs or --ranks reused the directory, and the points/ files, of the older
    row); the recipe's epochs on one rank keep the names of earlier versions, which a long
    sweep resumes from."""
    from hpclb.tools.sweep_points import Point

    def name(epochs=20.0, ranks=1, accumulation=1):
        return Point(256, "legw", 0, "adam", epochs, ranks, accumulation,
                     default_epochs=20.0).dir_name

    assert name() == "adam-legw-b256-s0"  # unchanged
    assert name(accumulation=4) == "adam-legw-b256-a4-s0"  # unchanged
    assert name(epochs=2.0) == "adam-legw-b256-e2-s0"
    assert name(epochs=0.5, ranks=2) == "adam-legw-b256-e0.5-r2-s0"
    assert name(ranks=2, accumulation=2) == "adam-legw-b256-a2-r2-s0"
    names = {name(e, r) for e in (20.0, 2.0, 0.5) for r in (1, 2, 4)}
    assert len(names) == 9
    # the recipe's own epochs are not part of the identity
    assert Point(256, "legw", 0, "adam", 2.0, 1) == Point(256, "legw", 0, "adam", 2.0, 1,
                                                          default_epochs=20.0)
