"""`hpclb sweep` reuses a recorded point (or resumes a cut point's run) only when it was made
with the settings now, and replaces files under --out-dir only when they are its own (before: a
changed recipe's points were skipped as "already recorded", exit 0, the tables kept the old
peak LR; someone's notes in <out-dir>/<name>.md were overwritten, a foreign <name>.json gave a
JSONDecodeError traceback)."""
from __future__ import annotations

import json
import os

import pytest
from helpers import quick_recipe, run_hpclb

from hpclb.errors import ConfigError
from hpclb.tools import sweep
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)

_DATA = {"name": "mnist", "train_samples": 512, "test_samples": 200}


def _recipes(tmp_path):
    """The quick recipe and the same one (same name) with Adam's LR 25x higher."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return (quick_recipe(tmp_path / "a", data=_DATA),
            quick_recipe(tmp_path / "b", data=_DATA, optimizers={"adam": {"lr": 0.05}}))


def _no_training(*a, **k):
    raise AssertionError("a point was trained")


def test_a_changed_recipe_is_refused_then_rerun_with_overwrite(tmp_path, mnist_dir, monkeypatch):
    q2, q2b = _recipes(tmp_path)
    kw = dict(epochs=1, data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
              runs_dir=tmp_path / "runs", log=lambda m: None)
    rows = sweep.run_sweep(q2, [128, 256], ["legw", "none"], **kw)
    assert all(r["recipe"]["optimizers.adam.lr"] == 0.002 for r in rows)
    monkeypatch.setattr(sweep, "_run_in_process", _no_training)
    assert sweep.run_sweep(q2, [128, 256], ["legw", "none"], **kw) == rows  # same recipe: kept
    with pytest.raises(ConfigError, match=r"optimizers\.adam\.lr: 0\.002 recorded, 0\.05 now.*"
                                          r"--overwrite"):
        sweep.run_sweep(q2b, [128, 256], ["legw", "none"], **kw)
    # a row of an earlier version (no "recipe"): compared on the schedule it holds
    path = tmp_path / "res" / "mnist-lstm.json"
    path.write_text(json.dumps([{k: v for k, v in r.items() if k != "recipe"} for r in rows]))
    assert len(sweep.run_sweep(q2, [128, 256], ["legw", "none"], **kw)) == 4
    with pytest.raises(ConfigError, match=r"schedule base_lr: 0\.002 recorded, 0\.05 now"):
        sweep.run_sweep(q2b, [128, 256], ["legw", "none"], **kw)
    # a finished run not recorded: its config.json's recipe is compared before it is read back
    path.write_text(json.dumps(rows[:-1]))
    with pytest.raises(ConfigError, match=r"B=256 none seed 0: recipe field optimizers\.adam"):
        sweep.run_sweep(q2b, [128, 256], ["legw", "none"], **kw)
    monkeypatch.undo()
    new = sweep.run_sweep(q2b, [128, 256], ["legw", "none"], **kw, overwrite=True)
    assert [r["peak_lr"] for r in new] == pytest.approx([25 * r["peak_lr"] for r in rows])
    assert json.loads(path.read_text()) == new


def test_cli_refuses_a_changed_recipe_with_exit_2(tmp_path, mnist_dir):
    q2, q2b = _recipes(tmp_path)
    env = {**os.environ, "HPCLB_DATA": str(mnist_dir.parent), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = ["--batch-sizes", "128", "--schemes", "none", "--epochs", "1", "--runs-dir", "RD"]
    first = run_hpclb("sweep", q2, *args, cwd=tmp_path, env=env, timeout=280)
    assert first.returncode == 0, first.stderr
    again = run_hpclb("sweep", q2b, *args, cwd=tmp_path, env=env, timeout=280)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "optimizers.adam.lr" in again.stderr and "already recorded" not in again.stdout
    assert "Traceback" not in again.stderr


def test_foreign_files_in_out_dir_are_refused_before_any_point_trains(tmp_path, monkeypatch):
    q2, _ = _recipes(tmp_path)
    monkeypatch.setattr(sweep, "_run_in_process", _no_training)
    out = tmp_path / "OD"
    out.mkdir()
    (out / "mnist-lstm.md").write_text("MY NOTES\n")
    kw = dict(epochs=1, out_dir=out, runs_dir=tmp_path / "runs", log=lambda m: None)
    with pytest.raises(ConfigError, match=r"mnist-lstm\.md.*--overwrite"):
        sweep.run_sweep(q2, [128], ["none"], **kw)
    assert (out / "mnist-lstm.md").read_text() == "MY NOTES\n"
    (out / "mnist-lstm.md").unlink()
    (out / "mnist-lstm.png").write_bytes(b"\x89PNG mine")  # no sweep record beside it
    with pytest.raises(ConfigError, match=r"mnist-lstm\.png"):
        sweep.run_sweep(q2, [128], ["none"], **kw)
    assert (out / "mnist-lstm.png").read_bytes() == b"\x89PNG mine"
    (out / "mnist-lstm.json").write_text("my,csv,data\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = run_hpclb("sweep", q2, "--batch-sizes", "128", "--schemes", "none", "--out-dir", out,
                  "--runs-dir", tmp_path / "runs", cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "mnist-lstm.json" in p.stderr and "--overwrite" in p.stderr
    assert (out / "mnist-lstm.json").read_text() == "my,csv,data\n"


def test_rows_of_an_earlier_version_are_compared_on_the_real_training_set(tmp_path):
    """The committed MNIST-LSTM Adam rows predate ``recipe`` in rows: they are compared on their
    schedule with the one the recipe gives on MNIST's 60,000 images (before: on steps_per_epoch
    x batch, 65,536 at B = 8192, so LEGW's 117 warmup steps read as 128 and every point was
    refused), and at k = 1 a scheme's row copied from another scheme's run is of the settings
    now. A row whose warmup really differs is reported stale by --status and refused."""
    rows = json.loads((REPO / "results/science/mnist-lstm-adam/mnist-lstm.json").read_text())
    rows = [r for r in rows if r["batch_size"] in (128, 8192) and "recipe" not in r]
    assert len(rows) == 24  # 2 batches x 4 schemes x 3 seeds, all of the earlier version
    assert {r["warmup_steps"] for r in rows if r["scheme"] == "goyal" and r["batch_size"] == 128} \
        == {117}  # the B0 run of legw, copied
    out = tmp_path / "res"
    out.mkdir()
    (out / "mnist-lstm.json").write_text(json.dumps(rows))
    kw = dict(seeds=[0, 1, 2], optimizer="adam", out_dir=out, runs_dir=tmp_path / "runs")
    schemes = ["legw", "sqrt", "goyal", "none"]
    st = sweep.sweep_status("mnist-lstm", [128, 8192], schemes, **kw)
    assert (len(st.done), len(st.stale), len(st.left)) == (24, 0, 0)
    for r in rows:
        if r["batch_size"] == 8192 and r["scheme"] == "legw" and r["seed"] == 1:
            r["warmup_steps"] = 128  # what the old comparison expected
    (out / "mnist-lstm.json").write_text(json.dumps(rows))
    st = sweep.sweep_status("mnist-lstm", [128, 8192], schemes, **kw)
    assert [str(p) for p in st.stale] == ["B=8192 legw seed 1"]
    assert "1 recorded with other settings than now" in st.line()
    with pytest.raises(ConfigError, match=r"B=8192 legw seed 1: schedule warmup_steps: 128 "
                                          r"recorded, 117 now"):
        sweep.run_sweep("mnist-lstm", [128, 8192], schemes, log=lambda m: None, **kw)


def test_a_row_of_an_earlier_version_is_checked_on_the_data_of_data_dir(tmp_path, monkeypatch):
    """PTB's training-set size is counted from the data: --data-dir is where the check reads it
    (before: the check ignored it and failed with 'data/ptb.train.txt: no such file' from a
    directory without ./data). Rows with no wall time do not crash --status; --schemes '' is
    refused."""
    from hpclb.config import resolve
    from hpclb.tools.dryrun import train_set_size_of

    data = os.environ.get("HPCLB_DATA", str(REPO / "data"))
    if not os.path.isfile(os.path.join(data, "ptb", "ptb.train.txt")):
        pytest.skip(f"PTB not staged in {data}; run `make data`")
    monkeypatch.delenv("HPCLB_DATA", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./data here
    cfg = resolve("ptb-small-cpu", batch_size=20, scaling="legw", data_dir=data)
    sched = cfg.schedule(train_set_size_of(cfg)[0])
    row = {"batch_size": 20, "scheme": "legw", "seed": 0, "optimizer": cfg.optimizer,
           "epochs": cfg.epochs, "ranks": 1, "status": "done", "wall_time_s": None,
           "steps_per_epoch": sched.steps_per_epoch, "batch_ratio_k": 1.0,
           "base_lr": cfg.base_lr, "peak_lr": sched.peak_lr, "warmup_steps": sched.warmup_steps,
           "warmup_start_lr": sched.warmup_start_lr, "decay": cfg.recipe["decay"]}
    out = tmp_path / "res"
    out.mkdir()
    (out / "ptb-small-cpu.json").write_text(json.dumps([row]))
    kw = dict(out_dir=out, runs_dir=tmp_path / "runs", data_dir=data)
    st = sweep.sweep_status("ptb-small-cpu", [20], ["legw", "none"], **kw)
    assert (len(st.done), len(st.stale), len(st.left)) == (1, 0, 1)
    (out / "ptb-small-cpu.json").write_text(json.dumps([{**row, "warmup_steps": 1}]))
    assert [str(p) for p in sweep.sweep_status("ptb-small-cpu", [20], ["legw"], **kw).stale] \
        == ["B=20 legw seed 0"]
    with pytest.raises(ConfigError, match="--schemes: give at least one"):
        sweep.sweep_status("ptb-small-cpu", [20], [], **kw)


def test_rows_never_name_a_runs_dir_outside_the_working_directory(tmp_path, monkeypatch):
    """A sweep's rows are committed: with ``--runs-dir`` outside the working directory the row
    names ``…/<experiment>/<point>``, in ``run_dir`` and in a diverged point's error text,
    never the machine's path (tests/test_docs.py refuses results that point outside)."""
    from hpclb.tools.sweep_points import Point, shown

    work = tmp_path / "repo"
    work.mkdir()
    monkeypatch.chdir(work)
    inside = work / "runs" / "mnist-lstm" / "adam-legw-b128-s0"
    outside = tmp_path / "scratch" / "mnist-lstm" / "adam-legw-b128-s0"
    assert shown(inside) == "runs/mnist-lstm/adam-legw-b128-s0"
    assert shown(outside, scratch=True) == "…/mnist-lstm/adam-legw-b128-s0"
    assert shown(outside) == str(outside)  # results kept outside the repository: as they are
    p = Point(128, "legw", 0, "adam", 20.0, 1, 1)
    row = p.failed_row("test_accuracy", RuntimeError(f"diverged at step 5; the last checkpoint, "
                                                     f"{outside}/checkpoint.pt, is kept"),
                       outside, 1.0, 5)
    assert row["run_dir"] == "…/mnist-lstm/adam-legw-b128-s0"
    assert str(tmp_path) not in json.dumps(row, ensure_ascii=False)
    assert "…/mnist-lstm/adam-legw-b128-s0/checkpoint.pt" in row["error"]
