"""`hpclb` ends without seconds of interpreter teardown after its last line
(hpclb.cli.common.exit_promptly): what the teardown would do that matters is done first."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=100)


def test_exit_promptly_runs_atexit_and_flushes_open_files(tmp_path):
    r = _run("""
        import atexit, sys
        from hpclb.cli.common import exit_promptly
        atexit.register(lambda: open("atexit-ran", "w").write("yes"))
        f = open("buffered.txt", "w")
        f.write("kept")                      # still in the file object's buffer
        print("last line", end="")           # stdout unflushed (a pipe)
        sys.stderr.write("err line")
        exit_promptly(3)
        print("never")
        """, tmp_path)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "last line" and r.stderr == "err line"
    assert (tmp_path / "atexit-ran").read_text() == "yes"
    assert (tmp_path / "buffered.txt").read_text() == "kept"


def test_a_live_thread_gets_the_ordinary_exit(tmp_path):
    r = _run("""
        import threading, time
        from hpclb.cli.common import exit_promptly
        def late():
            time.sleep(0.5)
            open("thread-done", "w").write("yes")
        threading.Thread(target=late).start()
        exit_promptly(None)
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "thread-done").read_text() == "yes"  # sys.exit waited for it


def test_the_command_exits_with_its_status_and_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hpclb", "train", "no-such-recipe"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 2, r.stderr
    assert "no-such-recipe" in r.stderr


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`hpclb ... | head -1`: the command's later writes fail with EPIPE; it ends quietly with
    141, as a shell reports a process ended by SIGPIPE (it printed a BrokenPipeError traceback)."""
    code = ("import hpclb.cli as c\n"
            "def main():\n"
            "    for _ in range(100000):\n"
            "        print('x' * 100)\n"
            "    return 0\n"
            "c.main = main\n"
            "c.run()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=tmp_path)
    assert p.stdout.readline() == b"x" * 100 + b"\n"
    p.stdout.close()  # the reader leaves
    err = p.stderr.read().decode()
    assert p.wait(timeout=100) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
