"""The GPU check's driver (benchmarks/gpu_check/check.py, staging.py) on its own, on the CPU: a
program that cannot start, a phase cut by its limit while ``mpirun -n 2`` runs (real Open MPI),
and a set-up that fails (a garbled MPI hello, a truncated gzip) without ending the check. The
whole call is rehearsed in tests/test_gpu_call.py."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import MPIRUN, running

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu_check"))
from check import Check  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _check(tmp_path: Path) -> Check:
    c = Check(tmp_path / "out", tmp_path / "scratch", dry=True)
    c.out.mkdir(exist_ok=True)
    for k in [k for k in c.env if k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
        del c.env[k]  # never inherit a surrounding mpirun's identity
    return c


def test_a_program_that_cannot_start_is_an_exit_status_in_its_log(tmp_path):
    """A missing or non-executable program: sh() returns 127 / 126 and the log says why (it
    raised before, which ended the check before any gpu_check.json)."""
    c = _check(tmp_path)
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\necho hi\n")
    assert c.sh("missing", [tmp_path / "no-such-program", "-v"], 10) == 127
    assert c.sh("plain", [plain], 10) == 126
    assert "could not start" in c.log_tail("missing") and "No such file" in c.log_tail("missing")
    assert "could not start" in c.log_tail("plain") and "Permission denied" in c.log_tail("plain")


SLEEPER = ("import os, sys, time; open(os.path.join(sys.argv[1], f'pid.{os.getpid()}'), 'w')"
           ".close(); time.sleep(300)")


@pytest.mark.skipif(not MPIRUN.exists(), reason="needs the venv's Open MPI (make install)")
def test_a_phase_cut_by_its_limit_leaves_no_rankrunning(tmp_path):
    """``mpirun -n 2`` of a sleeping script, cut by its limit: every rank ends with it (each
    rank has a process group of its own; killing mpirun's group alone left them running)."""
    c = _check(tmp_path)
    c.mpirun, c.runtime = str(MPIRUN), {"flavor": "openmpi"}
    pids = tmp_path / "pids"
    pids.mkdir()
    rc = c.sh("sleepers", c.mpi() + [sys.executable, "-c", SLEEPER, pids], 15)
    ranks = [int(p.name.split(".")[1]) for p in pids.glob("pid.*")]
    alive = [pid for pid in ranks if running(pid)]
    for pid in alive:  # the old driver's survivors: end them, then fail
        os.kill(pid, 9)
    assert rc == 124 and len(ranks) == 2, (rc, ranks, c.log_tail("sleepers", 5))
    assert alive == [], f"ranks {alive} outlived their phase"
    assert "timed out" in c.log_tail("sleepers", 3)


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HPCLB_", "MPI4PY", "MPIRUN", "GPU_CHECK", "CUPY_",
         "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    return env


FAKE_MPIRUN = """#!/bin/sh
case "$1" in --version) echo "mpirun (Open MPI) 5.0.11"; exit 0;; esac
echo 'HELLO [2, 3, 3.0, 3.0'
echo 'HELLO {"garbled'
"""


@pytest.mark.slow
def test_a_failed_set_up_is_recorded_and_the_phases_that_can_run_do(tmp_path, mnist_dir):
    """A bundle whose train images are a truncated gzip and no wheels; an ``mpirun`` whose
    hello lines are garbled. Before, the first error ended the check with no gpu_check.json.
    Now: the JSON names both set-up failures; the phase that needs neither (resnet50_step)
    passes, the one needing the data is "skipped: set-up failed", the MPI one "skipped"; the
    hello's tries stayed within HELLO_BUDGET_S; the check does not pass."""
    from staging import HELLO_ATTEMPT_S, HELLO_BUDGET_S

    bundle = tmp_path / "bundle" / "mnist"
    bundle.mkdir(parents=True)
    for name in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (bundle / f"{name}.gz").write_bytes(gzip.compress((mnist_dir / name).read_bytes()))
    with open(mnist_dir / "train-images-idx3-ubyte", "rb") as f:
        (bundle / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(f.read(1 << 20))[:4000])
    mpirun = tmp_path / "mpirun"
    mpirun.write_text(FAKE_MPIRUN)
    mpirun.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out),
                        "--cpu-dry-run"], capture_output=True, text=True, timeout=280,
                       env=_env(tmp_path, GPU_CHECK_BUNDLE=str(bundle.parent),
                                MPIRUN=str(mpirun),
                                GPU_CHECK_PHASES="resnet50_step host_reads stream_order"))
    res = json.loads((out / "gpu_check.json").read_text())
    status = {p["phase"]: p["status"] for p in res["phases"]}
    assert r.returncode == 1 and not res["passed"], r.stdout[-3000:] + r.stderr[-2000:]
    assert not res["setup"]["data"]["ok"] and "train-images-idx3-ubyte.gz" in \
        res["setup"]["data"]["error"]
    assert not res["setup"]["runtime"]["ok"] and "garbled" in res["setup"]["runtime"]["error"]
    assert status["resnet50_step"] == "pass"
    assert status["host_reads"] == "skipped: set-up failed"
    assert status["stream_order"] == "skipped: set-up failed"
    assert len(res["setup_failed"]) == 2 and res["running"] is None
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        log = tar.extractfile("logs/runtime_hello.log").read().decode()
    limits = [float(x) for x in re.findall(r"\(limit (\d+) s\)", log)]
    assert 1 <= len(limits) <= 3 and max(limits) <= HELLO_ATTEMPT_S, limits
    assert sum(limits) <= HELLO_BUDGET_S, limits
