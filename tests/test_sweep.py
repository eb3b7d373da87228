"""`hpclb sweep`: real short MNIST points, the results files, and resumption."""
import json

import pytest
from helpers import quick_recipe

from hpclb.errors import ConfigError
from hpclb.tools import sweep

pytestmark = pytest.mark.slow


def test_sweep_writes_rows_tables_plot_and_resumes(tmp_path, mnist_dir, monkeypatch):
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    kw = dict(epochs=1, data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
              runs_dir=tmp_path / "runs", log=lambda m: None)
    rows = sweep.run_sweep(recipe, [256, 128], ["legw", "linear", "none"], **kw)
    assert [(r["batch_size"], r["scheme"]) for r in rows] == [
        (128, "legw"), (128, "linear"), (128, "none"), (256, "legw"), (256, "linear"),
        (256, "none")]
    for r in rows:
        for key in ("batch_size", "scheme", "metric_name", "metric", "epochs", "wall_time_s",
                    "steps", "time_to_target_s"):
            assert key in r
        assert r["metric_name"] == "test_accuracy" and 0 < r["metric"] <= 1
    by = {(r["batch_size"], r["scheme"]): r for r in rows}
    assert by[(128, "linear")]["metric"] == by[(128, "legw")]["metric"]  # k = 1: one run
    assert by[(256, "legw")]["warmup_steps"] == by[(128, "legw")]["warmup_steps"] == 1
    assert by[(256, "linear")]["peak_lr"] == pytest.approx(2 * by[(128, "linear")]["peak_lr"])
    assert by[(256, "legw")]["peak_lr"] == pytest.approx(2 ** 0.5 * by[(128, "legw")]["peak_lr"])
    res = tmp_path / "res"
    assert json.loads((res / "mnist-lstm.json").read_text()) == rows
    md = (res / "mnist-lstm.md").read_text()
    assert "| batch | legw | linear | none |" in md and "| 256 |" in md
    assert (res / "mnist-lstm.png").read_bytes()[:4] == b"\x89PNG"

    def no_training(*a, **k):
        raise AssertionError("a finished point was trained again")

    monkeypatch.setattr(sweep, "_run_in_process", no_training)
    again = sweep.run_sweep(recipe, [128, 256], ["legw", "linear", "none"], **kw)
    assert again == rows
    # A point that finished but was never recorded is read back from its summary.json.
    (res / "mnist-lstm.json").write_text(json.dumps(rows[:-1]))
    again = sweep.run_sweep(recipe, [128, 256], ["legw", "linear", "none"], **kw)
    assert again[-1]["metric"] == rows[-1]["metric"]
    # A different budget is a different point; its directory holds the other budget's run,
    # which is deleted only when asked.
    with pytest.raises(ConfigError, match="already holds a finished run; add --overwrite"):
        sweep.run_sweep(recipe, [256], ["none"], **{**kw, "epochs": 2})
    with pytest.raises(AssertionError, match="trained again"):
        sweep.run_sweep(recipe, [256], ["none"], **{**kw, "epochs": 2}, overwrite=True)


def test_rejected_point_is_recorded_not_fatal(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    rows = sweep.run_sweep(recipe, [512], ["legw"], epochs=1, data_dir=str(mnist_dir.parent),
                           out_dir=tmp_path / "res", runs_dir=tmp_path / "runs", log=lambda m: None)
    assert rows[0]["metric"] is None and "warmup" in rows[0]["error"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="--schemes"):
        sweep.run_sweep("mnist-lstm", [128], ["cubic"], out_dir=tmp_path, runs_dir=tmp_path)
    with pytest.raises(ConfigError, match="--batch-sizes"):
        sweep.run_sweep("mnist-lstm", [129], ["legw"], ranks=2, out_dir=tmp_path,
                        runs_dir=tmp_path)
    for ranks in (0, -1):  # checked before the batches are divided by it
        with pytest.raises(ConfigError, match=f"--ranks: must be an integer >= 1.*got {ranks}"):
            sweep.run_sweep("mnist-lstm", [128], ["legw"], ranks=ranks, out_dir=tmp_path,
                            runs_dir=tmp_path)


def test_cli_ranks_zero_is_a_config_error(tmp_path, capsys):
    from hpclb import cli
    assert cli.main(["sweep", "mnist-lstm", "--batch-sizes", "128", "--ranks", "0",
                     "--out-dir", str(tmp_path), "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--ranks: must be an integer >= 1" in err and "Traceback" not in err, err


def test_point_held_by_another_sweep_process_is_skipped(tmp_path):
    """Two sweep processes on one sweep: a point whose lock is held elsewhere is left alone."""
    import fcntl
    import os
    recipe = quick_recipe(tmp_path)
    lock = tmp_path / "runs" / "mnist-lstm" / ".adam-linear-b256-s0.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what the other process's trainer holds
    try:
        import subprocess
        import sys
        code = ("import sys; sys.path.insert(0, 'tests'); from hpclb.tools import sweep; "
                f"sweep.run_sweep({recipe!r}, [256], ['linear'], out_dir={str(tmp_path / 'res')!r},"
                f" runs_dir={str(tmp_path / 'runs')!r})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, cwd=str(__import__("conftest").REPO)).stdout
    finally:
        os.close(fd)
    assert "being trained by another sweep process, skipped" in out
    assert not (tmp_path / "runs" / "mnist-lstm" / "adam-linear-b256-s0").exists()


def test_points_run_under_mpirun_with_ranks(tmp_path, mnist_dir):
    """--ranks 2: each point is an `mpirun -n 2 ... hpclb train` subprocess."""
    import sys
    from pathlib import Path
    if not (Path(sys.executable).parent / "mpirun").exists():
        pytest.skip("no mpirun beside the interpreter (make install provides one)")
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    rows = sweep.run_sweep(recipe, [256], ["linear"], ranks=2, epochs=1,
                           data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
                           runs_dir=tmp_path / "runs", log=lambda m: None)
    assert rows[0]["ranks"] == 2 and rows[0]["steps"] == 2 and rows[0]["metric"] is not None
    summary = json.loads((tmp_path / "runs" / "mnist-lstm" / "adam-linear-b256-s0" / "summary.json")
                         .read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "mpi"


def test_every_packaged_recipe_loads_and_schedules_at_b0():
    """Each recipe of `hpclb train --help` validates and resolves to a schedule at its B0."""
    from hpclb.config import available_experiments, resolve

    names = available_experiments()
    assert {"mnist-lstm", "ptb-small-cpu", "fashion-resnet-cpu", "gnmt-cpu"} <= set(names)
    for name in names:
        cfg = resolve(name)
        sched = cfg.schedule(100_000)
        assert cfg.global_batch_size == cfg.base_batch_size and sched.peak_lr == cfg.base_lr > 0
        assert sched.warmup_steps < sched.total_steps, name
