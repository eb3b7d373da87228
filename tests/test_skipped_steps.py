"""A skipped (non-finite) step stays out of the metrics and the run finishes: the real
``hpclb train`` on 1 process and under ``mpirun -n 2``, with one non-finite step (an fp16
overflow at step 1 on every rank, or one NaN sample on the last rank at step 5), through the
host-side guard (Adam) and the device-side one (LARS: no host read in the step)."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import LAUNCH_ENV, MPIRUN, run_bounded

HERE = Path(__file__).resolve().parent
STEPS_PER_EPOCH = 8   # 1,024 samples, global batch 128
RECIPE = {
    "name": "skipped",
    "data": {"name": "nonfinite_plugin:blobs"},
    "model": {"name": "nonfinite_plugin:SpikyMLP"},
    "base_batch_size": 128, "epochs": 2, "optimizer": "adam", "warmup_epochs": 0.25, "log_every": 2,
    "decay": {"name": "poly", "power": 2.0, "end_lr": 0.0},
    "optimizers": {"adam": {"lr": 5.0e-3},
                   "lars": {"lr": 1.0, "momentum": 0.9, "weight_decay": 1.0e-4,
                            "trust_coefficient": 0.02}},
}
CASES = {  # name: (precision, environment)
    "fp16-overflow-at-step-1": ("fp16", {"NONFINITE_MODE": "overflow", "NONFINITE_STEP": "1",
                                         "NONFINITE_RANK": "all"}),
    "nan-sample-at-step-5-last-rank": ("fp32", {"NONFINITE_MODE": "nan_sample",
                                                "NONFINITE_STEP": "5", "NONFINITE_RANK": "last"}),
    "nan-from-step-11-last-rank": ("fp32", {"NONFINITE_MODE": "nan_from",
                                            "NONFINITE_STEP": "11", "NONFINITE_RANK": "last"}),
    "nan-in-the-test-split": ("fp32", {"NONFINITE_MODE": "nan_test"}),
    "nan-sample-at-step-4-last-rank": ("fp32", {"NONFINITE_MODE": "nan_sample",
                                                "NONFINITE_STEP": "4", "NONFINITE_RANK": "last"}),
}


def _env(ranks: int, fault: dict) -> dict:
    env = {k: v for k, v in LAUNCH_ENV.items() if not k.startswith("NONFINITE_")}
    env.update(fault)
    if fault.get("NONFINITE_RANK") == "last":
        env["NONFINITE_RANK"] = str(ranks - 1)
    return env


def _train(tmp_path: Path, ranks: int, optimizer: str, case: str) -> tuple[int, str, Path]:
    precision, fault = CASES[case]
    shutil.copy(HERE / "nonfinite_plugin.py", tmp_path / "nonfinite_plugin.py")
    recipe = tmp_path / "skipped.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "run"
    args = [sys.executable, "-m", "hpclb", "train", str(recipe), "--out", str(out),
            "--optimizer", optimizer, "--precision", precision, "--device", "cpu"]
    if ranks > 1:
        args = [str(MPIRUN), "--bind-to", "none", "-n", str(ranks), *args]
    p = run_bounded(args, capture_output=True, text=True, env=_env(ranks, fault), cwd=tmp_path,
                    timeout=60, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout + p.stderr, out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ranks, optimizer, case", [
    # every optimizer x fault at 1 process; under mpirun -n 2 one of each optimizer and each
    # fault in make test, the other two pairs in make test-extended
    *[(1, o, c) for o in ("adam", "lars") for c in list(CASES)[:2]],
    *[pytest.param(2, o, c, marks=[] if (o == "adam") == (c == list(CASES)[1]) else
                   [pytest.mark.extended]) for o in ("adam", "lars") for c in list(CASES)[:2]]])
def test_one_nonfinite_step_is_skipped_and_the_run_finishes(tmp_path, ranks, optimizer, case):
    if ranks > 1 and not MPIRUN.exists():
        pytest.skip("no mpirun beside the interpreter (make install provides one)")
    rc, text, out = _train(tmp_path, ranks, optimizer, case)
    assert rc == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 2 * STEPS_PER_EPOCH, summary
    assert math.isfinite(summary["final_test_loss"]) and summary["final_test_accuracy"] > 0.5
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in lines if r["kind"] == "epoch"]
    steps = [r for r in lines if r["kind"] == "step"]
    assert len(epochs) == 2 and len(steps) == STEPS_PER_EPOCH, lines
    for row in epochs + steps:  # nothing non-finite reached a metric (json writes NaN/Infinity)
        assert all(math.isfinite(v) for v in row.values()
                   if isinstance(v, float)), row
    assert [r["skipped_steps"] for r in epochs] == [1, 1]
    # the skipped step adds nothing: epoch 1 counts the samples of its 7 applied steps only
    counted = [r["samples_per_s"] * r["epoch_time_s"] for r in epochs]
    assert [round(c) for c in counted] == [1024 - 128, 1024], epochs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ranks", [1, 2])
def test_device_side_guard_stops_a_divergence_at_the_next_step_line(tmp_path, ranks):
    """LARS (no host read in the step): NaN from global step 11 on; the third skip in a row is
    step 13, seen at the step line of step 14 (log_every 2, 4 skipped by then): exit 3 naming
    both, no summary."""
    if ranks > 1 and not MPIRUN.exists():
        pytest.skip("no mpirun beside the interpreter (make install provides one)")
    rc, text, out = _train(tmp_path, ranks, "lars", "nan-from-step-11-last-rank")
    assert rc == 3, text
    assert re.search(r"diverged: non-finite gradient at optimizer step 13 \(first non-finite "
                     r"layer net\.\S+\); 4 step\(s\) in a row skipped.*\(global step 14, epoch "
                     r"2, step 6/8\); the last finite checkpoint is kept in \S+checkpoint\.pt",
                     text), text
    assert not (out / "summary.json").exists()


@pytest.mark.timeout(90)
def test_a_nan_in_the_test_split_is_reported_as_the_data_not_a_divergence(tmp_path):
    """Training is finite, one test sample holds a NaN: the run stops at the first epoch end
    (exit 3, nothing non-finite passes as a result) with a message that points at the test
    data, not at the learning rate."""
    rc, text, out = _train(tmp_path, 1, "adam", "nan-in-the-test-split")
    assert rc == 3, text
    assert re.search(r"non-finite test_loss.* at the end of the epoch while the training loss "
                     r"\([0-9.]+\) and every weight are finite: .*a non-finite value in the test "
                     r"split \(check the data\)", text), text
    assert not (out / "summary.json").exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer", ["lars", pytest.param("adam", marks=pytest.mark.extended)])
def test_the_step_line_of_a_skipped_step_says_skipped_without_ratios(tmp_path, optimizer):
    """The skipped step 4 is a log point (log_every 2): its line says ``step_skipped`` and
    reports no gradient norm or LARS trust ratios (a masked step's ratios read 1.0 but were
    never applied); the other lines report them."""
    rc, text, out = _train(tmp_path, 1, optimizer, "nan-sample-at-step-4-last-rank")
    assert rc == 0, text
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in lines if r["kind"] == "step"}
    assert steps[4]["step_skipped"] is True and steps[4]["grad_norm"] is None, steps[4]
    trust = ("trust_min", "trust_median", "trust_max")
    if optimizer == "lars":
        assert all(steps[4][k] is None for k in trust), steps[4]
    for step, row in steps.items():
        if step != 4:
            assert row["step_skipped"] is False and row["grad_norm"] > 0, row
            assert optimizer != "lars" or all(0 < row[k] for k in trust), row
