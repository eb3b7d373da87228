"""The step's footprint stays within the bounds docs/design.md states ("One training step"):
one optimizer step (2 ranks, LARS, K = 1) runs through at most 14 hpclb modules and 50 hpclb
functions, counted by dev/step_footprint.py (two profiled `mpirun -n 2 hpclb train` runs of
different length). Extended: about a minute of both cores."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.extended
@pytest.mark.timeout(600)
def test_one_lars_step_runs_through_at_most_14_modules_and_50_functions():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "dev" / "step_footprint.py"),
                           "--optimizer", "lars", "--max-modules", "14", "--max-functions",
                           "50"], env=env, capture_output=True, text=True, timeout=580)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{last}\n{done.stderr[-3000:]}"
    assert last.startswith("step footprint: ") and "(optimizer lars, 2 ranks, K = 1)" in last
    path = done.stdout
    assert "hpclb/train/loop.py:" in path and ":train_step " in path  # the loop is on it
    assert "hpclb/data/sampler.py" not in path  # the epoch's plan is drawn once per epoch
