"""Smoke tests of the benchmarks' code paths at tiny sizes: each driver exits 0 with its ratios in
the JSON, and non-zero when a part fails; the workers' suites at the MPI test runner's world size
(`--only-mpi`, 2 ranks), where every variant carries its own GradientSync. The slower whole runs
(overhead at 2 ranks, logging, scaling at 1 and 2 ranks) are `extended` (make test-extended)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import pytest
from conftest import REPO, all_ranks_ok

TINY_ALLREDUCE = ["--quick", "--rounds", "2", "--max-bytes", "65536", "--step-model",
                  "mnist_lstm", "--sync-workloads", "mnist_lstm", "--no-horovod"]


def hpclb(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpclb", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.extended  # a slower variant: make test-extended
def test_allreduce_cli_two_ranks_reports_ratios(tmp_path):
    """`hpclb bench allreduce --np 2`: exit 0; hpclb against the fastest raw schedule (with the
    buckets each used) and against DDP are in the JSON."""
    out = tmp_path / "a.json"
    r = hpclb("bench", "allreduce", "--np", "2", *TINY_ALLREDUCE, "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert finite(res["hpclb_vs_raw_allreduce"]) and finite(res["hpclb_vs_ddp_gloo"])
    assert finite(res["hpclb_vs_flat_allreduce"]) and finite(res["hpclb_vs_raw_mean_allreduce"])
    assert res["fastest_raw_config"]["schedule"] in ("flat_allreduce", "bucket_allreduce",
                                                     "bucket_iallreduce")
    row = res["runs"]["np2"]["sync"]["mnist_lstm"]["configs"][0]
    assert set(row["raw"]) == {"flat_allreduce", "bucket_allreduce", "bucket_iallreduce",
                               "bucket_allreduce_mean"}
    assert row["raw"]["bucket_allreduce"]["message_bytes"] == row["bucket_bytes"]
    assert res["hpclb_vs_horovod"] is None and res["failed_jobs"] == []
    assert any("Horovod" in n for n in res["notes"])
    configs = res["runs"]["np2"]["sync"]["mnist_lstm"]["configs"]
    assert [c["loss_prescaled"] for c in configs] == [False, False, True]
    assert finite(res["hpclb_divided_vs_raw_mean_allreduce"])


@pytest.mark.extended  # a slower variant: make test-extended
def test_allreduce_parts_sync_alone(tmp_path):
    """`--parts sync`: only GradientSync against the raw schedules is measured (no raw sweep,
    no step, no DDP ratio), and that is no failure."""
    out = tmp_path / "a.json"
    r = hpclb("bench", "allreduce", "--np", "2", *TINY_ALLREDUCE, "--parts", "sync",
              "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    run = res["runs"]["np2"]
    assert "sync" in run and not {"raw_mpi", "raw_gloo", "step"} & set(run)
    configs = [c for w in run["sync"].values() for c in w["configs"]]
    assert configs and all(len(c["sync_times_s"]) == 2 for c in configs)  # --rounds 2
    assert finite(res["hpclb_vs_raw_mean_allreduce"]) and "hpclb_vs_ddp_gloo" not in res


def drive(module, argv: list[str]) -> int:
    """A benchmark's driver in this process, on its own command-line arguments."""
    import argparse
    p = argparse.ArgumentParser()
    module.add_run_arguments(p)
    return module.driver(p.parse_args(argv))


@pytest.mark.parametrize("bench", ["allreduce", "scaling"])
def test_driver_exits_nonzero_when_a_job_fails(tmp_path, bench, capsys):
    """A job that does not finish (here: a timeout shorter than start-up; mpirun and its ranks
    are killed) fails the command."""
    from hpclb.bench import allreduce, scaling
    out = tmp_path / "x.json"
    extra = TINY_ALLREDUCE if bench == "allreduce" else ["--models", "mnist_lstm",
                                                         "--repeat", "1"]
    module = allreduce if bench == "allreduce" else scaling
    assert drive(module, ["--np", "2", *extra, "--timeout", "0.5", "--out", str(out)]) == 1
    assert "timed out" in capsys.readouterr().out
    if bench == "allreduce":
        assert json.loads(out.read_text())["failed_jobs"] == ["np2"]


def two_ranks(comm):
    if comm.world_size < 2 or comm.backend != "mpi":
        pytest.skip("the workers' 2-rank path (run by `make test-mpi`); at 1 process "
                    "test_allreduce_cli_two_ranks_reports_ratios launches it")


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_allreduce_suite_at_world_size(comm):
    """The allreduce worker's suite in this job: one GradientSync per variant (each on its own
    communicator) side by side, ratios against the raw schedules and DDP."""
    two_ranks(comm)
    from hpclb.bench.allreduce import run_suite
    from hpclb.bench.allreduce_report import headline
    args = Namespace(suite="main", quick=True, rounds=2, max_bytes=4096,
                     step_model="mnist_lstm", sync_workloads=["mnist_lstm"],
                     parts=["raw_mpi", "raw_gloo", "sync", "step"])
    try:
        res, err = run_suite(comm, args), ""
    except Exception as e:  # noqa: BLE001 - shared so no rank waits on another
        res, err = None, repr(e)
    all_ranks_ok(comm, res is not None, err)
    h = headline({"np2": res})
    all_ranks_ok(comm, finite(h["hpclb_vs_raw_allreduce"]) and finite(h["hpclb_vs_ddp_gloo"]),
                 f"ratios {h.get('hpclb_vs_raw_allreduce')} {h.get('hpclb_vs_ddp_gloo')}")
    steps = res["step"]["min_step_s"]
    all_ranks_ok(comm, set(steps) == {"compute_only", "hpclb_none", "hpclb_thread",
                                      "hpclb_nonblocking", "ddp_gloo"}, str(steps))


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_scaling_measure_at_world_size(comm):
    """The scaling worker's measurement: blocking and overlapped GradientSync live together."""
    two_ranks(comm)
    from hpclb.bench.measure import Timer
    from hpclb.bench.scaling import measure
    try:
        res, err = measure(comm, Timer(comm), "mnist_lstm", 8, 2), ""
    except Exception as e:  # noqa: BLE001 - shared so no rank waits on another
        res, err = None, repr(e)
    all_ranks_ok(comm, res is not None, err)
    all_ranks_ok(comm, all(finite(res[k]) for k in ("compute_s", "blocking_s", "overlapped_s",
                                                    "comm_s")), str(res))


@pytest.mark.mpi
def test_raw_mean_schedule_delivers_the_mean(comm):
    """The like-for-like baseline ends with what GradientSync delivers: the mean over ranks."""
    from hpclb.bench.raw import RawSchedules
    raw = RawSchedules([8, 16])
    try:
        raw.flat[:] = comm.rank + 1
        raw.bucket_allreduce_mean()
        w = comm.world_size
        assert (raw.flat == sum(range(1, w + 1)) / w).all()
    finally:
        raw.close()


def test_raw_schedules_reject_bad_bucket_sizes():
    """Bucket sizes that are not fp32 multiples are refused, naming the argument."""
    from hpclb.bench.raw import RawSchedules
    with pytest.raises(ValueError, match="bucket_bytes"):
        RawSchedules([6], mpi_comm=object())


TINY_OVERHEAD = ["--workloads", "plugin-cnn", "--train-samples", "512", "--batch-size", "128",
                 "--epochs", "1", "--rounds", "1"]


@pytest.mark.parametrize("setting", ["1proc", pytest.param("2ranks", marks=pytest.mark.extended),
                                     pytest.param("compile", marks=pytest.mark.extended)])
def test_overhead_cli_reports_ratios_and_same_result(tmp_path, setting):
    """`hpclb bench overhead` at 1 process (plain loop) and, extended, 2 ranks (mpirun against
    DDP under torchrun) and --compile against eager: exit 0, ratios in the JSON, both sides end
    with the same test loss."""
    out = tmp_path / "o.json"
    r = hpclb("bench", "overhead", *TINY_OVERHEAD, "--settings", setting, "--out", str(out),
              timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    v = res["results"][f"plugin-cnn/{setting}"]
    assert finite(v["ratio_of_medians"]) and finite(v["paired_ratio_median"])
    assert v["same_result"], v["final_test_loss"]
    assert math.isfinite(v["final_test_loss"]["hpclb"])
    assert res["errors"] == [] and res["results_disagree"] == []


def test_overhead_compile_setting_runs_hpclb_train_compiled_against_eager(tmp_path):
    from hpclb.bench import overhead
    args = Namespace(train_samples=512, batch_size=128, epochs=1.0)
    cmds = overhead.commands("plugin-cnn", "compile", args, tmp_path / "r")
    (compiled, s1), (eager, s0) = cmds["hpclb"], cmds["baseline"]
    assert compiled[-1] == "--compile" and "--compile" not in eager
    assert compiled[:-1] != eager and s0 != s1
    assert [a for a in compiled[:-1] if a != str(s1.parent)] == \
        [a for a in eager if a != str(s0.parent)]      # the same run, another directory


def test_overhead_rounds_alternate_in_fresh_directories(tmp_path, monkeypatch):
    """Each round runs both sides in a directory of its own (hpclb train never reuses a run
    directory), hpclb first in odd rounds and the baseline first in even ones."""
    from hpclb.bench import overhead
    calls = []

    def fake(argv, summary, timeout_s):
        calls.append((summary.parent.name if "hpclb" not in summary.parent.name
                      else summary.parent.parent.name, "plain" not in summary.name))
        return {"wall_s": 1.0, "final_test_loss": 0.5, "final_test_accuracy": 0.9}
    monkeypatch.setattr(overhead, "timed", fake)
    args = Namespace(rounds=3, train_samples=512, batch_size=128, epochs=1.0, timeout=1.0)
    res, errors = overhead.compare("plugin-cnn", "1proc", args, tmp_path / "w")
    assert errors == [] and res["same_result"] and res["ratio_of_medians"] == 1.0
    assert calls == [("round1", True), ("round1", False), ("round2", False), ("round2", True),
                     ("round3", True), ("round3", False)]


def test_overhead_exits_nonzero_when_a_run_fails(tmp_path):
    """A run that does not finish (timeout shorter than start-up) fails the command."""
    from hpclb.bench import overhead
    out = tmp_path / "o.json"
    assert drive(overhead, [*TINY_OVERHEAD, "--settings", "1proc", "--timeout", "0.5",
                            "--out", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["results"]["plugin-cnn/1proc"] is None and "timed out" in res["errors"][0]


def test_plain_loop_schedule_is_hpclbs_legw():
    """The plain loop's hand-written LEGW schedule gives hpclb's LR at every step."""
    import importlib.util

    from hpclb.schedules import Schedule
    spec = importlib.util.spec_from_file_location("plain_loop",
                                                  REPO / "benchmarks" / "plain_loop.py")
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    a = Namespace(num_samples=60000, batch_size=1024, base_batch_size=128, epochs=2.0,
                  warmup_epochs=0.25, base_lr=2e-3, power=2.0)
    s = Schedule.from_recipe(base_lr=2e-3, base_batch_size=128, base_warmup_epochs=0.25,
                             global_batch_size=1024, num_samples=60000, epochs=2.0,
                             scheme="legw", decay="poly", decay_params={"power": 2.0,
                                                                        "end_lr": 0.0})
    assert [plain.lr_at(i, a) for i in range(s.total_steps)] == \
        pytest.approx([s.lr(i) for i in range(s.total_steps)], rel=1e-12)


TINY_LOGGING = ["--train-samples", "1280", "--test-samples", "100", "--epochs", "1",
                "--rounds", "1", "--interleaved-epochs", "10"]


@pytest.mark.extended  # ~25 s: three whole 2-rank training runs and the interleaved part
def test_logging_cli_reports_costs(tmp_path):
    """`hpclb bench logging` at tiny size: exit 0 with both comparisons in the JSON."""
    out = tmp_path / "l.json"
    r = hpclb("bench", "logging", *TINY_LOGGING, "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("logging", "noise_scale"):
        assert math.isfinite(res["comparisons"][key]["cost_percent"])


def test_logging_driver_fails_on_timeout_and_too_few_steps(tmp_path):
    """A job past its timeout exits 1; too few steps for two log intervals is refused before
    any rank starts, naming the flag."""
    from hpclb.bench import logging_cost
    assert drive(logging_cost, [*TINY_LOGGING, "--timeout", "0.5",
                                "--out", str(tmp_path / "l.json")]) == 1
    with pytest.raises(SystemExit, match="--interleaved-epochs"):
        drive(logging_cost, [*TINY_LOGGING[:-1], "1", "--out", str(tmp_path / "l.json")])


@pytest.mark.extended  # ~25 s: mpirun at 1 and 2 ranks
def test_scaling_cli_reports_efficiency(tmp_path):
    """`hpclb bench scaling --np 1 2` at tiny size: exit 0, an efficiency per rank count."""
    out = tmp_path / "s.json"
    r = hpclb("bench", "scaling", "--np", "1", "2", "--models", "mnist_lstm", "--repeat", "1",
              "--rounds", "2", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["table"]["mnist_lstm/weak"]
    assert [row["ranks"] for row in rows] == [1, 2]
    assert all(finite(row["efficiency"]) for row in rows)
