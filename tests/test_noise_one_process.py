"""``--noise-scale`` at one process is refused with the reason, exit 2, before any work
(before: accepted, nothing measured, and ``hpclb advise`` then asked for --noise-scale)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpclb.errors import ConfigError
from hpclb.noise import check_world_size


def test_check_world_size():
    check_world_size(True, 2)
    check_world_size(False, 1)
    with pytest.raises(ConfigError, match=r"--noise-scale at world size 1: the gradient noise "
                                          r"scale needs >= 2 ranks"):
        check_world_size(True, 1)


@pytest.mark.timeout(180)
def test_train_refuses_noise_scale_at_one_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hpclb", "train", "mnist-lstm", "--noise-scale",
                        "--accumulation-steps", "2", "--epochs", "0.5",
                        "--out", str(tmp_path / "run"), "--data-dir", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=170, stdin=subprocess.DEVNULL)
    err = p.stdout + p.stderr
    assert p.returncode == 2, err
    assert "hpclb: error: --noise-scale at world size 1: the gradient noise scale needs >= 2 " \
        "ranks" in err and "mpirun -n 2" in err and "Traceback" not in err, err
