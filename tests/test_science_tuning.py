"""The science protocol's B0 tuning (benchmarks/science/tune_b0.py) chooses an LR only once its
whole grid has run, and the tuned arm's gate (protocol.sh) refuses to start before that (before:
a tuning cut after its first LR recorded that LR as best_lr, and `make science STEP=cnn` would
have trained the CNN sweep on it)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _tune_b0():
    spec = importlib.util.spec_from_file_location("tune_b0",
                                                  REPO / "benchmarks/science/tune_b0.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cut_tuning_chooses_nothing_and_the_gate_refuses_it(tmp_path, monkeypatch):
    tune = _tune_b0()
    metric = {2.0: 0.91, 4.0: 0.93}

    def fake_train(args, lr, run_dir):
        if lr not in metric:
            raise KeyboardInterrupt  # the session ends during this LR
        return {"lr": lr, "metric": metric[lr], "diverged": False}

    monkeypatch.setattr(tune, "_train", fake_train)
    out = tmp_path / "res" / "tuning" / "fashion-resnet8-lars.json"
    argv = ["tune_b0.py", "fashion-resnet8", "--optimizer", "lars", "--lrs", "2,4,8",
            "--out", str(out), "--runs-dir", str(tmp_path / "runs")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        tune.main()
    doc = json.loads(out.read_text())
    assert [r["lr"] for r in doc["rows"]] == [2.0, 4.0]
    assert doc["grid"] == [2.0, 4.0, 8.0] and doc["best_lr"] is None

    env = {**os.environ, "STEP": "cnn", "RES": str(tmp_path / "res"),
           "RUNS": str(tmp_path / "runs"), "PY": sys.executable}
    gate = subprocess.run(["bash", str(REPO / "benchmarks/science/protocol.sh")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=100)
    assert gate.returncode != 0
    assert "has not run its whole grid yet" in gate.stderr
    assert not (tmp_path / "runs").exists()  # nothing trained

    metric[8.0] = 0.92
    assert tune.main() == 0
    assert json.loads(out.read_text())["best_lr"] == 4.0
