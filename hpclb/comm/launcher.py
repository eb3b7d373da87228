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

A tool that runs ``mpirun`` for a command that checkpoints on a signal (``hpclb sweep``'s points)
passes the scheduler's or the user's signal on with :func:`run_forwarding_signals`: Open MPI 5's
``mpirun`` forwards SIGUSR2 to its ranks, but SIGTERM and SIGINT end the job at once (the ranks
are killed before they can checkpoint), so every one of USR2, TERM and INT reaches it as USR2.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FORWARD_GRACE_S", "LISTENER_FAILURE", "Forwarded", "explain_launch_failure",
           "mpirun_path", "process_alive", "remove_stale_session_dirs", "run_forwarding_signals",
           "stale_session_dirs", "stop_session"]

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


#: Seconds a launcher has, after the first signal was passed on, to end (its ranks checkpoint at
#: their next step) before :func:`run_forwarding_signals` stops its session.
FORWARD_GRACE_S = 120.0
_FORWARDED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
_REPEAT_S = 10.0  # the signal is passed on again this often (a rank started after it missed it)
_POLL_S = 0.2


@dataclass
class Forwarded:
    """How a launcher run by :func:`run_forwarding_signals` ended: its exit status (negative:
    the signal that ended it), its standard error, the first signal this process received
    while it ran (None: none) and whether it was stopped (``forced``: a second SIGINT, or it
    outlived the grace period)."""

    returncode: int
    stderr: str
    signal: int | None = None
    forced: bool = False


class _Received:
    """Handlers that only record USR2/TERM/INT (no I/O in a handler); restored on exit."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.first_at: float | None = None
        main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._handler) for s in _FORWARDED} if main else {}
        # one the command line recorded before (a signal between two launches) counts
        if any(getattr(self._previous.get(s), "pending", False) for s in _FORWARDED):
            self._handler(signal.SIGTERM, None)

    def _handler(self, signum, _frame) -> None:
        self.signals.append(signum)
        if self.first_at is None:
            self.first_at = time.monotonic()

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


def _catches_usr2(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR2 yet (``/proc/<pid>/status``; True when
    unknown): before ``mpirun`` installs its own, a SIGUSR2 would end it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGUSR2 - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


def run_forwarding_signals(argv: list[str], *, env: dict[str, str], stdout=None,
                           grace_s: float = FORWARD_GRACE_S) -> Forwarded:
    """Run the launcher ``argv`` (``mpirun ...``) in a session of its own, standard error
    captured, ``stdout`` as given (None: this process's), passing SIGUSR2, SIGTERM and SIGINT
    received meanwhile on to it as SIGUSR2 (Open MPI's ``mpirun`` forwards USR2 to its ranks and
    kills them at once on TERM/INT), again every 10 s while it runs. It then has ``grace_s``
    seconds to end; past them, or at a second SIGINT (a second Ctrl-C forces), its whole
    session is stopped (:func:`stop_session`), so no rank outlives it. A USR2/TERM recorded
    before the call (a handler with a true ``pending``, as ``hpclb``'s command line installs)
    counts as received at the start. Left-behind session directories are removed first.
    The handlers are this process's during the call only (from the main thread; from another
    thread nothing is forwarded). Returns :class:`Forwarded`."""
    remove_stale_session_dirs()  # a reused process id would stop mpirun at start-up
    received = _Received()
    proc = None
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        return _wait_forwarding(proc, received, grace_s)
    except BaseException:
        if proc is not None and proc.poll() is None:
            stop_session(proc)
        raise
    finally:
        received.restore()


def _wait_forwarding(proc: subprocess.Popen, received: _Received, grace_s: float) -> Forwarded:
    """Wait for ``proc``, passing each signal ``received`` records on as SIGUSR2; stop its
    session at a second SIGINT or ``grace_s`` seconds after the first signal."""
    forwarded_at = None
    while True:
        out = _communicate(proc, _POLL_S)
        first = received.signals[0] if received.signals else None
        if out is not None:
            return Forwarded(proc.returncode, out[1] or "", first)
        if first is None:
            continue
        now = time.monotonic()
        if received.signals.count(signal.SIGINT) > 1 or now - received.first_at > grace_s:
            _, err = stop_session(proc)
            return Forwarded(proc.returncode, err, first, forced=True)
        if (forwarded_at is None or now - forwarded_at >= _REPEAT_S) \
                and _catches_usr2(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR2)
            forwarded_at = now


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
