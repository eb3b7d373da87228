"""`hpclb sweep --submit slurm` on a real SLURM (Debian's slurm-wlm, emulated nodes: see
slurm_cluster.py): a 3-point sweep as ONE job array, a task per point, each task training its
point in its batch shell. The task of the longest point gets USR2 (as SLURM's --signal sends it)
mid-training: it checkpoints, exits 75, requeues that task alone (`scontrol requeue` of its job
id), and the requeued task resumes the point from its checkpoint. The results JSON then holds
the 3 rows, equal (metric, steps, schedule) to a plain `hpclb sweep` of the same points, and
`hpclb sweep --status` shows them done and the array's id. Run by `make test-slurm`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

from joblog import resumes  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402
from test_slurm import DATA, JOB_ENV, VENV, log_of, wait_done  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run Debian's SLURM")
HPCLB = str(VENV / "bin" / "hpclb")
EPOCHS = 80  # 1,024 images: 8, 4 and 2 steps per epoch at B = 128, 256, 512 (0.25-1 s/epoch)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm-sweep"), nodes=4, cpus=64, gpus=8).start()
    os.environ.update(JOB_ENV)
    yield c
    c.stop()


def _wait_for(path: Path, ready, what: str, cluster, job: str, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if ready(text):
            return text
        assert time.monotonic() < deadline, f"{what} never came:\n{text}"
        assert cluster.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"{job} {cluster.job_state(job)} before {what}:\n{text}"
        time.sleep(0.2)


@pytest.mark.timeout(1200)
def test_sweep_array_runs_each_point_and_a_preempted_task_resumes(cluster, tmp_path):
    from helpers import quick_recipe

    if not (DATA / "mnist" / "train-images-idx3-ubyte").is_file():
        pytest.fail(f"real MNIST not staged in {DATA}/mnist; run `make data`")
    (tmp_path / ".venv").symlink_to(VENV)
    recipe = quick_recipe(tmp_path, epochs=EPOCHS, data={"name": "mnist", "train_samples": 1024,
                                                         "test_samples": 500})
    argv = [HPCLB, "sweep", recipe, "--batch-sizes", "128,256,512", "--schemes", "legw",
            "--data-dir", str(DATA), "--runs-dir", "runs"]
    t0 = time.monotonic()
    r = subprocess.run(argv + ["--submit", "slurm", "--partition", "gpu", "--time", "00:20:00"],
                       cwd=tmp_path, env=cluster.env(), capture_output=True, text=True)
    print(f"\n{r.stdout}{r.stderr}")
    assert r.returncode == 0, r.stderr
    assert "3 task(s), point(s) 0, 1, 2 of 3" in r.stdout
    array = re.search(r"sbatch --parsable \S+: (\d+)", r.stdout).group(1)
    tasks = [f"{array}_{t}" for t in range(3)]
    # task 0 trains B = 128, the longest point: USR2 once its epoch 2 is done and its launch is
    # over 10 s old (the script holds a signal back for the launch's first 10 s)
    log0 = tmp_path / f"mnist-lstm-sweep-{array}_0.out"
    _wait_for(log0, lambda t: "restart 0 on" in t, "the batch shell of task 0", cluster, tasks[0])
    launched = time.monotonic()
    _wait_for(log0, lambda t: f"epoch   2/{EPOCHS}" in t and time.monotonic() - launched > 11,
              "epoch 2 of task 0", cluster, tasks[0])
    subprocess.run(["scancel", "--signal=USR2", "--batch", tasks[0]], env=cluster.env(),
                   check=True)
    states = [wait_done(cluster, t, 600, restarts=1 if t == tasks[0] else 0) for t in tasks]
    logs = [log_of(cluster, t) for t in tasks]
    print(f"array job {array}: {states} in {time.monotonic() - t0:.0f} s")
    for t, log in zip(tasks, logs):
        print(f"--- {t}\n" + "\n".join(line for line in log.splitlines() if re.search(
            r"\[job\]|sweep mnist-lstm|resum|preempt|^summary", line)))
    assert states == ["COMPLETED"] * 3, logs
    log = logs[0]
    assert cluster.job_field(tasks[0], "Restarts") == "1", log
    assert [cluster.job_field(t, "Restarts") for t in tasks[1:]] == ["0", "0"]
    assert "got USR2: asking the ranks to checkpoint" in log
    step = int(re.search(r"checkpointed at global step (\d+)", log).group(1))
    assert 16 < step < 8 * EPOCHS, log
    assert "training exited with 75" in log and "requeueing" in log
    assert "B=128 legw seed 0: resuming" in log.split("training exited with 75")[1], log
    resumed = resumes(log)
    assert [x.step for x in resumed] == [step], log
    assert resumed[0].inside(tmp_path / "runs" / "mnist-lstm" / "adam-legw-b128-s0", tmp_path)
    assert log.rstrip().endswith("training exited with 0")
    for batch, log in zip((128, 256, 512), logs):
        assert f"B={batch} legw seed 0: training" in log, log  # each task its own point
    rows = json.loads((tmp_path / "runs" / "mnist-lstm" / "mnist-lstm.json").read_text())
    status = subprocess.run(argv + ["--status"], cwd=tmp_path, env=cluster.env(),
                            capture_output=True, text=True).stdout
    print(status)
    assert "3 done, 0 running elsewhere, 0 left" in status
    assert f"array job {array} (slurm, 3 task(s)" in status and "no task in the queue" in status
    # the same points in one plain sweep, after the array (the cores are few), on one thread
    # as the tasks (--cpus-per-task 1): equal rows
    subprocess.run(argv[:-1] + ["plain"], cwd=tmp_path, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    plain = json.loads((tmp_path / "plain" / "mnist-lstm" / "mnist-lstm.json").read_text())
    keys = ("batch_size", "scheme", "status", "metric", "best_metric", "steps", "peak_lr",
            "warmup_steps", "error")
    assert sorted([r[k] for k in keys] for r in rows) == sorted([r[k] for k in keys] for r in plain)
