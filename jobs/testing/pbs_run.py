"""Run a rendered PBS Pro script the way PBS would, on this host (no PBS server installs here:
not in Debian 12, not on PyPI).

What PBS Pro does and this reproduces:
- the directives are read first (:func:`hpclb.tools.jobs_testing.pbs_resources`: select, ncpus, ngpus,
  mpiprocs, walltime, -r), and a script PBS would reject is not run;
- ``$PBS_NODEFILE`` lists each chunk's host once per ``mpiprocs`` (here: this host, so a
  1-chunk script gets ``mpiprocs`` lines), ``PBS_O_WORKDIR`` is the submit directory,
  ``PBS_JOBID``/``PBS_JOBNAME``/``PBS_QUEUE``/``PBS_ENVIRONMENT`` are set, and the script starts
  in ``$HOME`` (it must ``cd "$PBS_O_WORKDIR"`` itself);
- stdout and stderr go to the ``-o`` file (``-j oe``), relative to the submit directory;
- at the walltime every process of the job (its session, as MoM tracks it) gets SIGTERM, then
  SIGKILL after ``kill_delay`` seconds (PBS Pro's default is 10 s); whatever is left in the
  session when the script ends is killed too;
- ``qrerun $PBS_JOBID`` from inside the job (a stub on PATH records it) makes a rerunnable
  (``-r y``) job run again from the top, with the same job id, as PBS does on a rerun.

    python jobs/testing/pbs_run.py jobs/pbs/x.pbs --workdir DIR [--walltime 20]
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpclb.tools.jobs_testing import pbs_resources

QRERUN = """#!/bin/bash
# qrerun stub of the PBS emulation: records the request; the emulator reruns the job.
echo "$@" >> "$PBS_EMU_DIR/qrerun"
"""


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: what PBS's MoM signals for a job."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
            pids.append(int(d.name))
    return pids


def kill_session(sid: int, sig: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Attempt:
    returncode: int
    walltime_hit: bool
    killed: bool
    seconds: float
    leftovers: list  # pids still in the job's session when its script ended (killed then)


def run(script: Path, workdir: Path, *, walltime_s: float | None = None, kill_delay: float = 10.0,
        jobid: str = "4242.pbs-emu", max_runs: int = 4, env: dict | None = None,
        walltime_reached: Callable[[int, str], bool] | None = None,
        subjob: int | None = None) -> list[Attempt]:
    """Run ``script`` as PBS would (see the module docstring); returns one Attempt per run.

    ``walltime_s`` overrides the script's walltime; ``walltime_reached(run_index, log_text)``,
    polled every 0.2 s, lets a test put the walltime at a point of progress instead of a time
    (start-up takes from 3 to 30 s on a loaded machine). ``subjob`` I of a job array (``-J``):
    that subjob alone, as PBS Pro runs it: ``PBS_ARRAY_INDEX=I``, job id ``4242[I].pbs-emu``,
    ``^array_index^`` in the ``-o`` path replaced by I."""
    script, workdir = Path(script).resolve(), Path(workdir).resolve()
    text = script.read_text()
    res = pbs_resources(text)
    if subjob is not None:
        first, last, step = res["array"]
        assert subjob in range(first, last + 1, step), f"{subjob} is not a subjob of {script}"
        seq, _, server = jobid.partition(".")
        jobid = f"{seq}[{subjob}].{server}"
        env = {**(env or {}), "PBS_ARRAY_INDEX": str(subjob)}
        res["output"] = res.get("output", "").replace("^array_index^", str(subjob)) or None
    if res["select"] != 1:
        raise ValueError(f"{script}: select={res['select']}; this host can only stand in for "
                         f"1-chunk jobs")
    emu = workdir / f".pbs-emu-{jobid}"
    (emu / "bin").mkdir(parents=True, exist_ok=True)
    (emu / "home").mkdir(exist_ok=True)
    (emu / "bin" / "qrerun").write_text(QRERUN)
    (emu / "bin" / "qrerun").chmod(0o755)
    nodefile = emu / "nodefile"
    nodefile.write_text((socket.gethostname() + "\n") * res["mpiprocs"])
    out = workdir / (res.get("output") or f"{res.get('name', 'job')}.o{jobid.split('.')[0]}")
    limit = walltime_s if walltime_s is not None else res["walltime"]
    attempts: list[Attempt] = []
    for n in range(max_runs):
        (emu / "qrerun").unlink(missing_ok=True)
        job_env = {**os.environ, **(env or {}),
                   "PATH": f"{emu / 'bin'}:{os.environ['PATH']}", "HOME": str(emu / "home"),
                   "PBS_O_WORKDIR": str(workdir), "PBS_JOBID": jobid,
                   "PBS_JOBNAME": res.get("name", script.name), "PBS_NODEFILE": str(nodefile),
                   "PBS_QUEUE": res.get("queue", "workq"), "PBS_ENVIRONMENT": "PBS_BATCH",
                   "PBS_O_HOST": socket.gethostname(), "PBS_RUNCOUNT": str(n + 1),
                   "PBS_EMU_DIR": str(emu)}
        t0 = time.monotonic()
        with open(out, "ab") as log:
            p = subprocess.Popen(["/bin/bash", str(script)], cwd=emu / "home", env=job_env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            walltime_hit = killed = False
            try:
                while p.poll() is None:
                    if time.monotonic() - t0 > limit or (
                            walltime_reached and walltime_reached(n, out.read_text())):
                        raise subprocess.TimeoutExpired(p.args, limit)
                    time.sleep(0.2)
            except subprocess.TimeoutExpired:
                walltime_hit = True
                kill_session(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=kill_delay)
                except subprocess.TimeoutExpired:
                    killed = True
                    kill_session(p.pid, signal.SIGKILL)
                    p.wait()
            # PBS ends the whole session with the job: nothing may outlive it
            left = session_pids(p.pid)
            kill_session(p.pid, signal.SIGKILL)
        attempts.append(Attempt(p.returncode, walltime_hit, killed, time.monotonic() - t0,
                                left))
        if not ((emu / "qrerun").exists() and res["rerunnable"]):
            break
    return attempts


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("script")
    a.add_argument("--workdir", default=".")
    a.add_argument("--walltime", type=float, help="override the script's walltime (seconds)")
    a.add_argument("--kill-delay", type=float, default=10.0)
    args = a.parse_args()
    for i, at in enumerate(run(Path(args.script), Path(args.workdir), walltime_s=args.walltime,
                               kill_delay=args.kill_delay)):
        print(f"run {i + 1}: exit {at.returncode}, walltime hit {at.walltime_hit}, "
              f"killed {at.killed}, {at.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
