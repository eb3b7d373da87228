"""Bad input through the real command line, 1 process and under mpirun with 2 ranks: every case
ends within seconds, non-zero, with a message naming the problem."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import quick_recipe

BIN = Path(sys.executable).parent
MPIRUN = BIN / "mpirun"
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}
for var in [v for v in ENV if v.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
    del ENV[var]  # never inherit a surrounding mpirun's identity


def hpclb(*args, ranks=1, timeout=120):
    """Run the CLI; a hang fails the test through ``timeout`` (seconds). Returns (rc, output,
    seconds)."""
    cmd = [sys.executable, "-m", "hpclb", *args]
    if ranks > 1:
        if not MPIRUN.exists():
            pytest.skip("no mpirun beside the interpreter (make install provides one)")
        cmd = [str(MPIRUN), "-n", str(ranks), "--bind-to", "none", *cmd]
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV,
                       stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("args,message", [
    (["--batch-size", "1023"], "not divisible by the world size 2"),
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--lr", "-0.1"], "--lr: must be a positive number"),
    (["--epochs", "0.001"], "warmup .* must be shorter than training"),
    (["--accumulation-steps", "0"], "--accumulation-steps: must be an integer >= 1"),
    (["--accumulation-steps", "3"], r"world size \d x --accumulation-steps 3 = \d .*; choose a "
     r"--batch-size that is a multiple"),
    (["--data-dir", "/nonexistent"], "no such file"),
])
def test_bad_input_fails_fast_with_a_message(tmp_path, mnist_dir, ranks, args, message):
    if ranks == 1 and "divisible" in message:
        args, message = ["--batch-size", "-5"], "--batch-size: must be a positive integer"
    if "--data-dir" not in args:
        args = [*args, "--data-dir", str(mnist_dir.parent)]
    rc, out, _ = hpclb("train", "mnist-lstm", "--out", str(tmp_path / "o"), *args, ranks=ranks)
    assert rc != 0, out
    assert re.search(message, out), out
    assert "epoch   1/" not in out  # failed before any rank started training


def test_unknown_experiment_lists_the_known_ones(tmp_path):
    rc, out, _ = hpclb("train", "mnist-gru", "--out", str(tmp_path))
    assert rc == 2 and "unknown experiment 'mnist-gru'" in out and "mnist-lstm" in out


def test_corrupt_data_file_fails_on_every_rank(tmp_path, mnist_dir):
    bad = tmp_path / "data" / "mnist"
    bad.mkdir(parents=True)
    for f in mnist_dir.glob("*-ubyte"):
        shutil.copy(f, bad / f.name)
    img = bad / "train-images-idx3-ubyte"
    img.write_bytes(img.read_bytes()[:1000])
    rc, out, _ = hpclb("train", "mnist-lstm", "--data-dir", str(tmp_path / "data"),
                          "--out", str(tmp_path / "o"), "--batch-size", "256", ranks=2)
    assert rc != 0 and "truncated or corrupt" in out and "epoch   1/" not in out, out


def test_recipe_errors_name_the_field(tmp_path):
    bad = quick_recipe(tmp_path, decay={"name": "poly", "powr": 2})
    rc, out, _ = hpclb("train", bad, "--out", str(tmp_path / "o"))
    assert rc == 2 and "decay" in out and "'powr'" in out, out
    bad = quick_recipe(tmp_path, optimizers={"adam": {"lr": -1}})
    rc, out, _ = hpclb("train", bad, "--out", str(tmp_path / "o"))
    assert rc == 2 and "optimizers.adam.lr" in out, out
    bad = quick_recipe(tmp_path, accumulation_steps=0)
    rc, out, _ = hpclb("train", bad, "--out", str(tmp_path / "o"))
    assert rc == 2 and "accumulation_steps: must be an integer >= 1" in out, out


def test_expect_world_size_catches_a_lone_rank(tmp_path):
    rc, out, _ = hpclb("train", "mnist-lstm", "--expect-world-size", "2", "--out", str(tmp_path))
    assert rc == 2 and "world size 1" in out, out


def test_resume_without_checkpoint(tmp_path, mnist_dir):
    rc, out, _ = hpclb("train", "mnist-lstm", "--resume", "--out", str(tmp_path / "none"),
                       "--data-dir", str(mnist_dir.parent))
    assert rc != 0 and "no checkpoint to resume from" in out, out
