"""Launching a benchmark's worker under ``mpirun`` (the venv's Open MPI) and reading back the
JSON it wrote."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["mpirun", "run_group", "run_mpi"]


def mpirun() -> str:
    """The ``mpirun`` beside the running interpreter (the venv's Open MPI), else the one on
    ``PATH``, else the bare name."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else (shutil.which("mpirun") or "mpirun")


def run_group(argv: list[str], env: dict[str, str], timeout_s: float
              ) -> tuple[int, str, str] | None:
    """Run ``argv`` in a session of its own: ``(exit status, stdout, stderr)``, or None when it
    ran past ``timeout_s`` seconds, after killing the whole session (a launcher and every
    process it started: mpirun's ranks, torchrun's workers), not the launcher alone."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return proc.returncode, stdout, stderr


def run_mpi(np_: int, module: str, argv: list[str], out: Path, timeout_s: float,
            tag: str) -> dict | None:
    """``mpirun -n np_ python -m module argv`` (the venv's Open MPI; oversubscribing this
    machine's cores when asked for more ranks than it has, with idle ranks yielding the CPU);
    after ``timeout_s`` seconds mpirun and its ranks are killed. Returns the JSON the worker
    wrote to ``out``, or None after printing why it failed."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    if np_ > (os.cpu_count() or 1):
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    cmd = [mpirun(), "-n", str(np_), "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", module, *argv, "--out", str(out)]
    print(f"[{tag}] mpirun -n {np_} {module} {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    out.unlink(missing_ok=True)
    done = run_group(cmd, env, timeout_s)
    if done is None:
        print(f"[{tag}] {np_} ranks: timed out after {timeout_s:g} s", flush=True)
        return None
    returncode, stdout, stderr = done
    if returncode != 0 or not out.exists():
        print(f"[{tag}] {np_} ranks failed ({returncode}):\n{stdout[-3000:]}\n"
              f"{stderr[-3000:]}", flush=True)
        return None
    print(f"[{tag}]   done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(out.read_text())
