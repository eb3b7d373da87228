"""``hpclb train --no-tensorboard`` through the real command line, at one process (a subprocess
started from inside an MPI rank would join that rank's MPI job, so this file is not MPI-marked)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import quick_recipe


def test_no_tensorboard_writes_metrics_but_no_event_files(tmp_path, mnist_dir):
    """``hpclb train --no-tensorboard``: metrics.jsonl as always, no ``tb/`` (the default writes
    it when the package is installed)."""
    pytest.importorskip("tensorboard")
    recipe = quick_recipe(tmp_path, epochs=0.25, warmup_epochs=0.05)
    outs = {(): tmp_path / "default", ("--no-tensorboard",): tmp_path / "no-tb"}
    for flag, out in outs.items():
        proc = subprocess.run([sys.executable, "-m", "hpclb", "train", recipe, "--device", "cpu",
                               "--data-dir", str(mnist_dir.parent), "--out", str(out), *flag],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (out / "metrics.jsonl").is_file()
    assert (outs[()] / "tb").is_dir() and not (outs[("--no-tensorboard",)] / "tb").exists()
