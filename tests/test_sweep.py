"""`hpclb sweep`: real short MNIST points, the results files, and resumption."""
import json
from pathlib import Path

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
    # A different budget is a different point with a directory of its own (-e2; before, it
    # reused the epochs-1 point's directories, and the epochs-1 row's points/ files became the
    # epochs-2 run's): the epochs-1 run, its row and the files its row names stay as they were.
    monkeypatch.undo()
    two = sweep.run_sweep(recipe, [256], ["none"], **{**kw, "epochs": 2}, overwrite=True)
    assert two[0]["epochs"] == 2 and two[0]["points_dir"].endswith("adam-none-b256-e2-s0")
    assert json.loads((tmp_path / "runs" / "mnist-lstm" / "adam-none-b256-e2-s0" /
                       "summary.json").read_text())["epochs"] == 2
    one = [r for r in json.loads((res / "mnist-lstm.json").read_text())
           if (r["batch_size"], r["scheme"], r["epochs"]) == (256, "none", 1)]
    assert len(one) == 1 and one[0]["points_dir"].endswith("adam-none-b256-s0")
    for where in (tmp_path / "runs" / "mnist-lstm" / "adam-none-b256-s0",
                  Path(one[0]["points_dir"])):  # absolute: tmp_path is not under the cwd
        assert json.loads((where / "summary.json").read_text())["epochs"] == 1, where


def test_rejected_point_is_recorded_not_fatal(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    rows = sweep.run_sweep(recipe, [512], ["legw"], epochs=1, data_dir=str(mnist_dir.parent),
                           out_dir=tmp_path / "res", runs_dir=tmp_path / "runs", log=lambda m: None)
    assert rows[0]["metric"] is None and "warmup" in rows[0]["error"]


def test_rejected_point_is_said_before_any_point_trains(tmp_path, mnist_dir):
    """A point the schedule refuses is recorded at the start, not after the points before it
    have trained (it was reached, and said, only after B0 trained)."""
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    said: list[str] = []
    rows = sweep.run_sweep(recipe, [128, 512], ["legw"], epochs=1,
                           data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
                           runs_dir=tmp_path / "runs", log=said.append)
    rejected = next(i for i, m in enumerate(said) if "B=512 legw seed 0: rejected" in m)
    trained = next(i for i, m in enumerate(said) if "B=128 legw seed 0: training" in m)
    assert rejected < trained, said
    by = {r["batch_size"]: r for r in rows}
    assert by[128]["status"] == "done" and by[512]["status"] == "rejected"
    assert "warmup" in by[512]["error"] and by[512]["metric"] is None


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
    summary = json.loads((tmp_path / "runs" / "mnist-lstm" / "adam-linear-b256-r2-s0" /
                          "summary.json").read_text())  # -r2: not the 1-rank point's directory
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


def _tiny(tmp_path, **changes):
    return quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                        "test_samples": 200}, **changes)


def test_seeds_are_points_of_their_own_and_finished_points_go_to_out_dir(tmp_path, mnist_dir,
                                                                         monkeypatch):
    recipe = _tiny(tmp_path)
    kw = dict(epochs=1, data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
              runs_dir=tmp_path / "runs", log=lambda m: None)
    rows = sweep.run_sweep(recipe, [256], ["legw"], seeds=[0, 1], **kw)
    assert [(r["seed"], r["status"]) for r in rows] == [(0, "done"), (1, "done")]
    assert rows[0]["metric"] != rows[1]["metric"]  # two trainings, not one row twice
    for seed in (0, 1):
        name = f"adam-legw-b256-s{seed}"
        assert (tmp_path / "runs" / "mnist-lstm" / name / "summary.json").exists()
        points = tmp_path / "res" / "points" / name
        summary = json.loads((points / "summary.json").read_text())
        assert summary["seed"] == seed and summary["global_batch_size"] == 256
        epochs = [json.loads(line) for line in (points / "metrics.jsonl").read_text().split("\n")
                  if '"kind": "epoch"' in line]
        assert len(epochs) == 1 and epochs[0]["test_accuracy"] == pytest.approx(
            rows[seed]["metric"])

    def no_training(*a, **k):
        raise AssertionError("a recorded point was trained again")

    monkeypatch.setattr(sweep, "_run_in_process", no_training)
    assert sweep.run_sweep(recipe, [256], ["legw"], seeds=[1, 0], **kw) == rows
    st = sweep.sweep_status(recipe, [256], ["legw", "none"], seeds=[0, 1, 2], epochs=1,
                            out_dir=tmp_path / "res", runs_dir=tmp_path / "runs")
    assert (len(st.done), len(st.running), len(st.left)) == (2, 0, 4)
    assert st.expected_s == pytest.approx(4 * sum(r["wall_time_s"] for r in rows) / 2)
    assert st.line().startswith("2 done, 0 running elsewhere, 4 left (about ")


def test_a_diverged_point_is_recorded_with_its_step_and_the_sweep_goes_on(tmp_path, mnist_dir):
    """An LR far past stability: the point stops on non-finite values (exit 3 in a run of its
    own); the sweep records it as a failed point, with the step, and trains the next one."""
    recipe = _tiny(tmp_path, optimizer="sgd", optimizers={"sgd": {"lr": 1.0e12}})
    rows = sweep.run_sweep(recipe, [128, 256], ["none"], epochs=3,
                           data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
                           runs_dir=tmp_path / "runs", log=lambda m: None)
    assert [r["status"] for r in rows] == ["diverged", "diverged"]
    more = sweep.run_sweep(recipe, [128], ["none", "legw"], epochs=3,
                           data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
                           runs_dir=tmp_path / "runs", log=lambda m: None)
    assert more[-1]["status"] == "diverged" and "k = 1" in more[-1]["note"]  # not trained again
    assert not (tmp_path / "runs" / "mnist-lstm" / "sgd-legw-b128-s0").exists()
    for r in rows:
        assert r["metric"] is None and isinstance(r["diverged_at_step"], int)
        assert 1 <= r["diverged_at_step"] < r["epochs"] * 512 / r["batch_size"]
        assert "non-finite" in r["error"] or "exploded" in r["error"]
    assert sweep.failed_points(rows, [128, 256], ["none"]) == []  # results, not failures
    md = (tmp_path / "res" / "mnist-lstm.md").read_text()
    assert "diverged" in md
    # the schedule is known before training: a diverged row has it (before: empty columns)
    for r in rows:
        assert r["peak_lr"] == pytest.approx(1.0e12) and r["base_lr"] == pytest.approx(1.0e12)
        assert r["batch_ratio_k"] == r["batch_size"] / 128
        assert r["steps_per_epoch"] == 512 // r["batch_size"] and r["warmup_steps"] >= 0
        assert {"warmup_epochs", "warmup_start_lr", "decay"} <= set(r)
        assert (f"| {r['batch_size']} | none | {r['batch_ratio_k']:g} | 1e+12 | "
                f"{r['warmup_steps']} (") in md


def test_a_cut_point_resumes_from_its_checkpoint_bit_for_bit(tmp_path, mnist_dir, monkeypatch):
    from helpers import preempt_at

    from hpclb.errors import Preempted

    recipe = _tiny(tmp_path)
    kw = dict(epochs=2, data_dir=str(mnist_dir.parent), log=lambda m: None)
    whole = sweep.run_sweep(recipe, [256], ["legw"], out_dir=tmp_path / "a",
                            runs_dir=tmp_path / "ra", **kw)
    with monkeypatch.context() as m:
        preempt_at(m, 3)  # as if SIGUSR2 came after step 3 of 4
        with pytest.raises(Preempted):
            sweep.run_sweep(recipe, [256], ["legw"], out_dir=tmp_path / "b",
                            runs_dir=tmp_path / "rb", **kw)
    assert not (tmp_path / "b" / "mnist-lstm.json").exists()  # nothing recorded yet
    said = []
    cut = sweep.run_sweep(recipe, [256], ["legw"], out_dir=tmp_path / "b",
                          runs_dir=tmp_path / "rb", **{**kw, "log": said.append})
    assert any("resuming" in line for line in said)
    one = json.loads((tmp_path / "a" / "points" / "adam-legw-b256-e2-s0" / "summary.json")
                     .read_text())
    two = json.loads((tmp_path / "b" / "points" / "adam-legw-b256-e2-s0" / "summary.json")
                     .read_text())
    assert two["final_test_loss"] == one["final_test_loss"]  # bit for bit
    assert cut[0]["metric"] == whole[0]["metric"] and cut[0]["steps"] == whole[0]["steps"]


def test_micro_batch_accumulates_to_the_global_batch(tmp_path, mnist_dir):
    rows = sweep.run_sweep(_tiny(tmp_path), [256], ["legw"], epochs=1, micro_batch=64,
                           data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
                           runs_dir=tmp_path / "runs", log=lambda m: None)
    assert rows[0]["accumulation_steps"] == 4 and rows[0]["steps"] == 2
    summary = json.loads((tmp_path / "runs" / "mnist-lstm" / "adam-legw-b256-a4-s0" /
                          "summary.json").read_text())
    assert summary["micro_batch_size"] == 64
    with pytest.raises(ConfigError, match="--micro-batch 96"):
        sweep.run_sweep(_tiny(tmp_path), [256], ["legw"], micro_batch=96, runs_dir=tmp_path)


def test_a_point_under_mpirun_that_was_preempted_stops_the_sweep_with_75(tmp_path, monkeypatch):
    """An `mpirun ... hpclb train` point that exits 75 (its ranks checkpointed on a signal) is
    a preemption of the sweep, not a failed point (before: RuntimeError, exit 1)."""
    from hpclb.comm.launcher import Forwarded
    from hpclb.errors import Preempted

    monkeypatch.setattr(sweep, "mpirun_path", lambda: "mpirun")
    monkeypatch.setattr(sweep, "run_forwarding_signals", lambda *a, **k: Forwarded(
        75, "hpclb: rank 0 of 2: preempted after step 7, checkpoint saved; exit 75"))
    p = sweep.Point(256, "legw", 0, "adam", 1.0, 2)
    with pytest.raises(Preempted):
        sweep._run_mpi(_tiny(tmp_path), p, tmp_path / "run", None, False, True)


def test_status_says_how_many_done_points_were_rejected(tmp_path):
    """A rejected point is recorded (its error is the result) and counts as done, but the status
    line says it was not trained (a fresh-user review read "2 done" as two trained points)."""
    from hpclb.tools.sweep_points import Point, SweepStatus

    ok, bad, left = (Point(512, s, 0, "adam", 2.0, 1) for s in ("legw", "goyal", "sqrt"))
    rows = [{"batch_size": 512, "scheme": "legw", "seed": 0, "optimizer": "adam", "epochs": 2.0,
             "status": "done", "error": None, "wall_time_s": 42.0},
            {"batch_size": 512, "scheme": "goyal", "seed": 0, "optimizer": "adam", "epochs": 2.0,
             "status": "done", "error": "schedule: warmup ... must be shorter than training"}]
    st = SweepStatus.of([ok, bad, left], rows, tmp_path, base_batch=128)
    assert st.done == [ok, bad] and st.rejected == [bad] and st.left == [left]
    assert st.line().startswith("2 done (1 of them rejected, not trained: see the table's error "
                                "column), 0 running elsewhere, 1 left (about 0.0 h")
