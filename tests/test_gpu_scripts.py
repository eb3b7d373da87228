"""The GPU scripts run on the CPU so they cannot rot while no GPU is available:
benchmarks/gpu_check.sh --cpu-dry-run (every phase's command lines on the CPU) and
benchmarks/gpu_sweeps.sh --smoke (a few steps per point through `hpclb sweep`)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
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


PHASES = ["preflight", "kernel", "mnist_lstm", "fused_vs_torch", "fp16_lars", "bf16_lstm_dtype",
          "host_reads", "nccl_world1", "share_gpu", "stream_order", "overlap"]
RESNET50_PARAMS = 25_557_032


def _dry_run(out, **env):
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out),
                           "--cpu-dry-run"], capture_output=True, text=True, timeout=560,
                          env={**ENV, **env})


@pytest.mark.timeout(600)
def test_gpu_check_cpu_dry_run_runs_every_phase(tmp_path, mnist_dir):
    """Every phase's real command lines and helper scripts run on the CPU and pass."""
    out = tmp_path / "out"
    r = _dry_run(out, HPCLB_DATA=str(mnist_dir.parent))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    phases = {p["phase"]: p for p in res["phases"]}
    assert list(phases) == PHASES
    assert res["cpu_dry_run"] and res["passed"] and res["failed"] == []
    assert all(p["status"] == "pass" for p in phases.values()), phases
    pre = phases["preflight"]["figures"]["preflight"]
    assert pre["mpi_runtime"] and pre["missing"] == [] and pre["found"]["mnist"]
    assert all(pre["found"][k] for k in ("torch", "yaml", "tqdm", "pytest", "mpi4py"))
    bench = phases["kernel"]["figures"]["bench_trust_ratio"]
    lars, lamb = bench["sets"]["resnet50"]["lars"], bench["sets"]["resnet50"]["lamb"]
    assert lars["n_params"] == RESNET50_PARAMS and lars["step_ms_torch"] > 0
    assert lars["bytes_per_step"] == 7 * 4 * RESNET50_PARAMS
    assert lamb["bytes_per_step"] == 11 * 4 * RESNET50_PARAMS
    assert lars["kernel_ms"] is None and bench["targets"]["asserted"] is False
    mnist = phases["mnist_lstm"]["figures"]["mnist_lstm"]
    assert mnist["steps"] == 4 * 2 and mnist["mean_samples_per_s"] > 0  # 4 epochs x 2 steps
    for opt in ("lars", "lamb"):
        cmp_ = phases["fused_vs_torch"]["figures"][f"fused_vs_torch_{opt}"]
        assert cmp_["ok"] and cmp_["max_rel_param_diff"] == 0.0  # both on the torch path
    reads = phases["host_reads"]["figures"]["host_reads"]
    assert set(reads["optimizers"]) == {"lars", "lamb", "adam"} and not reads["asserted"]
    assert phases["bf16_lstm_dtype"]["figures"]["bf16_lstm_dtype"]["lstm_output_dtype"]
    assert phases["nccl_world1"]["figures"]["nccl_world1"]["backend"] == "gloo"
    share = phases["share_gpu"]["detail"]  # two ranks, both backends, equal checksums
    assert "CHECKSUMS mpi cpu 2" in share and "CHECKSUMS torch cpu 2" in share
    assert "train mpi exit 0" in share and "train torch exit 0" in share
    over = phases["overlap"]["figures"]["overlap"]
    assert over["world_size"] == 2 and over["blocking_ms"] > 0 and not over["asserted"]
    # every output under OUT: the run directories, logs and JSON
    assert (out / "mnist_lstm_b1024" / "summary.json").is_file() and (out / "kernel_bench.log").is_file()


def test_gpu_check_without_mpi_skips_the_mpi_phases(tmp_path, mnist_dir):
    """No mpirun: preflight says so, the MPI phases are 'skipped: no MPI runtime' (the budget
    of 0 s skips the others quickly)."""
    r = _dry_run(tmp_path, HPCLB_DATA=str(mnist_dir.parent), MPIRUN=str(tmp_path / "no-mpirun"),
                 GPU_CHECK_BUDGET_S="0")
    assert r.returncode == 0, r.stdout + r.stderr
    phases = {p["phase"]: p for p in json.loads((tmp_path / "gpu_check.json").read_text())["phases"]}
    assert list(phases) == PHASES
    assert phases["preflight"]["status"] == "pass"
    assert phases["preflight"]["figures"]["preflight"]["mpi_runtime"] is False
    for p in ("share_gpu", "stream_order", "overlap"):
        assert phases[p]["status"] == "skipped: no MPI runtime"
    assert phases["kernel"]["status"] == "skipped: no time"


def test_the_dry_run_fails_on_a_defect_of_the_script(tmp_path, mnist_dir):
    """Two defects the dry run must catch, in a copy of the tree: a helper importing from a
    module that no longer exists, and a 1-epoch run at batch 1024 with LEGW (warmup 2 epochs
    longer than the run: `hpclb train` exits 2)."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "benchmarks", repo / "benchmarks")
    for d in ("hpclb", "kernels", "tests"):
        (repo / d).symlink_to(REPO / d)
    helper = repo / "benchmarks" / "gpu_check" / "stream_order.py"
    helper.write_text(helper.read_text().replace("from hpclb.comm.world import",
                                                 "from hpclb.no_such_layer.world import"))
    script = repo / "benchmarks" / "gpu_check.sh"
    text = script.read_text()
    assert "train 55 fp16_lars --optimizer lars --scaling sqrt" in text
    script.write_text(text.replace("train 55 fp16_lars --optimizer lars --scaling sqrt",
                                   "train 55 fp16_lars --optimizer lars --scaling legw"))
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(script), str(out), "--cpu-dry-run"], capture_output=True,
                       text=True, timeout=400, env={**ENV, "HPCLB_DATA": str(mnist_dir.parent),
                                                    "GPU_CHECK_PHASES": "fp16_lars stream_order"})
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["failed"] == ["fp16_lars", "stream_order"]
    assert "exit 2" in {p["phase"]: p for p in res["phases"]}["fp16_lars"]["detail"]
    assert "No module named 'hpclb.no_such_layer'" in (out / "stream_order.log").read_text()
    assert "warmup" in (out / "fp16_lars.log").read_text()


def test_gpu_check_reads_the_gzip_bundle(tmp_path, mnist_dir):
    """The GPU machine's case: no HPCLB_DATA, the MNIST files as `make gpu-check-bundle` leaves
    them (shared-data/mnist/*.gz) in the copied tree; unpacked outside OUT, removed at exit."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "benchmarks", repo / "benchmarks")
    for d in ("hpclb", "kernels", "tests"):
        (repo / d).symlink_to(REPO / d)
    (repo / "shared-data" / "mnist").mkdir(parents=True)
    for f in mnist_dir.glob("*-ubyte"):
        with open(f, "rb") as src, gzip.open(repo / "shared-data" / "mnist" / f"{f.name}.gz",
                                             "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in ENV.items() if k != "HPCLB_DATA"}
    r = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out"),
                        "--cpu-dry-run"], capture_output=True, text=True, timeout=200,
                       env={**env, "GPU_CHECK_BUDGET_S": "0", "TMPDIR": str(scratch)})
    assert r.returncode == 0, r.stdout + r.stderr
    pre = json.loads((tmp_path / "out" / "preflight.json").read_text())
    assert pre["missing"] == [] and pre["found"]["mnist"].startswith(str(scratch))
    assert list(scratch.iterdir()) == []  # the unpacked files are gone
    assert not list((tmp_path / "out").rglob("*-ubyte"))


def test_gpu_check_preflight_names_missing_mnist(tmp_path):
    r = _dry_run(tmp_path, HPCLB_DATA=str(tmp_path / "empty"), GPU_CHECK_BUDGET_S="0")
    assert r.returncode == 1
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["failed"] == ["preflight"]
    assert "train-images-idx3-ubyte (absent)" in r.stdout and "gpu-check-bundle" in r.stdout


def test_gpu_check_usage_error(tmp_path):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path),
                        "--bogus"], capture_output=True, text=True, timeout=30, env=ENV)
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.extended  # ~1 min; make test runs the GPU check's dry run, the first thing on a GPU
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
