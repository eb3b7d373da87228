"""Starting ``mpirun`` reliably (``hpclb/comm/launcher.py``), with the venv's real Open MPI: a
SIGKILLed mpirun leaves its session directory behind; a later mpirun given the same process id
fails at start-up with "The PMIx server's listener thread failed to start" (the failure that
stopped a CI run); removing the left-behind directories cures it; ``stop_session`` ends the
ranks too (each rank has a process group of its own) and leaves nothing behind."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import LAUNCH_ENV, MPIRUN, run_bounded, running

from hpclb.comm.launcher import (
    LISTENER_FAILURE,
    explain_launch_failure,
    mpirun_path,
    remove_stale_session_dirs,
    stale_session_dirs,
    stop_session,
)

ENV = LAUNCH_ENV


@pytest.fixture
def tmpdir_env(tmp_path):
    """A temporary directory of the test's own for mpirun's session directories."""
    if not MPIRUN.exists():
        pytest.skip("no mpirun beside the interpreter (make install provides one)")
    tmp = tmp_path / "t"
    tmp.mkdir()
    return tmp, {**ENV, "TMPDIR": str(tmp)}


def _wait_for(predicate, timeout_s=30.0):
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def _session_dirs(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith("ompi."))


def _killed_mpirun_session(tmp: Path, env: dict) -> Path:
    """Start ``mpirun -n 1 sleep``, SIGKILL it (and its rank) once its session directory
    exists, and return that directory, left behind."""
    proc = subprocess.Popen([str(MPIRUN), "-n", "1", "--bind-to", "none", "sleep", "60"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        left = _wait_for(lambda: [p for p in _session_dirs(tmp) if any(p.glob("pmix.*"))])
        assert stale_session_dirs(tmp) == [], "a running mpirun's directory was called stale"
    finally:
        proc.kill()  # SIGKILL the launcher only: it cannot clean up
        proc.wait()
        stop_session(proc, grace_s=1)  # the rank, in its own process group
    assert left == [tmp / f"ompi.{proc.pid}"]
    return left[0]


def test_a_killed_mpirun_leaves_a_session_directory_that_is_found_and_removed(tmpdir_env):
    tmp, env = tmpdir_env
    left = _killed_mpirun_session(tmp, env)
    assert left.is_dir() and stale_session_dirs(tmp) == [left]
    (tmp / "ompi.notapid").mkdir()  # not a session directory: never touched
    (tmp / f"ompi.{os.getpid()}").mkdir()  # this process is alive: never touched
    (tmp / "ompi.99999999999999999999").mkdir()  # beyond any process id (os.kill overflows)
    (tmp / "ompi.999999998").symlink_to(tmp / "ompi.notapid")  # a link: never followed
    assert set(remove_stale_session_dirs(tmp)) == {left, tmp / "ompi.99999999999999999999"}
    assert not left.exists() and (tmp / "ompi.notapid").exists()
    assert (tmp / f"ompi.{os.getpid()}").exists() and (tmp / "ompi.999999998").is_symlink()


def _plant_under_next_pids(template: Path, tmp: Path, count: int) -> list[int]:
    """Copies of a left-behind session directory under the next ``count`` free process ids,
    with the files that name the old id renamed (what a reused id finds). No process is started
    meanwhile, so the next launch takes one of these ids."""
    old = template.name.split(".")[1]
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    planted = []
    for pid in range(last + 1, last + 1 + count):
        target = tmp / f"ompi.{pid}"
        if target.exists():
            continue
        shutil.copytree(template, target, symlinks=True)
        for f in list(target.iterdir()):
            if old in f.name:
                f.rename(target / f.name.replace(old, str(pid)))
        planted.append(pid)
    return planted


@pytest.mark.skipif(not Path("/proc/sys/kernel/ns_last_pid").exists(),
                    reason="needs Linux's /proc/sys/kernel/ns_last_pid to predict process ids")
def test_a_reused_process_id_stops_mpirun_until_the_left_behind_directory_is_removed(tmpdir_env):
    tmp, env = tmpdir_env
    template = _killed_mpirun_session(tmp, env)
    stash = tmp.parent / template.name
    template.rename(stash)
    planted = _plant_under_next_pids(stash, tmp, 200)
    argv = [str(MPIRUN), "-n", "1", "--bind-to", "none", "true"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    out, _ = proc.communicate(timeout=60)
    if proc.pid not in planted:
        pytest.skip(f"another process took the planted ids (mpirun ran as {proc.pid})")
    assert proc.returncode != 0 and LISTENER_FAILURE in out, out
    assert "python -m hpclb.comm.launcher" in explain_launch_failure(out)
    removed = remove_stale_session_dirs(tmp)
    assert stale_session_dirs(tmp) == []
    assert len(removed) >= len(planted) - 20  # a few ids may have gone to live processes since
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stdout + again.stderr


def test_stop_session_ends_the_ranks_and_leaves_nothing_behind(tmpdir_env):
    tmp, env = tmpdir_env
    proc = subprocess.Popen([str(MPIRUN), "-n", "2", "--bind-to", "none", "sleep", "60"],
                            env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ranks = _wait_for(lambda: [p for p in _children_named(proc.pid, "sleep")
                               if len(_children_named(proc.pid, "sleep")) == 2])
    groups = {os.getpgid(pid) for pid in ranks}
    assert proc.pid not in groups  # why killpg on the launcher's group misses them
    stop_session(proc, grace_s=5)
    assert proc.returncode is not None
    _wait_for(lambda: not any(running(pid) for pid in ranks), timeout_s=10)
    assert _session_dirs(tmp) == []


def test_stop_session_kills_what_ignores_sigterm(tmp_path):
    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & wait"],
                            start_new_session=True)
    time.sleep(0.3)
    t = time.monotonic()
    stop_session(proc, grace_s=0.5)
    assert proc.returncode is not None and time.monotonic() - t < 10


RANK = ("import signal, sys, time, pathlib\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "def term(*_):\n"
        "    (d / 'rank-got-sigterm').touch()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "(d / 'rank-ready').touch()\n"
        "time.sleep(60)\n")


def test_stop_session_sends_sigterm_to_the_ranks_groups_before_sigkill(tmp_path):
    """A launcher that ignores SIGTERM (a wedged mpirun) and a rank in a process group of its
    own: the rank is sent SIGTERM (and ends by itself) before anything is SIGKILLed; before,
    the rank only ever got the SIGKILL."""
    proc = subprocess.Popen(["bash", "-c", f"trap '' TERM; set -m; {sys.executable} -c "
                             f"\"$0\" {tmp_path} & wait", RANK], start_new_session=True)
    _wait_for(lambda: (tmp_path / "rank-ready").exists())
    stop_session(proc, grace_s=6)
    assert proc.returncode is not None
    assert (tmp_path / "rank-got-sigterm").exists()


def test_the_launch_failure_is_explained_only_when_it_is_that_failure():
    assert explain_launch_failure("ValueError: --batch-size: must be a positive integer") is None
    hint = explain_launch_failure(f"-----\nThe {LISTENER_FAILURE}. We cannot\ncontinue.\n")
    assert "session directory" in hint and "killed" in hint
    assert mpirun_path().endswith("mpirun")


def test_the_cleanup_command_names_what_it_removed(tmp_path):
    (tmp_path / "ompi.999999999").mkdir()  # beyond any pid_max: no such process
    r = subprocess.run([sys.executable, "-m", "hpclb.comm.launcher"], capture_output=True,
                       text=True, timeout=60, env={**ENV, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert f"removed {tmp_path / 'ompi.999999999'}" in r.stdout and "1 left-behind" in r.stdout
    assert not (tmp_path / "ompi.999999999").exists()


def _children_named(ppid_root: int, name: str) -> list[int]:
    """Descendants of ``ppid_root`` whose command is ``name`` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        parents[int(stat.parent.name)] = (int(text.rsplit(")", 1)[1].split()[1]), comm)
    found = []
    for pid, (_, comm) in parents.items():
        p = pid
        while p in parents and p != ppid_root:
            p = parents[p][0]
        if p == ppid_root and comm == name:
            found.append(pid)
    return found


def test_the_tests_bounded_run_ends_the_ranks_of_a_launcher_past_its_time(tmpdir_env):
    """tests/helpers.run_bounded, which the suite's mpirun launches go through: past its time it
    raises TimeoutExpired with the ranks ended and nothing left behind (``subprocess.run``
    killed mpirun alone)."""
    tmp, env = tmpdir_env
    argv = [str(MPIRUN), "-n", "2", "--bind-to", "none", "sleep", OUR_SLEEP]
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded(argv, timeout=3, env=env, capture_output=True, text=True)
    assert time.monotonic() - t < 20
    _wait_for(lambda: not [p for p in Path("/proc").glob("[0-9]*/cmdline")
                           if _is_our_sleep(p)], timeout_s=10)
    assert _session_dirs(tmp) == []


# the ranks' sleep, in seconds: a value no other process on the machine sleeps for (a plain
# "sleep 60" of some shell loop outside the tests would be taken for a rank left behind)
OUR_SLEEP = "59.8317"


def _is_our_sleep(cmdline: Path) -> bool:
    try:
        return cmdline.read_bytes().split(b"\0")[:2] == [b"sleep", OUR_SLEEP.encode()]
    except OSError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_a_benchmark_stopped_by_a_signal_stops_its_launcher_session(sig):
    """SIGTERM or Ctrl-C to a benchmark waiting in ``run_group`` ends the launcher it started
    and the launcher's children (in a session of their own, so no signal reached them); before,
    SIGTERM ended the benchmark alone and Ctrl-C left ``communicate`` without stopping them."""
    import signal

    from helpers import descendants

    code = ("import os\nfrom hpclb.bench.launch import run_group\n"
            "run_group(['bash', '-c', 'sleep 300 & wait'], dict(os.environ), 600)\n")
    # Ctrl-C as in a terminal: SIGINT at its default action in the benchmark (a job started in
    # the background by a shell without job control, as CI may be, inherits it ignored)
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _wait_for(lambda: len(descendants(proc.pid)) >= 2), "bash and sleep never ran"
        started = descendants(proc.pid)
        proc.send_signal(getattr(signal, f"SIG{sig}"))
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            stop_session(proc, grace_s=5)
    # SystemExit(143); an uncaught KeyboardInterrupt ends Python by SIGINT
    assert rc == (143 if sig == "TERM" else -signal.SIGINT), rc
    assert not [pid for pid in started if running(pid)], started
