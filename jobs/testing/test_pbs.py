"""A rendered PBS Pro script run as PBS would run it (pbs_run.py): its mpiexec line starts a real
2-rank MNIST-LSTM job over the unique hosts of $PBS_NODEFILE; the walltime's TERM becomes a
checkpoint of the same step on every rank, exit 75, qrerun, and the rerun resumes; the final
parameters equal an uninterrupted run's. A job that ignores TERM is KILLed after kill_delay."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

import pbs_run  # noqa: E402
from joblog import resumes, startups  # noqa: E402

from hpclb.tools import jobs  # noqa: E402

DATA = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def render_quick(tmp: Path, epochs: float) -> Path:
    from helpers import quick_recipe

    if not (DATA / "mnist" / "train-images-idx3-ubyte").is_file():
        pytest.fail(f"real MNIST not staged in {DATA}/mnist; run `make data`")
    recipe = quick_recipe(tmp, epochs=epochs)
    text, plan = jobs.render(jobs.JobSpec(
        experiment=recipe, scheduler="pbs", nodes=1, gpus_per_node=0, tasks_per_node=2,
        per_gpu_batch=128,
        cpus_per_task=1, time="00:15:00", fabric="local", venv=str(REPO / ".venv"),
        data_dir=str(DATA), out="run", job_name="pbsq", checkpoint_interval=0))
    assert plan.global_batch == 256
    path = tmp / "pbsq.pbs"
    path.write_text(text)
    return path


def test_walltime_term_checkpoints_reruns_and_resumes_bit_for_bit(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    ref_dir.mkdir()
    cut_dir.mkdir()
    ref = pbs_run.run(render_quick(ref_dir, epochs=8), ref_dir, env=ENV)
    assert [(a.returncode, a.walltime_hit) for a in ref] == [(0, False)]
    ref_log = (ref_dir / "pbsq.log").read_text()
    started = startups(ref_log, "mnist-lstm")  # one run, on 2 ranks, at global batch 256
    assert [(s.world_size, s.global_batch) for s in started] == [(2, 256)], ref_log
    assert started[0].per_rank_batch in (None, 128), started[0].line
    # the walltime comes during epoch 3 of the first run and epoch 6 of the second
    def walltime_reached(run: int, log: str) -> bool:
        return run < 2 and log.count(f"epoch {3 * run + 2:3d}/8") > 0

    cut = pbs_run.run(render_quick(cut_dir, epochs=8), cut_dir, kill_delay=30, env=ENV,
                      walltime_reached=walltime_reached)
    log = (cut_dir / "pbsq.log").read_text()
    assert [a.walltime_hit for a in cut] == [True, True, False], log
    assert all(a.returncode == 0 and not a.killed for a in cut), log
    n_cut = sum(a.walltime_hit for a in cut)
    assert log.count("got TERM: asking the ranks to checkpoint") == n_cut
    stops = re.findall(r"rank (\d) of 2: preempted after step (\d+)", log)
    assert len(stops) == 2 * n_cut, log
    stopped = []
    for i in range(n_cut):  # both ranks stopped after the same step, then the rerun resumed it
        (r0, s0), (r1, s1) = sorted(stops[2 * i:2 * i + 2])
        assert (r0, r1) == ("0", "1") and s0 == s1, log
        stopped.append(int(s0))
    resumed = resumes(log)  # each rerun from a checkpoint of this run, at the step it stopped
    assert [r.step for r in resumed] == stopped, log
    assert all(r.inside(cut_dir / "run", cut_dir) for r in resumed), log
    assert [s.world_size for s in startups(log, "mnist-lstm")] == [2] * (n_cut + 1), log
    assert log.count("asking PBS to rerun 4242.pbs-emu") == n_cut
    assert log.rstrip().endswith("training exited with 0")
    a = torch.load(ref_dir / "run" / "checkpoint.pt", weights_only=True)
    b = torch.load(cut_dir / "run" / "checkpoint.pt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 128
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert json.loads((ref_dir / "run" / "summary.json").read_text())["final_test_accuracy"] == \
        json.loads((cut_dir / "run" / "summary.json").read_text())["final_test_accuracy"]
    # PBS started it in $HOME; the script went to $PBS_O_WORKDIR itself
    assert not (cut_dir / ".pbs-emu-4242.pbs-emu" / "home" / "run").exists()


def test_a_job_that_ignores_term_is_killed_after_kill_delay(tmp_path):
    text = jobs.render(jobs.JobSpec(experiment="mnist-lstm", scheduler="pbs", nodes=1,
                                    gpus_per_node=2, fabric="local",
                                    venv=str(REPO / ".venv")))[0]
    text = re.sub(r"^TRAIN=\(.*\)$", "TRAIN=(bash -c 'trap \"\" USR2 TERM; sleep 60')", text,
                  flags=re.M)
    script = tmp_path / "stuck.pbs"
    script.write_text(text)
    runs = pbs_run.run(script, tmp_path, walltime_s=4, kill_delay=2, env=ENV)
    assert len(runs) == 1 and runs[0].walltime_hit and runs[0].killed
    assert runs[0].seconds < 15
    assert "got TERM" in (tmp_path / "mnist-lstm-1n.log").read_text()


def test_emulator_refuses_what_pbs_would(tmp_path):
    bad = tmp_path / "bad.pbs"
    bad.write_text((REPO / "jobs" / "pbs" / "mnist-lstm-001n.pbs").read_text()
                   .replace("#PBS -r y", "#PBS -r maybe"))
    with pytest.raises(jobs.JobError, match="-r maybe"):
        pbs_run.run(bad, tmp_path)
    with pytest.raises(ValueError, match="select=16"):
        pbs_run.run(REPO / "jobs" / "pbs" / "mnist-lstm-016n.pbs", tmp_path)


def test_a_sweep_array_subjob_trains_and_records_its_point(tmp_path):
    """`hpclb sweep --submit pbs --no-submit`: a 3-subjob array (`#PBS -J 0-2`); subjob 1 run as
    PBS Pro runs it (PBS_ARRAY_INDEX=1, its own -o file) trains point 1 alone and records it."""
    from helpers import quick_recipe

    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    r = subprocess.run([str(REPO / ".venv" / "bin" / "hpclb"), "sweep", recipe, "--batch-sizes",
                        "128,256,384", "--schemes", "legw", "--data-dir", str(DATA),
                        "--runs-dir", "runs", "--submit", "pbs", "--no-submit"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "not submitted; to submit: qsub " in r.stdout, r.stderr
    script = tmp_path / "runs" / "mnist-lstm" / "mnist-lstm-sweep.pbs"
    assert "#PBS -J 0-2" in script.read_text()
    runs = pbs_run.run(script, tmp_path, env=ENV, subjob=1)
    log = (tmp_path / "mnist-lstm-sweep.1.log").read_text()
    assert [(a.returncode, a.walltime_hit) for a in runs] == [(0, False)], log
    assert "B=256 legw seed 0: training" in log and "B=128" not in log, log
    rows = json.loads((tmp_path / "runs" / "mnist-lstm" / "mnist-lstm.json").read_text())
    assert [(r["batch_size"], r["status"], r["steps"]) for r in rows] == [(256, "done", 2)]
