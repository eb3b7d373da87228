"""Library mode never leaves a rank waiting: an exception on one rank, or a rank that leaves the
loop, ends every rank of a real ``mpirun -n 2`` job within seconds (``hpclb.init``)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from helpers import LAUNCH_ENV, MPIRUN, run_bounded

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(240)


PRELUDE = """\
import os, sys, time
import torch
import hpclb
from torch import nn
"""

LOOP = """\
comm = hpclb.init(**INIT)
torch.manual_seed(0)
model = nn.Linear(4, 1)
hpclb.broadcast_parameters(model)
opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
for step in range(1, 6):
    if step == 3 and comm.rank == 1:
        ACTION
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
print("finished", comm.rank, flush=True)
"""


def run_ranks(body: str, tmp_path, ranks: int = 2, timeout: float = 150, env: dict | None = None,
              ) -> tuple[int, str, str, float]:
    """Run the Python ``body`` as ``mpirun -n ranks`` (PYTHONPATH: this checkout); returns
    (exit status, stdout, stderr, seconds). A hang fails through ``timeout``."""
    if not MPIRUN.exists():
        pytest.skip("no mpirun beside the interpreter (make install)")
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    full = {**LAUNCH_ENV, "PYTHONPATH": str(REPO), **(env or {})}
    flags = [f for k in sorted(set(env or {}) | {"PYTHONPATH", "OMP_NUM_THREADS"})
             for f in ("-x", k)]
    t0 = time.monotonic()
    out = run_bounded([MPIRUN, "-n", str(ranks), "--bind-to", "none", *flags,
                       sys.executable, str(script)], cwd=tmp_path, env=full,
                      capture_output=True, text=True, timeout=timeout,
                      stdin=subprocess.DEVNULL)
    return out.returncode, out.stdout, out.stderr, time.monotonic() - t0


def test_an_exception_on_rank_1_ends_every_rank(tmp_path):
    """Before: rank 0 waited in the allreduce forever (a stall warning every 60 s)."""
    rc, out, err, seconds = run_ranks(
        LOOP.replace("INIT", "{}").replace("ACTION", "raise ValueError('boom at step 3')"),
        tmp_path)
    assert rc != 0, out
    assert "finished 0" not in out
    assert "rank 1 of 2: uncaught ValueError: boom at step 3" in err, err[-2000:]
    assert seconds < 90, seconds  # start-up of 2 ranks included; the abort itself takes < 1 s


@pytest.mark.extended  # a slower variant: make test-extended
def test_the_abort_can_be_turned_off_and_then_the_watchdog_ends_the_wait(tmp_path):
    """abort_on_exception=False: rank 1 dies alone; rank 0's lost allreduce is ended by the
    watchdog instead of waiting forever: at its first report, which names rank 1 as exited
    (before: by the library's stall_abort_s)."""
    rc, out, err, seconds = run_ranks(
        LOOP.replace("INIT", "{'abort_on_exception': False, 'stall_abort_s': 4}")
        .replace("ACTION", "raise ValueError('boom at step 3')"),
        tmp_path, env={"HPCLB_STALL_TIMEOUT_S": "1"})
    assert rc != 0, out
    assert "uncaught ValueError" not in err  # the hook was not installed
    assert "ValueError: boom at step 3" in err  # Python's own report from rank 1
    assert "rank 0: aborting the job: rank(s) 1 exited without starting collective #3" in err, \
        err[-2000:]


def test_a_rank_that_leaves_the_loop_is_ended_by_the_stall_abort(tmp_path):
    """Rank 1 sleeps instead of stepping: no exception anywhere; the stall watchdog's library
    default (here 4 s) ends the job."""
    rc, out, err, seconds = run_ranks(
        LOOP.replace("INIT", "{'stall_abort_s': 4}").replace("ACTION", "time.sleep(120)"),
        tmp_path, env={"HPCLB_STALL_TIMEOUT_S": "1"})
    assert rc != 0, out
    assert "rank 0: aborting the job" in err, err[-2000:]
    assert seconds < 100, seconds


def test_a_metric_collective_on_one_rank_only_is_reported_as_mismatched(tmp_path):
    """Rank 0 calls hpclb.mean_over_ranks at step 3, rank 1 does not: before, the blocking
    allreduce behind it was not numbered by the watchdog, so the report said "slow, not
    mismatched ... still computing" until the abort; now it names the mismatch."""
    rc, out, err, seconds = run_ranks(
        LOOP.replace("INIT", "{'stall_abort_s': 4}")
        .replace("if step == 3 and comm.rank == 1:", "if step == 3 and comm.rank == 0:")
        .replace("ACTION", "hpclb.mean_over_ranks(1.0)"),
        tmp_path, env={"HPCLB_STALL_TIMEOUT_S": "1"})
    assert rc != 0, out
    assert "MISMATCHED collective" in err and "mean_over_ranks" in err, err[-3000:]
    assert "gradient bucket" in err and "aborting the job" in err, err[-3000:]
    assert seconds < 100, seconds


def test_a_rank_that_finished_is_named_and_the_job_ends(tmp_path):
    """Rank 0 leaves the loop after two steps and exits, rank 1 goes on (as with ranks given
    different epochs or batch sizes): before, rank 1's report called rank 0 "no reply (dead,
    ...)" and "slow, not mismatched" until stall_abort_s; now it names rank 0 as exited, a
    mismatch, and ends the job at once."""
    rc, out, err, seconds = run_ranks(
        LOOP.replace("INIT", "{'stall_abort_s': 600}")
        .replace("if step == 3 and comm.rank == 1:", "if step == 3 and comm.rank == 0:")
        .replace("ACTION", "break"),
        tmp_path, env={"HPCLB_STALL_TIMEOUT_S": "1"})
    assert rc != 0, out
    assert "finished 0" in out and "finished 1" not in out, out
    assert "MISMATCHED collective" in err and "rank 0 has exited: it left after its " \
        "collective #" in err, err[-3000:]
    assert "rank 1: aborting the job: rank(s) 0 exited without starting collective #" in err
