"""The GPU check's driver: phases in order of value, a verdict and figures per phase.

    python benchmarks/gpu_check/check.py OUT SCRATCH [--cpu-dry-run]

(benchmarks/gpu_check.sh makes SCRATCH, a short folder outside OUT, and removes it.) Everything
the phases write (logs, run directories, TMPDIR, CuPy's cache, the unpacked data, the MPI
runtime) lives in SCRATCH. OUT receives at most 4 files: ``gpu_check.json`` (rewritten,
atomically, before and after every phase: a kill keeps what ran), ``gpu_check_logs.tar.gz``
(every log and run summary, <= 16 MiB, rewritten after every phase) and the benchmark JSONs
``bench_trust_ratio.json`` and ``overlap.json``.

Budget: ``GPU_CHECK_BUDGET_S`` (default 430 s, inside device_run.json's 480 s). Each phase has
an estimate (seconds on one H200, written in the JSON) and a limit; the limit is clipped to
the budget left, and a phase whose estimate no longer fits is "skipped: no time". A skipped
phase is not passed. ``GPU_CHECK_PHASES="kernel nccl"`` runs only those (preflight always).

The MPI runtime travels as wheels (benchmarks/gpu_check/prepare.py puts them into the bundle,
``$GPU_CHECK_BUNDLE`` or ``shared-data/``): installed at the start with ``pip install
--no-index`` into SCRATCH/mpi; its ``mpirun`` runs the MPI phases, and ``MPI4PY_LIBMPI`` makes
mpi4py load its libmpi. Without wheels, ``$MPIRUN`` or an ``mpirun`` on PATH is used; with none,
the MPI phases are "skipped: no MPI runtime".

The CPU dry run runs the same phases with the device parts replaced by the project's CPU
stand-ins: ``--device cpu``, a data subset, fewer steps, and the fused kernel through the CPU
emulator of kernels/testing (the unchanged .cu built with g++) where a GPU would use CuPy.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESERVE_S = 8           # kept back from the budget for the last JSON and archive
ARCHIVE_MAX = 15 << 20  # the log archive stays under the 16 MiB a returned file may have

#: phase: (estimated seconds on one H200, limit in seconds, needs an MPI runtime)
PHASES = {
    "preflight": (20, 60, False),
    "kernel": (30, 120, False),
    "mnist_lstm": (45, 150, False),
    "host_reads": (20, 60, False),
    "fused_vs_torch": (20, 90, False),
    "fp16_lars": (15, 60, False),
    "bf16_lstm_dtype": (10, 45, False),
    "nccl": (25, 60, False),
    "share_gpu": (45, 120, True),
    "stream_order": (12, 45, True),
    "overlap": (35, 90, True),
    "bench_trust_ratio": (40, 90, False),
    "compile": (40, 150, False),
}
#: what no phase can measure on one GPU: said in the JSON, not hidden behind a pass
NOT_MEASURED = ["NCCL between ranks (NCCL refuses two ranks on one GPU; needs >= 2 GPUs)",
                "a CUDA-aware MPI (the carried Open MPI wheel is not; the staged path is tested)"]

GPU_SIZES = dict(dev="cuda", train_samples=None, test_samples=None, mnist_epochs=20,
                 bench_sets="resnet50,bert_large", bench_steps=20, read_steps=20,
                 fused_steps=3, overlap=("32", "224", "8"))
CPU_SIZES = dict(dev="cpu", train_samples=2048, test_samples=1000, mnist_epochs=4,
                 bench_sets="resnet50", bench_steps=1, read_steps=2, fused_steps=3,
                 overlap=("2", "32", "1"))


class Killed(Exception):
    """SIGTERM or SIGINT reached the driver: the check records what ran and stops."""


def _on_signal(signum, frame):
    raise Killed(f"signal {signum}")


class Check:
    """One run of the check: the budget, the phases' records, the environment, OUT."""

    def __init__(self, out: Path, scratch: Path, dry: bool):
        self.out, self.scratch, self.dry = out, scratch, dry
        self.size = CPU_SIZES if dry else GPU_SIZES
        self.py = os.environ.get("PYTHON") or sys.executable
        self.budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "430"))
        self.start = time.monotonic()
        self.deadline = self.start + self.budget
        self.records: list[dict] = []
        self.running: str | None = None
        self.logs = scratch / "logs"
        self.runs = scratch / "runs"
        for d in (self.logs, self.runs, scratch / "tmp", scratch / "cupy"):
            d.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update(
            PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"]
                                    if os.environ.get("PYTHONPATH") else ""),
            HPCLB_KERNELS_DIR=str(REPO / "kernels"), TMPDIR=str(scratch / "tmp"),
            CUPY_CACHE_DIR=str(scratch / "cupy"), HPCLB_SHARE_GPU="1",
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if dry else "4"),
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", PYTHONUNBUFFERED="1")
        self.mpirun: str | None = None
        self.mpi_ok = False
        self.runtime: dict = {}
        self.data = ""
        self.emulator: str | None = None
        self.recipe = str(scratch / "mnist-lstm.yaml")

    # -- time -------------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE_S

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    # -- commands ---------------------------------------------------------------------------
    def sh(self, name: str, argv: list, limit: float, env: dict | None = None,
           phase_end: float | None = None) -> int:
        """Runs ``argv`` (its output to SCRATCH/logs/NAME.log) for at most ``limit`` seconds,
        clipped to the phase's end and the budget; returns its exit status (124: timed out).
        The command runs in its own process group, killed whole on a timeout."""
        bound = min(limit, self.left(), (phase_end or 1e18) - time.monotonic())
        log = self.logs / f"{name}.log"
        if bound < 1:
            log.write_text(f"not started: no time left ({bound:.0f} s)\n")
            return 124
        with open(log, "ab") as f:
            f.write(f"$ {' '.join(map(str, argv))}  (limit {bound:.0f} s)\n".encode())
            f.flush()
            p = subprocess.Popen([str(a) for a in argv], stdout=f, stderr=subprocess.STDOUT,
                                 env={**self.env, **(env or {})}, cwd=REPO,
                                 start_new_session=True)
            try:
                return p.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                f.write(f"\n== timed out after {bound:.0f} s\n".encode())
                return 124
            finally:
                if p.poll() is None:
                    _kill_group(p)

    def log_tail(self, name: str, n: int = 1) -> str:
        p = self.logs / f"{name}.log"
        lines = p.read_text(errors="replace").strip().splitlines() if p.is_file() else []
        return " | ".join(lines[-n:])[:400]

    def mpi(self) -> list[str]:
        """``mpirun -n 2`` with the variables the ranks need (Open MPI's ``-x``), CUDA support
        of Open MPI turned off (the staged path through pinned host memory is under test)."""
        if self.runtime.get("flavor", "openmpi") != "openmpi":
            return [self.mpirun, "-n", "2"]  # MPICH's Hydra passes the whole environment
        names = ["PYTHONPATH", "HPCLB_DATA", "HPCLB_SHARE_GPU", "HPCLB_KERNELS_DIR",
                 "OMP_NUM_THREADS", "CUPY_CACHE_DIR", "TMPDIR", "MPI4PY_LIBMPI",
                 "HPCLB_CUDA_AWARE_MPI", "OMPI_MCA_opal_cuda_support",
                 *sorted(k for k in self.env if k.startswith("OMPI_MCA_"))]
        argv = [self.mpirun, "-n", "2", "--bind-to", "none", "--mca", "opal_cuda_support", "0"]
        for n in dict.fromkeys(names):
            if n in self.env or n in STAGED:
                argv += ["-x", n]
        return argv

    # -- results ----------------------------------------------------------------------------
    def record(self, phase: str, status: str, detail: str, seconds: float,
               figures: dict | None = None, limit: float | None = None) -> None:
        est, lim, _ = PHASES[phase]
        self.records.append(dict(phase=phase, status=status, detail=detail,
                                 seconds=round(seconds, 1), estimate_s=est,
                                 limit_s=round(limit if limit is not None else 0, 1),
                                 figures=figures))
        print(f"== {phase}: {status}" + (f" ({detail[:300]})" if detail else ""), flush=True)

    def summary(self) -> dict:
        got = {r["phase"] for r in self.records}
        failed = [r["phase"] for r in self.records if r["status"] == "fail"]
        skipped = [f"{r['phase']} ({r['status']})" for r in self.records
                   if r["status"].startswith("skipped")]
        missing = [p for p in PHASES if p not in got and p != self.running]
        return {"check": "gpu_check", "host": socket.gethostname(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_dry_run": self.dry,
                "budget_s": self.budget, "estimate_total_s": sum(e for e, _, _ in PHASES.values()),
                "seconds": round(self.elapsed(), 1), "running": self.running,
                "passed": not failed and not skipped and not missing and self.running is None,
                "failed": failed, "skipped": skipped, "not_run": missing,
                "not_measured": NOT_MEASURED, "aims": self.aims(), "scratch": str(self.scratch),
                "runtime": self.runtime, "phases": self.records}

    def aims(self) -> dict:
        """The performance aims with their targets, gathered from the phases' figures: reported
        here, never a phase's verdict."""
        f = {r["phase"]: r.get("figures") or {} for r in self.records}
        over = f.get("overlap", {})
        mnist = f.get("mnist_lstm", {})
        return {"trust_ratio_kernel": f.get("bench_trust_ratio", {}).get("aims"),
                "overlap_hidden_fraction": {k: over.get(k) for k in ("hidden_fraction",
                                                                     "target", "target_met")},
                "mnist_lstm_time_to_98_percent_s": mnist.get("time_to_target_s")}

    def write(self) -> dict:
        """gpu_check.json and the log archive into OUT, each through a rename (atomic)."""
        res = self.summary()
        _atomic(self.out / "gpu_check.json", (json.dumps(res, indent=1) + "\n").encode())
        self.archive()
        return res

    def archive(self) -> None:
        tmp = self.out / ".gpu_check_logs.tar.gz.tmp"
        files = sorted(self.logs.glob("*.log")) + sorted(
            p for p in self.runs.rglob("*") if p.is_file() and p.suffix in
            (".json", ".jsonl", ".log", ".yaml", ".txt") and p.stat().st_size < 4 << 20)
        for cap in (None, 256 << 10):  # a second try keeps only each log's last 256 KiB
            with tarfile.open(tmp, "w:gz") as tar:
                for p in files:
                    arc = str(p.relative_to(self.scratch))
                    if cap is None or p.stat().st_size <= cap:
                        tar.add(p, arcname=arc)
                    else:
                        _add_tail(tar, p, arc, cap)
            if tmp.stat().st_size <= ARCHIVE_MAX:
                break
        os.replace(tmp, self.out / "gpu_check_logs.tar.gz")


STAGED = {"HPCLB_CUDA_AWARE_MPI": "0", "OMPI_MCA_opal_cuda_support": "0"}


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _add_tail(tar: tarfile.TarFile, path: Path, arc: str, cap: int) -> None:
    import io

    with open(path, "rb") as f:
        f.seek(-cap, os.SEEK_END)
        data = b"[... cut to the last bytes ...]\n" + f.read()
    info = tarfile.TarInfo(arc)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def read_json(path: Path):
    """The JSON in ``path`` (its last line when the file holds several), or None."""
    try:
        text = Path(path).read_text().strip()
        try:
            return json.loads(text)
        except ValueError:
            return json.loads(text.splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None


def run_phases(c: Check, phases: dict) -> None:
    """Runs every phase of ``phases`` (name -> function(c, phase_end) -> (ok, detail,
    figures)) in order, recording each; the JSON is written before and after each one."""
    only = os.environ.get("GPU_CHECK_PHASES", "").replace(",", " ").split()
    for name, fn in phases.items():
        est, limit, needs_mpi = PHASES[name]
        if only and name != "preflight" and name not in only:
            c.record(name, "skipped: not selected", f"GPU_CHECK_PHASES={' '.join(only)}", 0)
            continue
        if needs_mpi and not c.mpi_ok:
            c.record(name, "skipped: no MPI runtime", f"no working mpirun ({c.runtime})", 0)
            continue
        left = c.left()
        if left < max(5.0, est / 3):
            c.record(name, "skipped: no time", f"needs ~{est} s, {left:.0f} s left", 0)
            continue
        bound = min(limit, left)
        c.running = name
        c.write()
        t0 = time.monotonic()
        try:
            ok, detail, figures = fn(c, t0 + bound)
        except Killed:
            c.running = None
            c.record(name, "fail", "killed while running (signal)", time.monotonic() - t0,
                     None, bound)
            raise
        except Exception as e:  # a defect of the phase itself: its verdict, not the check's end
            ok, detail, figures = False, f"the phase raised {type(e).__name__}: {e}", None
        c.running = None
        c.record(name, "pass" if ok else "fail", detail, time.monotonic() - t0, figures, bound)
        c.write()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] != "--cpu-dry-run"):
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    from phases import PHASE_FUNCTIONS, prepare

    c = Check(Path(argv[0]), Path(argv[1]), len(argv) == 3)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"gpu_check: out {c.out}, scratch {c.scratch}, budget {c.budget:.0f} s"
          + (", CPU dry run" if c.dry else ""), flush=True)
    try:
        prepare(c)
        run_phases(c, PHASE_FUNCTIONS)
    except Killed as e:
        print(f"gpu_check: stopped by {e}", flush=True)
    res = c.write()
    print(f"gpu_check: {'PASS' if res['passed'] else 'FAIL'} in {res['seconds']:.0f} s; failed "
          f"{res['failed']}, skipped {res['skipped']}, not run {res['not_run']} -> "
          f"{c.out / 'gpu_check.json'}", flush=True)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main(sys.argv[1:]))
