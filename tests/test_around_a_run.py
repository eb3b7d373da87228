"""Around a run, through the real command line at 1 process and under ``mpirun -n 2``:
``--resume auto`` (resume when --out holds a checkpoint, else start afresh), ``--profile
START:END`` (a torch.profiler trace per rank, the step's phases labelled), ``--dry-run`` (the
plan, nothing trained or written) and ``hpclb compare`` (runs side by side); bad input to each
fails with exit 2 and a message naming the fix."""
from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import quick_recipe, run_hpclb

pytestmark = pytest.mark.timeout(240)
STEPS = 8  # optimizer steps of the small recipe (_recipe)


def _recipe(tmp: Path) -> str:
    """MNIST-LSTM on 1,024 train / 500 test images, 1 epoch: 8 steps (2 of warmup)."""
    return quick_recipe(tmp, data={"name": "mnist", "train_samples": 1024, "test_samples": 500})


def _train(recipe: str, out: Path, *args, ranks: int = 1, data: Path):
    p = run_hpclb("train", recipe, "--out", out, "--data-dir", data, "--log-every", 2, *args,
                  ranks=ranks, timeout=180)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mnist_dir):
    """(recipe, run directory) of a finished run started with --resume auto on an empty --out
    and profiled over steps 3 to 5; with its output."""
    tmp = tmp_path_factory.mktemp("finished")
    recipe, out = _recipe(tmp), tmp / "run"
    rc, text = _train(recipe, out, "--resume", "auto", "--profile", "2:5",
                      data=mnist_dir.parent)
    assert rc == 0, text
    return recipe, out, text


def _labels(trace_dir: Path) -> set[str]:
    files = list(trace_dir.glob("rank*.pt.trace.json"))
    assert len(files) == 1, list(trace_dir.iterdir())
    events = json.loads(files[0].read_text())["traceEvents"]
    return {e.get("name") for e in events if str(e.get("name", "")).startswith("hpclb/")}


# --- --resume auto ---------------------------------------------------------------------------

def test_resume_auto_starts_afresh_then_resumes(finished, mnist_dir):
    recipe, out, text = finished
    assert "resumed from" not in text and "--resume auto: no checkpoint" in text, text
    assert "optimizer adam, compile off (eager)" in text, text  # the header names the mode
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps == STEPS
    before = (out / "summary.json").read_bytes(), (out / "config.json").read_bytes()
    rc, text = _train(recipe, out, "--resume", "auto", data=mnist_dir.parent)
    # finished: its checkpoint found, nothing trained, its record left as it is
    assert rc == 0 and re.search(r"holds a finished run \(.* after 8 steps; checkpoint "
                                 r"\S+checkpoint\S*\): nothing left to train", text), text
    assert "epoch   1/" not in text and "summary:" not in text, text
    assert ((out / "summary.json").read_bytes(), (out / "config.json").read_bytes()) == before


def test_resume_auto_replaces_a_run_stopped_before_its_first_checkpoint(finished, tmp_path,
                                                                       mnist_dir):
    recipe, done, _ = finished
    out = tmp_path / "stopped"
    out.mkdir()
    for name in ("config.json", "metrics.jsonl"):  # what a run killed in epoch 1 leaves
        shutil.copy(done / name, out / name)
    rc, text = _train(recipe, out, "--resume", "auto", data=mnist_dir.parent)
    assert rc == 0 and "only the logs of a run stopped before its first one" in text, text
    assert "starting afresh from step 0" in text and "resumed from" not in text, text
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"epoch"' in line]
    assert [r["epoch"] for r in epochs if r["kind"] == "epoch"] == [1]  # the old lines are gone


def test_resume_auto_never_deletes_a_finished_run(finished, tmp_path, mnist_dir):
    recipe, done, _ = finished
    out = tmp_path / "no-checkpoint"
    out.mkdir()
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        shutil.copy(done / name, out / name)
    rc, text = _train(recipe, out, "--resume", "auto", data=mnist_dir.parent)
    assert rc == 2 and "holds a finished run without a checkpoint; add --overwrite" in text, text
    assert (out / "summary.json").exists() and "epoch   1/" not in text


def test_plain_resume_still_needs_a_checkpoint_and_takes_no_other_value(tmp_path, mnist_dir):
    recipe = _recipe(tmp_path)
    rc, text = _train(recipe, tmp_path / "none", "--resume", data=mnist_dir.parent)
    assert rc == 2 and "no checkpoint to resume from" in text and "--resume auto" in text, text
    rc, text = _train(recipe, tmp_path / "none", "--resume", "always", data=mnist_dir.parent)
    assert rc == 2 and "'always': --resume takes no value" in text, text


@pytest.mark.timeout(300)
def test_resume_auto_and_profile_under_mpirun(tmp_path, mnist_dir):
    """2 ranks: rank 0 decides (afresh, then resume), every rank follows; a trace per rank with
    the collectives labelled."""
    recipe, out = _recipe(tmp_path), tmp_path / "run2"
    rc, text = _train(recipe, out, "--resume", "auto", "--profile", "1:3", ranks=2,
                      data=mnist_dir.parent)
    assert rc == 0 and "resumed from" not in text, text
    for rank in (0, 1):
        labels = _labels(out / "profile" / f"rank{rank}")
        assert {"hpclb/forward_backward", "hpclb/allreduce_wait", "hpclb/optimizer"} <= labels
        assert labels & {"hpclb/allreduce", "hpclb/iallreduce"}, labels
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    rc, text = _train(recipe, out, "--resume", "auto", ranks=2, data=mnist_dir.parent)
    assert rc == 0 and text.count("resumed from") == 1, text  # rank 0's header
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


# --- --profile ---------------------------------------------------------------------------------

def test_profile_traces_the_window_with_the_phases_labelled(finished):
    _, out, _ = finished
    labels = _labels(out / "profile" / "rank0")
    assert {"hpclb/data", "hpclb/forward_backward", "hpclb/allreduce_wait",
            "hpclb/optimizer"} <= labels, labels
    events = json.loads(next((out / "profile" / "rank0").glob("*.json")).read_text())
    steps = [e for e in events["traceEvents"] if e.get("name") == "hpclb/optimizer"]
    assert len(steps) == 3  # steps 3, 4, 5 of --profile 2:5


@pytest.mark.parametrize("value,message", [
    ("10", r"--profile '10': must be START:END, two integers >= 0"),
    ("a:b", r"--profile 'a:b': must be START:END"),
    ("-1:3", r"--profile '-1:3': must be START:END, two integers >= 0"),
    ("5:5", r"--profile 5:5: START must be smaller than END"),
    ("7:2", r"--profile 7:2: START must be smaller than END"),
])
def test_bad_profile_syntax_is_refused_before_any_work(tmp_path, value, message):
    p = run_hpclb("train", _recipe(tmp_path), "--out", tmp_path / "o", "--data-dir",
                  tmp_path / "nowhere", f"--profile={value}", timeout=60)
    assert p.returncode == 2 and re.search(message, p.stderr), p.stderr
    assert not (tmp_path / "o").exists()


def test_a_profile_past_the_run_is_refused_before_any_work(tmp_path, mnist_dir):
    rc, text = _train(_recipe(tmp_path), tmp_path / "o", "--profile", "4:20", ranks=1,
                      data=mnist_dir.parent)
    assert rc == 2 and "--profile 4:20: the run has only 8 optimizer steps" in text, text
    assert "choose END <= 8" in text and not (tmp_path / "o").exists()


# --- --dry-run ---------------------------------------------------------------------------------

def _dry(*args, ranks: int = 1, experiment: str = "mnist-lstm"):
    p = run_hpclb("train", experiment, "--dry-run", *args, ranks=ranks, timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("ranks", [1, 2])
def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, ranks):
    out = tmp_path / "o"  # no data staged there: MNIST's size is known to the registry
    rc, stdout, stderr = _dry("--out", out, "--data-dir", tmp_path / "nowhere", "--batch-size",
                              1024, ranks=ranks)
    assert rc == 0, stderr
    assert stdout.count("dry run: hpclb train mnist-lstm") == 1, stdout  # rank 0 only
    per_rank = 1024 // ranks
    for want in (f"world size {ranks} [{'mpi' if ranks > 1 else 'self'}]",
                 f"global 1024 = {ranks} x {per_rank} per rank", "B0 128, k = 8",
                 "legw: peak 0.005657 (B0: 0.002)", "warmup       117 steps = 1.983 epochs "
                 "(9.9% of the run)", "1180 = 20 epochs x 59 steps/epoch on 60000 images",
                 f"{out}: a new run", "sync         buckets of 25 MiB, overlap auto, "
                 "compression none, stall report after 60 s, abort after 600 s"):
        assert want in stdout, stdout
    assert "more than half" not in stderr and not out.exists() and "epoch   1/" not in stdout


def test_dry_run_warns_when_warmup_takes_more_than_half_the_run(tmp_path):
    rc, stdout, stderr = _dry("--out", tmp_path / "o", "--batch-size", 8192)  # k = 64
    assert rc == 0 and "117 steps = 14.62 epochs (73.1% of the run)" in stdout, stdout
    assert re.search(r"hpclb: warning: warmup takes 73% of the run \(more than half\).*train "
                     r"more epochs \(--epochs\)", stderr), stderr


def test_dry_run_warns_of_a_fusion_threshold_in_the_wrong_unit(tmp_path):
    # the warning hpclb train gives when it builds the gradient sync, given by the plan too
    # (review finding: the dry run was silent about it)
    rc, stdout, stderr = _dry("--out", tmp_path / "o", "--fusion-threshold", "64")
    assert rc == 0 and "sync         buckets of 64 B" in stdout, stdout
    assert re.search(r"hpclb: warning: fusion_threshold_bytes=64 bytes makes about one bucket "
                     r"per tensor; the unit is bytes", stderr), stderr


def test_dry_run_tells_what_happens_to_out(finished):
    recipe, out, _ = finished
    rc, stdout, stderr = _dry("--out", out, experiment=recipe)
    assert rc == 2 and "already holds a finished run; add --resume" in stderr, stderr
    # --resume on a finished run trains nothing: not "to continue it" (fresh-user review)
    assert "--resume to keep it (reported, nothing trained)" in stderr, stderr
    rc, stdout, stderr = _dry("--out", out, "--resume", "auto", experiment=recipe)
    # a finished run: the dry run says what the run does (leaves it as it is), not "resumes"
    assert rc == 0 and f"{out}: holds a finished run (global step 8): --resume leaves it as " \
        "it is" in stdout, stdout
    assert "steps        8 = 1 epochs x 8 steps/epoch on 1024 images" in stdout, stdout


@pytest.mark.parametrize("args", [["--epochs", "2"], ["--optimizer", "sgd"]])
def test_dry_run_refuses_an_incompatible_resume_as_the_run_does(finished, mnist_dir, args):
    recipe, out, _ = finished
    rc, stdout, dry = _dry("--out", out, "--resume", "auto", *args, experiment=recipe)
    assert rc == 2 and "dry run:" not in stdout, (stdout, dry)
    rc, text = _train(recipe, out, "--resume", "auto", *args, data=mnist_dir.parent)
    assert rc == 2, text
    error = re.search(r"hpclb: error: .*was made with.*", dry)
    assert error and error.group(0) in text, (dry, text)


@pytest.mark.parametrize("ranks,args,message", [
    (1, ["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (2, ["--batch-size", "1023"], "not divisible by the world size 2"),
    (1, ["--epochs", "0.1"], r"--epochs 0.1: the recipe's warmup .* must be shorter"),
    (1, ["--batch-size", "120000"], "larger than the training set"),
])
def test_dry_run_refuses_what_the_run_would(tmp_path, ranks, args, message):
    rc, stdout, stderr = _dry("--out", tmp_path / "o", *args, ranks=ranks)
    assert rc == 2 and re.search(message, stderr), stderr
    assert stderr.count("hpclb: error:") == 1 and "dry run:" not in stdout


# --- hpclb compare -----------------------------------------------------------------------------

def test_compare_puts_runs_side_by_side(finished, tmp_path):
    _, done, _ = finished
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(done / name, stopped / name)
    summary = json.loads((done / "summary.json").read_text())
    p = run_hpclb("compare", done, stopped, "--format", "csv", timeout=60)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [r["status"] for r in rows] == ["finished", "unfinished"], rows
    for r in rows:
        assert (r["experiment"], r["batch"], r["scheme"], r["optimizer"], r["ranks"]) == \
            ("mnist-lstm", "128", "legw", "adam", "1"), r
        assert r["metric"] == "test_accuracy" and r["steps"] == str(STEPS), r
        assert float(r["final"]) == summary["final_test_accuracy"], r
        assert float(r["best"]) == summary["best_test_accuracy"], r
        assert r["time_to_target_s"] == "", r  # 98% is not reached in 8 steps
    assert float(rows[0]["samples_per_s"]) == pytest.approx(summary["mean_samples_per_s"])
    p = run_hpclb("compare", done, stopped, timeout=60)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and lines[0].startswith("| run | experiment | batch | scheme"), p
    acc = f"{100 * summary['final_test_accuracy']:.2f}%"
    assert len(lines) == 4 and all(f"| {acc} | {acc} |" in line for line in lines[2:]), lines


def test_hpclb_overrides_are_recorded_and_compared(finished, tmp_path, mnist_dir):
    """A run started with HPCLB_COMPRESSION=fp16 and a 1 MiB fusion threshold records the
    settings in force in config.json, and hpclb compare shows them beside a run with the
    defaults (before: two runs that differ in HPCLB_COMPRESSION left identical records)."""
    from helpers import LAUNCH_ENV

    recipe, done, _ = finished
    other = tmp_path / "fp16"
    env = {**LAUNCH_ENV, "HPCLB_COMPRESSION": "fp16", "HPCLB_FUSION_THRESHOLD_BYTES": "1MiB"}
    p = run_hpclb("train", recipe, "--out", other, "--data-dir", mnist_dir.parent, env=env,
                  timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    sync = json.loads((other / "config.json").read_text())["sync"]
    assert sync["compression"] == "fp16" and sync["fusion_threshold_bytes"] == 2 ** 20, sync
    default = json.loads((done / "config.json").read_text())["sync"]
    assert default["compression"] == "none" and default["fusion_threshold_bytes"] == 25 * 2 ** 20
    p = run_hpclb("compare", done, other, "--format", "csv", timeout=60)
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [r["sync"] for r in rows] == [
        "defaults", "fusion_threshold_bytes 1048576, compression fp16"], rows


def test_every_hpclb_override_is_recorded_and_compared(finished, tmp_path, mnist_dir):
    """Every HPCLB_* variable that changes how the gradients travel or when a stall ends the job
    is recorded with its effective value in config.json and shown by hpclb compare (before: the
    overlap asked for, the stall times and the poll interval were recorded but not shown, and
    an overlap of nonblocking at one process read as the default's)."""
    from helpers import LAUNCH_ENV

    recipe, done, _ = finished
    other = tmp_path / "overrides"
    env = {**LAUNCH_ENV, "HPCLB_OVERLAP": "nonblocking", "HPCLB_STALL_TIMEOUT_S": "30",
           "HPCLB_STALL_ABORT_S": "never", "HPCLB_COMM_POLL_S": "0.001",
           "HPCLB_TRUST_BACKEND": "torch"}
    p = run_hpclb("train", recipe, "--out", other, "--data-dir", mnist_dir.parent, env=env,
                  timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    config = json.loads((other / "config.json").read_text())
    sync = config["sync"]
    assert (sync["overlap_setting"], sync["stall_timeout_s"], sync["stall_abort_s"],
            sync["comm_poll_s"], config["trust_backend"]) == ("nonblocking", 30.0, None, 0.001,
                                                              "torch"), config
    default = json.loads((done / "config.json").read_text())["sync"]
    assert (default["overlap_setting"], default["stall_timeout_s"], default["stall_abort_s"],
            default["comm_poll_s"]) == ("auto", 60.0, 600.0, 2e-4), default
    p = run_hpclb("compare", done, other, "--format", "csv", timeout=60)
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [r["sync"] for r in rows] == [
        "defaults", "overlap nonblocking, stall_timeout_s 30.0, stall_abort_s never, "
        "comm_poll_s 0.001, trust_backend torch"], rows


@pytest.mark.parametrize("make,message", [
    (lambda t: t / "missing", "not a run directory (no such directory)"),
    (lambda t: t, "not a run directory (no summary.json and no metrics.jsonl)"),
])
def test_compare_refuses_a_path_that_is_not_a_run(finished, tmp_path, make, message):
    _, done, _ = finished
    p = run_hpclb("compare", done, make(tmp_path), timeout=60)
    assert p.returncode == 2 and message in p.stderr and "--out directory" in p.stderr, p.stderr
    assert p.stdout == ""


def test_compare_tells_a_diverged_run_from_a_cut_one(finished, tmp_path, mnist_dir):
    """A run that stopped on non-finite values (exit 3) was shown as ``unfinished``, like a run
    that was cut; now its metrics.jsonl records the divergence and compare shows ``diverged at
    step S`` (the step exit 3 named), while the cut run stays ``unfinished``."""
    _, done, _ = finished
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 1024,
                                          "test_samples": 500},
                          optimizer="sgd", optimizers={"sgd": {"lr": 1.0e12}})
    rc, text = _train(recipe, tmp_path / "diverged", "--epochs", "2", data=mnist_dir.parent)
    assert rc == 3, text
    step = int(re.findall(r"(?:global|optimizer) step (\d+)", text)[-1])
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(done / name, cut / name)
    p = run_hpclb("compare", tmp_path / "diverged", cut, "--format", "csv", timeout=60)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [r["status"] for r in rows] == [f"diverged at step {step}", "unfinished"], rows
    # the diverged row's steps are the step it stopped at (was 0: no epoch line); the budget and
    # the schedule (peak LR, warmup) are shown, from config.json
    assert int(rows[0]["steps"]) == step and float(rows[0]["epochs"]) == 2.0, rows
    assert float(rows[0]["peak_lr"]) > 0 and rows[0]["warmup_steps"] != "", rows
    md = run_hpclb("compare", tmp_path / "diverged", cut, timeout=60).stdout
    assert "| peak LR | warmup steps |" in md and "| epochs |" in md, md
