"""`hpclb sweep ... --submit slurm|pbs`: one job array, a task per point not yet recorded; the
hidden `--task-index I` runs point I (in process here); `--status` reads the submission. The
array on a real SLURM: jobs/testing/test_sweep_array.py."""
import json
import os
import re
import shlex

import pytest
from helpers import quick_recipe

from hpclb import cli
from hpclb.errors import ConfigError
from hpclb.tools import sweep
from hpclb.tools.jobs_spec import JobSpec
from hpclb.tools.jobs_testing import pbs_resources
from hpclb.tools.sweep_jobs import task_indices, task_points
from hpclb.tools.sweep_points import Point

SMALL = {"name": "mnist", "train_samples": 512, "test_samples": 200}


def _points(batches, schemes, seeds=(0,)):
    return [Point(b, s, seed, "adam", 1, 1) for b in batches for seed in seeds for s in schemes]


def test_one_task_per_unrecorded_point_and_one_per_seed_at_b0():
    points = _points([128, 256], ["legw", "linear"], seeds=(0, 1))
    # order: batch, seed, scheme; at B0 = 128 one task per seed (it records the other scheme)
    assert task_indices(points, lambda p: False, 128) == [0, 2, 4, 5, 6, 7]
    done = {points[0], points[5]}
    assert task_indices(points, done.__contains__, 128) == [1, 2, 4, 6, 7]
    assert task_points(points, 2, 128) == [points[2], points[3]]  # B0 seed 1: both schemes
    assert task_points(points, 5, 128) == [points[5]]
    with pytest.raises(ConfigError, match="--task-index 8: the sweep has 8 point"):
        task_points(points, 8, 128)


def _script_of(tmp_path, recipe, scheduler="slurm", **kw):
    return sweep.submit_sweep(recipe, [512, 128, 256], ["legw"], submit=False,
                              job=JobSpec(recipe, scheduler, 1, 0, venv=None), epochs=2,
                              runs_dir=tmp_path / "runs", data_dir="/data/x", log=lambda m: None,
                              **kw)


def test_slurm_array_renders_a_task_per_point_and_the_task_command(tmp_path):
    recipe = quick_recipe(tmp_path, data=SMALL)
    script = _script_of(tmp_path, recipe)
    assert script == tmp_path / "runs" / "mnist-lstm" / "mnist-lstm-sweep.sbatch"
    text = script.read_text()
    assert re.search(r"^#SBATCH --array=0-2$", text, re.M)
    assert re.search(r"^#SBATCH --output=mnist-lstm-sweep-%A_%a.out$", text, re.M)
    assert re.search(r"^#SBATCH --signal=B:USR2@300$", text, re.M) and "--requeue" in text
    assert "TASKS=(0 1 2)\n" in text
    assert "#   1: B=256 legw seed 0 -> " in text and "adam-legw-b256-e2-s0" in text
    train = re.search(r"^TRAIN=\((.*)\)$", text, re.M).group(1)
    assert shlex.split(train) == [
        "hpclb", "sweep", recipe, "--batch-sizes", "128,256,512", "--schemes", "legw",
        "--seeds", "0", "--epochs", "2", "--ranks", "1", "--data-dir", "/data/x", "--runs-dir",
        str(tmp_path / "runs"), "--verbose", "--task-index", "${TASKS[${SLURM_ARRAY_TASK_ID:-0}]}"]
    # the task runs in the batch shell, in the background; 75 requeues that task
    assert 'env --block-signal=USR2 --block-signal=TERM "${TRAIN[@]}"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "srun" not in text.split("TRAIN=")[1]
    assert "kill -USR2 \"$LAUNCH\"" in text and "$OUT" not in text


def test_pbs_array_renders_a_subjob_per_point(tmp_path):
    recipe = quick_recipe(tmp_path, data=SMALL)
    text = _script_of(tmp_path, recipe, "pbs").read_text()
    res = pbs_resources(text)
    assert res["array"] == (0, 2, 1) and res["rerunnable"] is True
    assert res["output"] == "mnist-lstm-sweep.^array_index^.log"
    assert '--task-index "${TASKS[${PBS_ARRAY_INDEX:-0}]}"' in text
    assert 'qrerun "${PBS_JOBID}"' in text
    one = sweep.submit_sweep(recipe, [256], ["legw"], submit=False, log=lambda m: None,
                             job=JobSpec(recipe, "pbs", 1, 0), runs_dir=tmp_path / "one")
    assert "#PBS -J" not in one.read_text()  # PBS Pro's -J needs 2 subjobs: a plain job
    assert "TASKS=(0)" in one.read_text() and pbs_resources(one.read_text())["output"] == \
        "mnist-lstm-sweep.log"


def test_the_job_must_have_the_points_ranks(tmp_path):
    recipe = quick_recipe(tmp_path, data=SMALL)
    with pytest.raises(ConfigError, match="--nodes 2 x 4 rank.* = 8 ranks, but the points run "
                                          "on --ranks 1"):
        sweep.submit_sweep(recipe, [256], ["legw"], submit=False, log=lambda m: None,
                           job=JobSpec(recipe, "slurm", 2, 4), runs_dir=tmp_path)
    script = sweep.submit_sweep(recipe, [256], ["legw"], ranks=4, submit=False,
                                job=JobSpec(recipe, "slurm", 2, 0), runs_dir=tmp_path,
                                log=lambda m: None)  # CPU nodes: 2 ranks per node
    assert "#SBATCH --ntasks-per-node=2" in script.read_text()


@pytest.mark.slow
def test_task_index_runs_its_point_then_only_the_rest_is_submitted(tmp_path, mnist_dir,
                                                                   monkeypatch, capsys):
    recipe = quick_recipe(tmp_path, data=SMALL)
    kw = dict(epochs=1, data_dir=str(mnist_dir.parent), runs_dir=tmp_path / "runs",
              log=lambda m: None)
    # point 0 is B0 legw: its task trains it and records linear's row from it (k = 1)
    rows = sweep.run_sweep(recipe, [128, 256], ["legw", "linear"], task_index=0, **kw)
    assert [(r["batch_size"], r["scheme"]) for r in rows] == [(128, "legw"), (128, "linear")]
    assert rows[0]["steps"] == 4 and rows[1]["metric"] == rows[0]["metric"]
    saved = json.loads((tmp_path / "runs" / "mnist-lstm" / "mnist-lstm.json").read_text())
    assert len(saved) == 2 and not (tmp_path / "runs" / "mnist-lstm" / "adam-legw-b256-s0").exists()
    # the submission: the two points left, an array of 2; the id in the state file --status reads
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", 'echo "4242;hpclbtest"'),
                       ("squeue", "printf 'RUNNING\\nPENDING\\n'")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    argv = ["sweep", recipe, "--batch-sizes", "128,256", "--schemes", "legw,linear", "--epochs",
            "1", "--data-dir", str(mnist_dir.parent), "--runs-dir", str(tmp_path / "runs")]
    assert cli.main(argv + ["--submit", "slurm", "--venv", ""]) == 0
    out = capsys.readouterr().out
    assert "2 task(s), point(s) 2, 3 of 4" in out and "sbatch --parsable" in out and "4242" in out
    text = (tmp_path / "runs" / "mnist-lstm" / "mnist-lstm-sweep.sbatch").read_text()
    assert "#SBATCH --array=0-1" in text and "TASKS=(2 3)" in text
    assert cli.main(argv + ["--status"]) == 0
    out = capsys.readouterr().out
    assert "2 done" in out and "2 left" in out
    assert re.search(r"array job 4242 \(slurm, 2 task\(s\), submitted .*\): 1 pending, 1 running",
                     out), out


def test_a_one_node_cpu_task_shares_its_node_unless_asked(tmp_path):
    """A sweep's 1-rank CPU task asked for a whole node (--exclusive) unless --shared was given:
    an array of them held a node each for one core (and a 1-GPU point a whole GPU node). Now a
    one-node task shares by default; --exclusive asks for whole nodes; `hpclb jobs render`
    keeps whole nodes by default."""
    recipe = quick_recipe(tmp_path, data=SMALL)

    def script(*flags, cmd="sweep"):
        out = tmp_path / f"{cmd}-{len(list(tmp_path.iterdir()))}"
        argv = [cmd, recipe, "--batch-sizes", "256", "--schemes", "legw", "--submit", "slurm",
                "--no-submit", "--runs-dir", str(out), *flags] if cmd == "sweep" else \
            ["jobs", "render", "--scheduler", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "0",
             "--tasks-per-node", "1", "-o", str(out), *flags]
        assert cli.main(argv) == 0
        return (next(out.rglob("*.sbatch")) if cmd == "sweep" else out).read_text()

    assert "#SBATCH --exclusive" not in script()
    assert "#SBATCH --exclusive" in script("--exclusive")
    assert "#SBATCH --exclusive" not in script("--gpus-per-node", "1")
    assert "#SBATCH --exclusive" in script("--gpus-per-node", "1", "--exclusive")
    assert "#SBATCH --exclusive" in script(cmd="jobs")
    assert "#SBATCH --exclusive" not in script("--shared", cmd="jobs")


def test_a_point_the_schedule_refuses_gets_no_task(tmp_path):
    """--submit sent a task for a point certain to be refused (it ran, to exit 1): the point
    is recorded as rejected at submission and the array has a task for each other point."""
    recipe = quick_recipe(tmp_path, data=SMALL)
    said: list[str] = []
    script = sweep.submit_sweep(recipe, [128, 512], ["legw"], submit=False, log=said.append,
                                job=JobSpec(recipe, "slurm", 1, 0, venv=None), epochs=1,
                                runs_dir=tmp_path / "runs")
    text = script.read_text()
    assert "TASKS=(0)\n" in text and "B=512" not in text, text
    assert any("B=512 legw seed 0: rejected" in m for m in said), said
    rows = json.loads((tmp_path / "runs" / "mnist-lstm" / "mnist-lstm.json").read_text())
    assert [(r["batch_size"], r["status"]) for r in rows] == [(512, "rejected")]


def test_status_creates_nothing(tmp_path, capsys):
    """--status reads; it made <runs-dir>/<experiment>/.results.lock where nothing was."""
    recipe = quick_recipe(tmp_path, data=SMALL)
    runs = tmp_path / "committed"
    runs.mkdir()
    assert cli.main(["sweep", recipe, "--batch-sizes", "128,256", "--schemes", "legw",
                     "--runs-dir", str(runs), "--status"]) == 0
    assert "0 done" in capsys.readouterr().out
    assert list(runs.iterdir()) == []


def test_seed_and_seeds_together_are_refused(tmp_path, capsys):
    """--seed 3 --seeds 0,1 ran seed 3 alone, dropping --seeds without a word."""
    with pytest.raises(SystemExit) as e:
        cli.main(["sweep", "mnist-lstm", "--batch-sizes", "128", "--schemes", "legw",
                  "--seed", "3", "--seeds", "0,1", "--status"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
