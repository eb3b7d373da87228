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
    ("HPCLB_OVERLAP", "threads", r"\$HPCLB_OVERLAP='threads': choose one of auto, thread, "
                                 r"nonblocking, none"),
    ("HPCLB_COMPRESSION", "fp8", r"\$HPCLB_COMPRESSION='fp8': choose one of none, fp16, bf16"),
    ("HPCLB_STALL_TIMEOUT_S", "1m", r"\$HPCLB_STALL_TIMEOUT_S='1m': must be a finite number "
                                    r"of seconds \(e.g. 60\)"),
    ("HPCLB_STALL_TIMEOUT_S", "0", r"\$HPCLB_STALL_TIMEOUT_S='0': must be a number of seconds "
                                   r"> 0"),
    ("HPCLB_FUSION_THRESHOLD_BYTES", "0", r"\$HPCLB_FUSION_THRESHOLD_BYTES='0': a fusion "
                                          r"threshold=0 must be a positive number of bytes"),
    ("HPCLB_CUDA_AWARE_MPI", "2", r"\$HPCLB_CUDA_AWARE_MPI='2': choose one of 0, 1"),
    ("HPCLB_TRUST_BACKEND", "cuda", r"\$HPCLB_TRUST_BACKEND='cuda': choose one of auto, torch"),
    ("HPCLB_ABORT_ON_EXCEPTION", "maybe", r"\$HPCLB_ABORT_ON_EXCEPTION='maybe': choose one of 0"),
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
