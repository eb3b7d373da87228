"""The k-map's gate and helpers (benchmarks/science/kmap.sh, predictions.py): a workload's
k-map is refused until its prediction is in a commit, and the helpers that pick the PTB seeds,
the best diagnostic and the stable B0 LR compute what docs/science.md says."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)
PRED = [sys.executable, str(REPO / "benchmarks/science/predictions.py")]


def _kmap(step: str, res: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "STEP": step, "RES": res, "RUNS": str(tmp_path / "runs"),
           "PY": sys.executable}
    return subprocess.run(["bash", str(REPO / "benchmarks/science/kmap.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_kmap_without_a_committed_prediction_is_refused(tmp_path):
    # a folder of results that no commit holds: no prediction for any workload
    r = _kmap("kmap-cnn", str(tmp_path / "results"), tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "kmap-cnn: no prediction for cnn in a commit" in r.stderr
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_the_helpers(tmp_path):
    sweep = tmp_path / "ptb-small.json"  # B0 113 +- 0.6 (tolerance 3.4); seed 0 at 80/160/320
    rows = [{"batch_size": 20, "scheme": "legw", "seed": s, "metric": v}
            for s, v in enumerate([113.3, 113.4, 112.2])]
    rows += [{"batch_size": b, "scheme": "legw", "seed": 0, "metric": v}
             for b, v in ((80, 118.0), (160, 121.0), (320, 200.0))]
    sweep.write_text(json.dumps(rows))
    out = subprocess.run([*PRED, "--near-b0", str(sweep), "80,160,320"], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["80"]  # 118 - 113 <= 2 x 3.39; 121 - 113 is not
    diag = tmp_path / "diag"
    for name, acc in (("x-peak-x2-s0", 0.985), ("x-w0.05-s0", 0.989), ("x-peak-x4-s1", 0.99)):
        (diag / name).mkdir(parents=True)
        (diag / name / "summary.json").write_text(json.dumps(
            {"metric_name": "test_accuracy", "final_test_accuracy": acc}))
    out = subprocess.run([*PRED, "--best", str(diag), "x-"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "x-w0.05-s0"  # seed 0 only
    probe = tmp_path / "lr_probe.json"
    probe.write_text(json.dumps({"experiment": "ptb-small", "stable_lr": 40.0}))
    out = subprocess.run([*PRED, "--stable-eta0", str(probe), "640"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert float(out) == pytest.approx(40 / 32 ** 0.5, rel=1e-5)  # k = 640 / 20 = 32
    # a committed probe names a recipe copy under runs/ (not kept): B0 comes from the B0 run's
    # config.json beside it, here 128 (a recipe name would have given 20)
    probe.write_text(json.dumps({"experiment": "runs/gone/run-recipe.yaml", "stable_lr": 16.0}))
    (tmp_path / "config.json").write_text(json.dumps({"recipe": {"base_batch_size": 128}}))
    out = subprocess.run([*PRED, "--stable-eta0", str(probe), "4096"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert float(out) == pytest.approx(16 / 32 ** 0.5, rel=1e-5)  # k = 4096 / 128 = 32
