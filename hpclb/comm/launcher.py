"""Starting ``mpirun`` from hpclb's own tools (sweeps, benchmarks) and keeping its start-up
reliable on one machine.

Open MPI 5's ``mpirun`` (PRRTE with PMIx) keeps a session directory ``ompi.<pid>`` in the
temporary directory (``$TMPDIR``, else ``/tmp``) and removes it when it exits normally. An
``mpirun`` that is SIGKILLed (a timeout, the OOM killer, ``kill -9``) leaves it behind, with
PMIx's rendezvous files inside. When a later ``mpirun`` is given the same process id (ids are
reused: ``kernel.pid_max`` is 32768 on many machines), PMIx finds the old rendezvous file,
refuses to start and prints only::

    The PMIx server's listener thread failed to start. We cannot continue.

before any rank runs. Reproduced on this machine by planting a copy of a left-behind directory
under the next process ids (``tests/test_launcher.py``). The cure is to remove the directories
whose ``mpirun`` is gone, which :func:`remove_stale_session_dirs` does before every launch
hpclb makes, and to stop a launcher with SIGTERM first (it then cleans up) and SIGKILL only
after a grace period (:func:`stop_session`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["LISTENER_FAILURE", "explain_launch_failure", "mpirun_path", "process_alive",
           "remove_stale_session_dirs", "stale_session_dirs", "stop_session"]

#: What Open MPI 5 prints when PMIx finds a left-behind rendezvous file (see the module text).
LISTENER_FAILURE = "PMIx server's listener thread failed to start"
_SESSION_DIR = re.compile(r"(ompi|prte)\.(\d+)")


def mpirun_path() -> str:
    """The ``mpirun`` beside the running interpreter (the venv's Open MPI, which mpi4py was
    built with), else the one on ``PATH``, else the bare name."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else (shutil.which("mpirun") or "mpirun")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts; another user's process counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or beyond any process id
        return False
    except PermissionError:
        return True  # another user's process
    return True


def stale_session_dirs(tmp: str | os.PathLike | None = None) -> list[Path]:
    """The ``ompi.<pid>`` / ``prte.<pid>`` session directories in ``tmp`` (default: the
    temporary directory Open MPI uses, ``$TMPDIR`` or ``/tmp``) that belong to this user and
    whose ``mpirun`` process no longer exists, sorted by name. Directories of running launchers
    and of other users, and symbolic links (Open MPI makes none), are never listed."""
    root = Path(tmp if tmp is not None else tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    uid = os.getuid()
    stale = []
    for path in entries:
        m = _SESSION_DIR.fullmatch(path.name)
        try:
            if (m and not path.is_symlink() and path.is_dir() and path.stat().st_uid == uid
                    and not process_alive(int(m[2]))):
                stale.append(path)
        except OSError:
            continue  # removed meanwhile
    return sorted(stale)


def remove_stale_session_dirs(tmp: str | os.PathLike | None = None) -> list[Path]:
    """Remove :func:`stale_session_dirs` (their ``mpirun`` is gone, so nothing reads them) and
    return what was removed. Errors are ignored: a directory another process removes meanwhile
    is gone either way."""
    stale = stale_session_dirs(tmp)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def explain_launch_failure(output: str) -> str | None:
    """A sentence naming the cause and the fix when ``output`` (a failed ``mpirun``'s stdout
    and stderr) shows the left-behind session directory failure, else None."""
    if LISTENER_FAILURE not in output:
        return None
    return (f"mpirun could not start (\"{LISTENER_FAILURE}\"): a session directory left by an "
            f"mpirun that was killed is in {tempfile.gettempdir()} under this launcher's "
            f"process id. hpclb removes such directories before each launch it makes; remove "
            f"them by hand with `python -m hpclb.comm.launcher` and launch again")


def _session_members(sid: int) -> list[int]:
    """Process ids in session ``sid`` (Linux ``/proc``; empty elsewhere), zombies left out
    (they have ended). mpirun puts each rank in a process group of its own, so signalling the
    launcher's group misses the ranks, while the session holds them all."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _kill_session(sid: int, *, leader: bool) -> None:
    """SIGKILL every process in session ``sid``; the leader (pid ``sid``) only when ``leader``
    (it is not reaped yet, so its pid cannot have been reused)."""
    for pid in _session_members(sid):
        if pid != sid or leader:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _term_member_groups(sid: int) -> bool:
    """SIGTERM the process group of every process in session ``sid`` but the leader's own (the
    ranks: mpirun gives each a group of its own); True when any was signalled."""
    groups = set()
    for pid in _session_members(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(pid))
    groups.discard(sid)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    return bool(groups)


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple | None:
    try:
        return proc.communicate(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        return None


def stop_session(proc: subprocess.Popen, grace_s: float = 10.0) -> tuple[str, str]:
    """Stop ``proc`` and every process in its session (``proc`` must have been started with
    ``start_new_session=True``: mpirun and its ranks, torchrun and its workers), in three steps
    within ``grace_s`` seconds:

    1. SIGTERM to the launcher's process group, which lets ``mpirun`` end its ranks and remove
       its session directory; up to half of ``grace_s`` for it to end;
    2. SIGTERM to the process group of every process left in the session (the ranks of a
       launcher that did not end them), and the rest of ``grace_s`` for them to end;
    3. SIGKILL to every process still in the session.

    Returns what was left of its output, ``(stdout, stderr)`` (empty strings where not piped),
    once it is reaped and what it left behind is removed.

    The session, not the process group: mpirun gives each rank a process group of its own, so
    ``killpg`` on the launcher's group alone leaves the ranks running."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    out = _communicate(proc, grace_s / 2)
    if _term_member_groups(proc.pid):
        while time.monotonic() < deadline and [
                p for p in _session_members(proc.pid) if p != proc.pid]:
            time.sleep(0.05)
    if out is None:
        out = _communicate(proc, deadline - time.monotonic())
    if out is None:
        _kill_session(proc.pid, leader=True)
        out = proc.communicate()
    _kill_session(proc.pid, leader=False)  # ranks that outlived their launcher
    remove_stale_session_dirs()
    return out[0] or "", out[1] or ""


def main() -> int:
    """``python -m hpclb.comm.launcher``: remove left-behind session directories, naming each."""
    removed = remove_stale_session_dirs()
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} left-behind mpirun session director"
          f"{'y' if len(removed) == 1 else 'ies'} removed from {tempfile.gettempdir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
