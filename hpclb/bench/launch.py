"""A benchmark's driver side, shared by the benchmarks: its ``python -m`` entry, launching its
worker under ``mpirun`` (the venv's Open MPI) and reading back the JSON it wrote, and writing
its results (JSON, a PNG beside it)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from hpclb._io import write_atomic, write_text_atomic
from hpclb.comm.launcher import (
    explain_launch_failure,
    mpirun_path,
    remove_stale_session_dirs,
    stop_session,
)

__all__ = ["cli_main", "pyplot", "run_group", "run_mpi", "save", "save_png", "write_rank0"]


def run_group(argv: list[str], env: dict[str, str], timeout_s: float
              ) -> tuple[int, str, str] | None:
    """Run ``argv`` in a session of its own: ``(exit status, stdout, stderr)``, or None when it
    ran past ``timeout_s`` seconds, after stopping the whole session (a launcher and every
    process it started: mpirun's ranks, torchrun's workers; SIGTERM, then SIGKILL), not the
    launcher alone. Session directories left by killed launchers are removed first
    (``hpclb.comm.launcher``), so a reused process id cannot stop ``mpirun`` at start-up."""
    remove_stale_session_dirs()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        with _term_exits():
            stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_session(proc)
        return None
    except BaseException:  # Ctrl-C or SIGTERM: the launcher's session ends with the benchmark
        stop_session(proc)
        raise
    return proc.returncode, stdout, stderr


@contextlib.contextmanager
def _term_exits():
    """SIGTERM raises SystemExit(143) within the block (from the main thread), so the caller
    can stop what it started; its default action would end this process alone, leaving the
    launcher (in a session of its own) and its ranks running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_143(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    cmd = [mpirun_path(), "-n", str(np_), "--oversubscribe", "--bind-to", "none",
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
        hint = explain_launch_failure(stdout + stderr)
        print(f"[{tag}] {np_} ranks failed ({returncode}):\n{stdout[-3000:]}\n"
              f"{stderr[-3000:]}" + (f"\n[{tag}] {hint}" if hint else ""), flush=True)
        return None
    print(f"[{tag}]   done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(out.read_text())


def cli_main(module: str, doc: str, argv: list[str] | None, add_run: Callable,
             driver: Callable, add_worker: Callable | None = None,
             worker: Callable | None = None) -> int:
    """``python -m module``: parses ``argv`` (default ``sys.argv[1:]``; the help shows ``doc``)
    with ``add_run``'s options and runs ``driver``; with a ``worker``, as two commands, ``run``
    (the driver) and ``worker`` (``add_worker``'s options: what :func:`run_mpi` starts). Returns
    the exit status of what ran."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if worker is None:
        add_run(p)
        return driver(p.parse_args(argv))
    sub = p.add_subparsers(dest="cmd", required=True)
    add_run(sub.add_parser("run"))
    add_worker(sub.add_parser("worker"))
    args = p.parse_args(argv)
    return driver(args) if args.cmd == "run" else worker(args)


def write_rank0(comm, out: str | Path, doc: dict) -> None:
    """A worker's result: rank 0 of ``comm`` (a Communicator) writes ``doc`` to ``out`` as JSON
    (what :func:`run_mpi` reads back); every rank waits until it is written."""
    if comm.rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    comm.barrier()


def save(out: str | Path, doc: dict, indent: int = 1,
         plot: Callable[[Path], bool] | None = None) -> str:
    """A driver's result: ``doc`` as JSON at ``out`` (atomically, its folder made) and, with
    ``plot``, ``plot(png)`` drawing a PNG beside it (False: nothing drawn). Returns the line
    that says so: ``wrote OUT`` (`` and PNG``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(doc, indent=indent) + "\n")
    png = out.with_suffix(".png")
    return f"wrote {out}" + (f" and {png}" if plot is not None and plot(png) else "")


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), or None without matplotlib
    (a benchmark's plot is then left out)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_png(fig, path: Path, dpi: int) -> bool:
    """``fig`` laid out and written to ``path`` as a PNG of ``dpi`` (atomically, its folder
    made); returns True (drawn)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    return True
