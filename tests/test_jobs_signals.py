"""The rendered SLURM script's signal logic, run by bash with stand-ins for srun/scancel/scontrol
(no scheduler here; `make test-slurm` runs the real one): USR2/TERM to the batch shell at any
time after it starts ends in `scontrol requeue` and exit 0, before the launch without starting
the ranks, after it by asking them to checkpoint; the ranks start with USR2/TERM blocked."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpclb.tools import jobs

pytestmark = pytest.mark.timeout(60)

SRUN = """#!/bin/bash
# fake srun: drop srun's options, run the rank command (from `env ...` on) as one rank
echo "srun $*" >> "$FAKE/calls"
while [ "$1" != env ]; do shift; done
exec "$@"
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE/calls"
[ -f "$FAKE/rank.pid" ] && kill -USR2 "$(cat "$FAKE/rank.pid")"
"""
SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE/calls"
"""
MODULE = """#!/bin/bash
# fake `module load`: a slow environment set-up, the window before the launch
touch "$FAKE/module-started"; sleep 3
"""
# What hpclb does: handler first, then unblock (a signal pending from the start is delivered).
RANK = f"""#!{sys.executable}
import os, signal, sys, time
mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
open(os.environ["FAKE"] + "/rank-mask", "w").write(" ".join(sorted(s.name for s in mask)))
signal.signal(signal.SIGUSR2, lambda *a: sys.exit(75))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGUSR2, signal.SIGTERM}})
open(os.environ["FAKE"] + "/rank.pid", "w").write(str(os.getpid()))
open(os.environ["FAKE"] + "/rank-started", "w").write("1")
time.sleep(float(os.environ.get("RANK_SECONDS", "30")))
"""


def setup(tmp_path: Path, **spec) -> tuple[Path, dict]:
    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in (("srun", SRUN), ("scancel", SCANCEL), ("scontrol", SCONTROL),
                       ("module", MODULE), ("rank", RANK)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    text = jobs.render(jobs.JobSpec(experiment="mnist-lstm", scheduler="slurm", nodes=1,
                                    gpus_per_node=0, tasks_per_node=1, venv=None,
                                    fabric="local", **spec))[0]
    text = text.replace("TRAIN=(", f"TRAIN=({fake}/rank ", 1)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE": str(fake),
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "77"}
    return script, env


def wait_for(path: Path, timeout: float = 20) -> None:
    t = time.monotonic()
    while not path.exists():
        assert time.monotonic() - t < timeout, f"{path.name} never appeared"
        time.sleep(0.02)


def calls(tmp_path: Path) -> str:
    f = tmp_path / "fake" / "calls"
    return f.read_text() if f.exists() else ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=["TERM", "USR2"])
def test_signal_before_the_launch_requeues_without_starting(tmp_path, sig):
    script, env = setup(tmp_path, modules=["site/gpu"])
    p = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_for(tmp_path / "fake" / "module-started")
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "came before the launch: nothing to checkpoint, not starting" in out
    assert "srun" not in calls(tmp_path) and "scontrol requeue 77" in calls(tmp_path)


# TERM under -m extended (make test-extended): each case waits out the template's 10-s hold-back;
# TERM's own path is in make test before the launch here and after it in make test-slurm
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.extended),
                                 signal.SIGUSR2], ids=["TERM", "USR2"])
def test_signal_while_the_ranks_run_checkpoints_and_requeues(tmp_path, sig):
    script, env = setup(tmp_path)
    p = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_for(tmp_path / "fake" / "rank-started")
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    name = signal.Signals(sig).name[3:]
    assert f"got {name}: asking the ranks to checkpoint" in out
    assert "training exited with 75" in out and "requeueing 77" in out
    c = calls(tmp_path)
    assert "scancel --signal=USR2 77" in c and "scontrol requeue 77" in c
    # the rank was started with both signals blocked (it unblocks them itself)
    assert (tmp_path / "fake" / "rank-mask").read_text() == "SIGTERM SIGUSR2"


def test_no_signal_no_requeue(tmp_path):
    script, env = setup(tmp_path)
    env["RANK_SECONDS"] = "0"
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "training exited with 0" in r.stdout and "scontrol" not in calls(tmp_path)
    assert "got " not in r.stdout


def test_a_rank_killed_by_the_signal_still_requeues(tmp_path):
    """A rank that dies of the signal (it came before its handler, e.g. a launcher that does
    not start ranks blocked) exits 143, not 75: after a signal the job still requeues."""
    script, env = setup(tmp_path)
    (tmp_path / "fake" / "scancel").write_text(SCANCEL.replace("-USR2", "-KILL"))
    p = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_for(tmp_path / "fake" / "rank-started")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "training exited with 137" in out and "requeueing to resume" in out, out
    assert "scontrol requeue 77" in calls(tmp_path)
