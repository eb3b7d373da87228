"""The GPU scripts run on the CPU so they cannot rot while no GPU is available:
benchmarks/gpu_check.sh --cpu-dry-run (GPU phases 'skipped: no GPU', the rest run) and
benchmarks/gpu_sweeps.sh --smoke (a few steps per point through `hpclb sweep`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
       "MPIRUN": str(Path(sys.executable).parent / "mpirun")}
for var in [v for v in ENV if v.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
    del ENV[var]  # never inherit a surrounding mpirun's identity
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.extended  # ~1 min; the GPU check itself runs on a GPU machine
def test_gpu_check_cpu_dry_run(tmp_path, mnist_dir):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path),
                        "--cpu-dry-run"], capture_output=True, text=True, timeout=280, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    phases = {p["phase"]: p for p in res["phases"]}
    assert list(phases) == ["preflight", "kernel", "mnist_lstm", "lars_cupy_torch", "share_gpu",
                            "stream_order", "overlap"]
    assert res["cpu_dry_run"] and res["passed"] and res["failed"] == []
    assert phases["preflight"]["status"] == "pass" and "mpi4py" in phases["preflight"]["detail"]
    for gpu_only in ("kernel", "mnist_lstm", "lars_cupy_torch", "stream_order", "overlap"):
        assert phases[gpu_only]["status"] == "skipped: no GPU"
    share = phases["share_gpu"]  # two ranks, both backends, equal checksums (CPU stand-in)
    assert share["status"] == "pass"
    assert "CHECKSUMS mpi" in share["detail"] and "CHECKSUMS torch" in share["detail"]


def test_gpu_check_usage_error(tmp_path):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path),
                        "--bogus"], capture_output=True, text=True, timeout=30, env=ENV)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_gpu_sweeps_smoke(tmp_path, mnist_dir):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_sweeps.sh"), str(tmp_path),
                        "--smoke"], capture_output=True, text=True, timeout=280, env=ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.index("plan:") < out.index("== mnist-lstm") and "estimated" in out
    rows = json.loads((tmp_path / "sweeps" / "mnist-lstm-gpu-smoke.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    got = {(row["batch_size"], row["scheme"]) for row in rows}
    assert got == {(128, "legw"), (128, "none"), (1024, "legw"), (1024, "none")}
    assert all(row["metric"] is not None for row in rows)
    for exp in ("ptb-small", "fashion-resnet"):
        if (Path(os.environ.get("HPCLB_DATA", REPO / "data")) /
                {"ptb-small": "ptb", "fashion-resnet": "fashion-mnist"}[exp]).is_dir():
            assert (tmp_path / "sweeps" / f"{exp}-gpu-smoke.md").is_file(), out
