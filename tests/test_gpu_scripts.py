"""The GPU sweeps script runs on the CPU so it cannot rot while no GPU is available:
benchmarks/gpu_sweeps.sh --smoke (a few steps per point through `hpclb sweep`). The GPU check's
call (benchmarks/gpu_check.sh through device_run.json) is rehearsed in tests/test_gpu_call.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
for var in [v for v in ENV if v.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
    del ENV[var]  # never inherit a surrounding mpirun's identity
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.extended  # ~1 min; make test runs the GPU check's dry run, the first thing on a GPU
def test_gpu_sweeps_smoke(tmp_path, mnist_dir):
    # the data of data/ (or $HPCLB_DATA), not a GPU-check bundle that prepare.py may have left
    # in shared-data/ (MNIST only: the PTB and CNN points would be skipped)
    env = {**ENV, "GPU_CHECK_BUNDLE": str(tmp_path / "no-bundle")}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_sweeps.sh"), str(tmp_path),
                        "--smoke"], capture_output=True, text=True, timeout=280, env=env)
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


def test_gpu_sweeps_reads_the_bundle_as_prepare_lays_it_out(tmp_path, mnist_dir, monkeypatch):
    """The GPU machine holds the GPU check's bundle (benchmarks/gpu_check/prepare.py: mnist/*.gz
    and the wheels), not raw MNIST files: the script takes its data from the bundle, finds
    MNIST there through hpclb's reader (which reads the gzip files) and plans its points, and
    says why the experiments whose data the bundle does not carry are skipped (budget 0: the
    plan only)."""
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu_check"))
    import prepare

    monkeypatch.setenv("HPCLB_DATA", str(mnist_dir.parent))
    bundle = tmp_path / "bundle"
    prepare.bundle_mnist(bundle / "mnist")
    assert sorted(p.name for p in (bundle / "mnist").iterdir()) == sorted(
        f"{n}.gz" for n in prepare.MNIST)
    env = {k: v for k, v in ENV.items() if k != "HPCLB_DATA"}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_sweeps.sh"), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=200,
                       env={**env, "GPU_CHECK_BUNDLE": str(bundle), "GPU_SWEEPS_BUDGET_S": "0"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"data {bundle}" in out
    assert "mnist-lstm: batches 128,1024,8192 x legw,linear,sqrt,none" in out
    assert "ptb-small: skipped, ptb not staged in" in out
    assert "fashion-resnet: skipped, fashion-mnist not staged in" in out


def test_gpu_kmap_plan_is_the_whole_mnist_kmap(tmp_path, mnist_dir):
    """--kmap plans docs/science.md's MNIST-LSTM k-map: LEGW at 128-8192, seeds 0-2, Adam and
    momentum (30 points), within the call's 540 s by its estimate (budget 0: the plan only)."""
    env = {**ENV, "GPU_CHECK_BUNDLE": str(tmp_path / "no-bundle"), "GPU_SWEEPS_BUDGET_S": "0"}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_sweeps.sh"), str(tmp_path),
                        "--kmap"], capture_output=True, text=True, timeout=200, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for opt in ("adam", "momentum"):
        assert (f"mnist-kmap-{opt}: batches 128,1024,2048,4096,8192 x legw ({opt}) x seeds "
                f"0,1,2 = 15 run(s)") in out
    est = int(out.split("estimated ")[1].split()[0])
    assert est <= 540, out


@pytest.mark.extended  # ~1 min
def test_gpu_kmap_smoke(tmp_path, mnist_dir):
    env = {**ENV, "GPU_CHECK_BUNDLE": str(tmp_path / "no-bundle")}
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_sweeps.sh"), str(tmp_path),
                        "--smoke", "--kmap"], capture_output=True, text=True, timeout=280,
                       env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for opt in ("adam", "momentum"):
        rows = json.loads((tmp_path / "sweeps" / f"mnist-kmap-{opt}-gpu-smoke.json").read_text())
        got = {(row["batch_size"], row["seed"], row["optimizer"]) for row in rows}
        assert got == {(b, s, opt) for b in (128, 1024) for s in (0, 1, 2)}, got
        assert all(row["metric"] is not None for row in rows)
    assert (tmp_path / "kmap.tar.gz").is_file()
