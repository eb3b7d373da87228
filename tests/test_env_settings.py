"""A bad ``HPCLB_*`` gradient-sync variable is refused at start-up through the real command
line, exit 2, naming the variable, its value and the valid values (before: a ValueError at the
first optimizer, exit 1, naming an argument the user never passed)."""
from __future__ import annotations

import re

import pytest
from helpers import LAUNCH_ENV, run_hpclb

from hpclb.sync.options import check_environment

ENV = {k: v for k, v in LAUNCH_ENV.items()
       if not k.startswith(("HPCLB_OVERLAP", "HPCLB_COMPRESSION", "HPCLB_STALL", "HPCLB_FUSION",
                            "HPCLB_CUDA_AWARE", "HPCLB_TRUST_BACKEND", "HPCLB_ABORT_ON"))}

CASES = [
    ("HPCLB_OVERLAP", "threads", r"\$HPCLB_OVERLAP: must be one of auto, thread, nonblocking, "
                                 r"none .*got 'threads'"),
    ("HPCLB_COMPRESSION", "fp8", r"\$HPCLB_COMPRESSION: must be one of none, fp16, bf16 .*got "
                                 r"'fp8'"),
    ("HPCLB_STALL_TIMEOUT_S", "1m", r"\$HPCLB_STALL_TIMEOUT_S: must be a number of seconds > 0 "
                                    r"\(e.g. 60\), got '1m'"),
    ("HPCLB_STALL_TIMEOUT_S", "0", r"\$HPCLB_STALL_TIMEOUT_S: must be a number of seconds > 0 "
                                   r".*got '0'"),
    ("HPCLB_FUSION_THRESHOLD_BYTES", "0", r"\$HPCLB_FUSION_THRESHOLD_BYTES: must be a size > 0: "
                                          r"an integer number of bytes .*got '0'"),
    # every variable's message has one form: $NAME: must be <valid>, got <value> (review finding)
    ("HPCLB_CUDA_AWARE_MPI", "2", r"\$HPCLB_CUDA_AWARE_MPI: must be one of 0, 1, got '2'"),
    ("HPCLB_TRUST_BACKEND", "cuda", r"\$HPCLB_TRUST_BACKEND: must be one of auto, torch, got "
                                    r"'cuda'"),
    ("HPCLB_ABORT_ON_EXCEPTION", "maybe", r"\$HPCLB_ABORT_ON_EXCEPTION: must be one of 0, 1, "
                                          r"false, .*got 'maybe'"),
    ("HPCLB_COMM_POLL_S", "-1", r"\$HPCLB_COMM_POLL_S: must be a number of seconds >= 0 "
                                r"\(e.g. 0.0002\), got '-1'"),
    ("HPCLB_STALL_ABORT_S", "0", r"\$HPCLB_STALL_ABORT_S: must be a number of seconds >= the "
                                 r"stall timeout, or never .*got '0'"),
    ("HPCLB_STALL_ABORT_S", "30", r"\$HPCLB_STALL_ABORT_S 30 is below the default "
                                  r"stall_timeout_s 60 seconds.*raise the abort time to 60 or "
                                  r"more"),
]


@pytest.mark.parametrize("var, value, message", CASES)
def test_check_environment_names_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        check_environment()


@pytest.mark.parametrize("ranks, var, value, message", [
    *[(1, *c) for c in CASES[:3]],  # under mpirun -n 2: the first in make test, the others in
    *[pytest.param(2, *c, marks=[pytest.mark.extended] if i else [])  # make test-extended
      for i, c in enumerate(CASES[:3])]])
def test_train_refuses_bad_variable_at_start_up(tmp_path, ranks, var, value, message):
    p = run_hpclb("train", "mnist-lstm", "--epochs", "0.01", "--out", tmp_path / "run",
                  "--data-dir", tmp_path / "nodata", ranks=ranks, timeout=120,
                  env={**ENV, var: value}, mpirun_args=("-x", var))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "hpclb: error: environment: " in out and "Traceback" not in out, out
    assert re.search(message, out), out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_stall_abort_below_the_timeout_names_both_variables(tmp_path, ranks):
    """HPCLB_STALL_ABORT_S below HPCLB_STALL_TIMEOUT_S: exit 2 at start-up on every rank, one
    line naming both variables, their values and the fix (before: a ValueError from the first
    optimizer, exit 1, naming the arguments stall_abort_s/stall_timeout_s, after the run
    directory was made)."""
    env = {**ENV, "HPCLB_STALL_TIMEOUT_S": "10", "HPCLB_STALL_ABORT_S": "5"}
    p = run_hpclb("train", "mnist-lstm", "--epochs", "1", "--out", tmp_path / "run",
                  "--data-dir", tmp_path / "nodata", ranks=ranks, timeout=120, env=env,
                  mpirun_args=("-x", "HPCLB_STALL_TIMEOUT_S", "-x", "HPCLB_STALL_ABORT_S"))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "hpclb: error: environment: $HPCLB_STALL_ABORT_S 5 is below " \
        "$HPCLB_STALL_TIMEOUT_S 10 seconds" in out and "raise the abort time to 10 or more " \
        "(or never), or lower the timeout" in out, out
    assert "Traceback" not in out and out.count("hpclb: error:") == 1, out
    assert not (tmp_path / "run").exists()


def test_library_init_names_a_bad_variable(monkeypatch):
    """hpclb.init() checks the same variables (before: the ValueError came from the first
    DistributedOptimizer and named its arguments)."""
    import hpclb

    monkeypatch.setenv("HPCLB_STALL_TIMEOUT_S", "10")
    monkeypatch.setenv("HPCLB_STALL_ABORT_S", "5")
    with pytest.raises(ValueError, match=r"\$HPCLB_STALL_ABORT_S 5 is below "
                                         r"\$HPCLB_STALL_TIMEOUT_S 10"):
        hpclb.init(backend="self", device="cpu")


def test_hpclb_train_ends_a_hung_job_by_default_and_never_turns_it_off(monkeypatch, tmp_path):
    """`hpclb train` resolves a stall abort of TRAIN_STALL_ABORT_S and gives it to its optimizer
    (no process-wide default: a library GradientSync waits forever unless hpclb.init gave its
    communicator one): a collective that waits that long ends every rank with the diagnosis,
    as torchrun's NCCL timeout does; HPCLB_STALL_ABORT_S=never waits forever, a number of
    seconds replaces the default."""
    from helpers import quick_recipe

    from hpclb.config import resolve
    from hpclb.sync import options
    from hpclb.train.setup import _sync_options

    recipe = quick_recipe(tmp_path)
    monkeypatch.delenv("HPCLB_STALL_ABORT_S", raising=False)
    assert options.SyncOptions.resolve().stall_abort_s is None  # library, no hpclb.init: never
    assert options.SyncOptions.resolve(default_abort_s=300).stall_abort_s == 300  # after init
    sync = resolve(recipe).sync
    assert sync["stall_abort_s"] == options.TRAIN_STALL_ABORT_S == 600
    assert options.SyncOptions.resolve(**_sync_options(sync)).stall_abort_s == 600
    monkeypatch.setenv("HPCLB_STALL_ABORT_S", "never")
    options.check_environment()
    sync = resolve(recipe).sync
    assert sync["stall_abort_s"] is None
    assert options.SyncOptions.resolve(**_sync_options(sync)).stall_abort_s is None
    assert options.SyncOptions.resolve(default_abort_s=300).stall_abort_s is None
    monkeypatch.setenv("HPCLB_STALL_ABORT_S", "120")
    assert options.SyncOptions.resolve().stall_abort_s == 120
    monkeypatch.setenv("HPCLB_STALL_ABORT_S", "sometimes")
    with pytest.raises(ValueError, match="HPCLB_STALL_ABORT_S.*or never"):
        options.check_environment()
