"""The GPU check's driver: phases in order of value, a verdict and figures per phase.

    python benchmarks/gpu_check/check.py OUT SCRATCH [--cpu-dry-run]

(benchmarks/gpu_check.sh makes SCRATCH, a short folder outside OUT, and removes it.) Everything
the phases write (logs, run directories, TMPDIR, CuPy's cache, the unpacked data, the MPI
runtime) lives in SCRATCH. OUT receives at most 4 files: ``gpu_check.json`` (rewritten,
atomically, before the set-up, after each set-up part and before and after every phase: a kill
keeps what ran), ``gpu_check_logs.tar.gz`` (every log and run summary, <= 16 MiB, rewritten
with it) and the benchmark JSONs ``bench_trust_ratio.json`` and ``overlap.json``.

Set-up (staging.py): the MPI runtime, the data, the recipe, the emulator (dry run), each part
on its own; a part that fails is recorded in the JSON's ``setup`` with what failed, the phases
that need it are "skipped: set-up failed", the others run, and the check does not pass.

Budget: ``GPU_CHECK_BUDGET_S`` (default 430 s, inside device_run.json's 480 s). Each phase has
an estimate (seconds on one H200, written in the JSON) and a limit; the limit is clipped to
the budget left, and a phase whose estimate no longer fits is "skipped: no time"; a phase whose
command is cut because its limit was clipped to the budget is "skipped: budget" (not "fail":
it ran out of the call's time, not of its own). A cut command is stopped whole: SIGTERM to
``mpirun``'s group, then to its ranks' groups, SIGKILL after STOP_GRACE_S
(:func:`hpclb.comm.launcher.stop_session`). A skipped phase is not passed.
``GPU_CHECK_PHASES="kernel nccl"`` runs only those (preflight always), and only the set-up
parts they need.

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
sys.path.insert(0, str(REPO))
from hpclb.comm.launcher import stop_session  # noqa: E402  (stdlib only; no torch)

RESERVE_S = 8           # kept back from the budget for the last JSON and archive
STOP_GRACE_S = 4        # a cut command: SIGTERM, then SIGKILL after this (stop_session)
ARCHIVE_MAX = 15 << 20  # the log archive stays under the 16 MiB a returned file may have

#: phase: (estimated seconds on one H200, limit in seconds, the set-up parts it needs), in the
#: order they run: the kernel's tests, then its benchmark (the main GPU figure), then the
#: ResNet-50 step time the projection model needs, the MNIST-LSTM LEGW points, the probes,
#: and the MPI phases (staging.PARTS: runtime, data, recipe, emulator (dry run only))
PHASES = {
    "preflight": (15, 60, ()),
    "kernel": (30, 120, ("emulator",)),
    "bench_trust_ratio": (40, 90, ()),
    "resnet50_step": (30, 90, ()),
    "mnist_lstm_large": (20, 75, ("data", "recipe")),
    "mnist_lstm_b0": (60, 150, ("data", "recipe")),
    "host_reads": (20, 60, ("data", "recipe")),
    "fused_vs_torch": (20, 90, ("data", "recipe", "emulator")),
    "fp16_lars": (15, 60, ("data", "recipe")),
    "bf16_lstm_dtype": (10, 45, ("data", "recipe")),
    "nccl": (10, 45, ()),
    "share_gpu": (40, 120, ("runtime", "data", "recipe")),
    "stream_order": (12, 45, ("runtime",)),
    "overlap": (30, 90, ("runtime",)),
}
#: what no phase can measure on one GPU: said in the JSON, not hidden behind a pass
NOT_MEASURED = ["NCCL between ranks (NCCL refuses two ranks on one GPU; needs >= 2 GPUs)",
                "a CUDA-aware MPI (the carried Open MPI wheel is not; the staged path is tested)"]

#: ``legw``: (large batch, B0) of the MNIST-LSTM points; ``resnet50``: (batch per GPU, image,
#: timed steps) of the step time
GPU_SIZES = dict(dev="cuda", train_samples=None, test_samples=None, mnist_epochs=20,
                 legw=(8192, 128), bench_sets="resnet50,bert_large", bench_steps=20,
                 read_steps=20, fused_steps=3, overlap=("32", "224", "8"),
                 resnet50=("256", "224", "10"))
CPU_SIZES = dict(dev="cpu", train_samples=2048, test_samples=1000, mnist_epochs=4,
                 legw=(1024, 128), bench_sets="resnet50", bench_steps=1, read_steps=2,
                 fused_steps=3, overlap=("2", "32", "1"), resnet50=("2", "32", "1"))


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
        self.setup: dict[str, dict] = {}  # set-up part -> ok, error, seconds
        self.cut: list[str] = []  # the running phase's commands cut short of their own limit
        self.errors: list[str] = []  # ... and those that failed on their own (not cut)
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
        clipped to the phase's end and the budget; returns its exit status (124: timed out or
        not started for want of time; 126/127: the program could not be started, said in the
        log). The command runs in a session of its own; when it is cut (its time is up, or the
        check is stopped), the whole session is stopped: SIGTERM to its group (``mpirun``), then
        to the groups of what is left (the ranks), SIGKILL after STOP_GRACE_S. A command cut
        short of its own ``limit`` is named in ``self.cut``, one that failed otherwise in
        ``self.errors``."""
        bound = min(limit, self.left(), (phase_end or 1e18) - time.monotonic())
        log = self.logs / f"{name}.log"
        if bound < 1:
            with open(log, "a") as f:
                f.write(f"not started: no time left ({bound:.0f} s)\n")
            self.cut.append(f"{name} (not started, {bound:.0f} s left)")
            return 124
        with open(log, "ab") as f:
            f.write(f"$ {' '.join(map(str, argv))}  (limit {bound:.0f} s)\n".encode())
            f.flush()
            try:
                p = subprocess.Popen([str(a) for a in argv], stdout=f, stderr=subprocess.STDOUT,
                                     env={**self.env, **(env or {})}, cwd=REPO,
                                     start_new_session=True)
            except OSError as e:  # missing, not executable, not a program
                f.write(f"could not start {argv[0]}: {type(e).__name__}: {e}\n".encode())
                self.errors.append(f"{name} (could not start)")
                return 127 if isinstance(e, FileNotFoundError) else 126
            try:
                rc = p.wait(timeout=bound)
                if rc != 0:
                    self.errors.append(f"{name} (exit {rc})")
                return rc
            except subprocess.TimeoutExpired:
                f.write(f"\n== timed out after {bound:.0f} s\n".encode())
                if bound < limit:
                    self.cut.append(f"{name} (limit {limit:.0f} s clipped to {bound:.0f} s)")
                else:
                    self.errors.append(f"{name} (timed out at its limit, {limit:.0f} s)")
                return 124
            finally:
                if p.poll() is None:
                    stop_session(p, grace_s=STOP_GRACE_S)

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
        setup_failed = [f"{k}: {v['error']}" for k, v in self.setup.items() if not v["ok"]]
        failed = [r["phase"] for r in self.records if r["status"] == "fail"]
        skipped = [f"{r['phase']} ({r['status']})" for r in self.records
                   if r["status"].startswith("skipped")]
        missing = [p for p in PHASES if p not in got and p != self.running]
        return {"check": "gpu_check", "host": socket.gethostname(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_dry_run": self.dry,
                "budget_s": self.budget, "estimate_total_s": sum(e for e, _, _ in PHASES.values()),
                "seconds": round(self.elapsed(), 1), "running": self.running,
                "passed": not failed and not skipped and not missing and not setup_failed
                and self.running is None,
                "failed": failed, "skipped": skipped, "not_run": missing,
                "setup_failed": setup_failed, "setup": self.setup,
                "not_measured": NOT_MEASURED, "aims": self.aims(), "scratch": str(self.scratch),
                "runtime": self.runtime, "phases": self.records}

    def aims(self) -> dict:
        """The performance aims with their targets, gathered from the phases' figures: reported
        here, never a phase's verdict."""
        f = {r["phase"]: r.get("figures") or {} for r in self.records}
        over = f.get("overlap", {})
        large, b0 = f.get("mnist_lstm_large", {}), f.get("mnist_lstm_b0", {})
        acc = large.get("final_test_accuracy"), b0.get("final_test_accuracy")
        return {"trust_ratio_kernel": f.get("bench_trust_ratio", {}).get("aims"),
                "resnet50_step": f.get("resnet50_step", {}).get("projection"),
                "overlap_hidden_fraction": {k: over.get(k) for k in ("hidden_fraction",
                                                                     "target", "target_met")},
                "mnist_lstm_legw": {
                    "batch_sizes": [large.get("batch_size"), b0.get("batch_size")],
                    "test_accuracy": list(acc), "target": 0.98,
                    "gap_target": "within 0.3 pp of B0 (issue 14; on the CPU 1 seed of 3)",
                    "large_batch_target_met": None if acc[0] is None else acc[0] >= 0.98,
                    "gap_pp": None if None in acc else round(100 * (acc[0] - acc[1]), 2),
                    "time_to_target_s": [large.get("time_to_target_s"),
                                         b0.get("time_to_target_s")]}}

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


def selected() -> list[str]:
    """The phases of ``GPU_CHECK_PHASES`` (empty: all)."""
    return os.environ.get("GPU_CHECK_PHASES", "").replace(",", " ").split()


def _not_ready(c, needs) -> tuple[str, str] | None:
    """(status, detail) of a phase that cannot run for want of a set-up part, else None."""
    broken = [f"{p}: {c.setup[p]['error']}" for p in needs
              if p in c.setup and not c.setup[p]["ok"]]
    if broken:
        return "skipped: set-up failed", "; ".join(broken)
    if "runtime" in needs and not c.mpi_ok:
        return "skipped: no MPI runtime", f"no working mpirun ({c.runtime})"
    return None


def run_phases(c, phases: dict) -> None:
    """Runs every phase of ``phases`` (name -> function(c, phase_end) -> (ok, detail,
    figures)) in order, recording each; the JSON is written before and after each one. A phase
    that fails because its limit, clipped to the budget left, cut a command (and no command
    failed on its own) is "skipped: budget"; one stopped by a signal is "skipped: stopped"."""
    only = selected()
    for name, fn in phases.items():
        est, limit, needs = PHASES[name]
        if only and name != "preflight" and name not in only:
            c.record(name, "skipped: not selected", f"GPU_CHECK_PHASES={' '.join(only)}", 0)
            continue
        why = _not_ready(c, needs)
        if why:
            c.record(name, *why, 0)
            continue
        left = c.left()
        if left < max(5.0, est / 3):
            c.record(name, "skipped: no time", f"needs ~{est} s, {left:.0f} s left", 0)
            continue
        bound = min(limit, left)
        c.running, c.cut, c.errors = name, [], []
        c.write()
        t0 = time.monotonic()
        try:
            ok, detail, figures = fn(c, t0 + bound)
        except Killed as e:
            c.running = None
            c.record(name, "skipped: stopped", f"the check was stopped ({e}) while this phase "
                     "ran (the call's time limit?)", time.monotonic() - t0, None, bound)
            raise
        except Exception as e:  # a defect of the phase itself: its verdict, not the check's end
            ok, detail, figures = False, f"the phase raised {type(e).__name__}: {e}", None
        c.running = None
        status = "pass" if ok else "fail"
        if not ok and bound < limit and c.cut and not c.errors:
            status, detail = "skipped: budget", (
                f"cut by the budget, not failed: started with {left:.0f} s left, its limit "
                f"{limit} s clipped to {bound:.0f} s (estimate {est} s); cut: "
                f"{', '.join(c.cut)}. {detail}")
        c.record(name, status, detail, time.monotonic() - t0, figures, bound)
        c.write()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] != "--cpu-dry-run"):
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    c = Check(Path(argv[0]), Path(argv[1]), len(argv) == 3)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"gpu_check: out {c.out}, scratch {c.scratch}, budget {c.budget:.0f} s"
          + (", CPU dry run" if c.dry else ""), flush=True)
    c.running = "setup"
    c.write()  # a JSON from the first second on, whatever follows
    try:
        from phases import PHASE_FUNCTIONS
        from staging import prepare

        prepare(c, setup_parts(c.dry))
        c.running = None
        run_phases(c, PHASE_FUNCTIONS)
    except Killed as e:
        print(f"gpu_check: stopped by {e}", flush=True)
    except Exception as e:  # noqa: BLE001 - a defect of the driver itself: recorded, not lost
        c.setup["driver"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(f"gpu_check: the driver raised {type(e).__name__}: {e}", flush=True)
    res = c.write()
    print(f"gpu_check: {'PASS' if res['passed'] else 'FAIL'} in {res['seconds']:.0f} s; failed "
          f"{res['failed']}, skipped {res['skipped']}, not run {res['not_run']}, set-up "
          f"failed {res['setup_failed']} -> {c.out / 'gpu_check.json'}", flush=True)
    return 0 if res["passed"] else 1


def setup_parts(dry: bool) -> set[str]:
    """The set-up parts the selected phases need (the data always: preflight checks it; the
    emulator only in a dry run)."""
    only = selected()
    parts = {"data"}
    for name, (_, _, needs) in PHASES.items():
        if not only or name == "preflight" or name in only:
            parts.update(needs)
    return parts if dry else parts - {"emulator"}


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main(sys.argv[1:]))
