"""Progress during an epoch (hpclb/train/progress.py): lines in a log, a bar on a terminal, and a
closed standard output that does not end the run."""
from __future__ import annotations

import io
import subprocess
import sys
import types

import pytest
from helpers import LAUNCH_ENV as ENV
from helpers import quick_recipe

from hpclb.train import progress as P


def test_format_duration():
    assert [P.format_duration(s) for s in (7, 88, 3725, -3)] == ["7s", "1m28s", "1h02m", "0s"]


def test_log_lines_come_every_interval_with_step_loss_lr_rate_and_eta(monkeypatch):
    clock = {"t": 100.0}
    monkeypatch.setattr(P.time, "monotonic", lambda: clock["t"])
    out = io.StringIO()
    p = P.Progress(True, n_epochs=2, total_steps=20, global_batch=64, every_s=30, stream=out,
                   tty=False)
    p.start_epoch(0, 0, 10, 0)
    for i in range(10):
        clock["t"] += 10.0  # 10 s a step
        p.update(i, i + 1, 0.5, {"loss": 2.0 - i / 10, "step": 5} if i >= 4 else None)
    p.end_epoch()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # at 30, 60 and 90 s
    assert lines[0] == ("progress: epoch 1/2 step 3/10 (30.0%)  lr 5.000e-01  samples/s 6  ETA "
                        "epoch 1m10s, run 2m50s")
    # the step log's loss, with the step it was logged at when that is an older one
    assert lines[1].startswith("progress: epoch 1/2 step 6/10 (60.0%)  loss 1.5000 (step 5)  lr")
    quiet = io.StringIO()
    p = P.Progress(True, n_epochs=1, total_steps=10, global_batch=1, every_s=0, stream=quiet,
                   tty=False)
    p.start_epoch(0, 0, 10, 0)
    for i in range(10):
        clock["t"] += 100.0
        p.update(i, i + 1, 0.1, None)
    assert quiet.getvalue() == ""  # --progress-every 0: none


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_progress_every_must_be_seconds_at_least_zero(value, capsys):
    from hpclb import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "mnist-lstm", "--progress-every", value, "--dry-run"])
    assert e.value.code == 2 and "a number of seconds >= 0" in capsys.readouterr().err


def test_a_terminal_gets_a_bar_and_notes_pass_through(monkeypatch):
    """The bar counts steps (tqdm's rate and ETA are steps/s and the epoch's); its postfix
    adds the loss, the LR, samples/s and the run's ETA: 8 steps of 8 samples in 4 s after a
    resumption at global step 12 of 30 give 16 samples/s and 10 steps x 0.5 s = 5 s left."""
    clock = iter(0.5 * k for k in range(100))
    monkeypatch.setattr(P, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    out = io.StringIO()
    p = P.Progress(True, n_epochs=3, total_steps=30, global_batch=8, stream=out, tty=True)
    p.start_epoch(1, 2, 10, 12)
    p.note("compiling the model")
    for i in range(2, 10):
        p.update(i, 10 + i + 1, 0.25, {"loss": 0.125})
    assert p.bar.n == 10
    assert p.bar.postfix == "loss 0.1250 lr 2.500e-01 samples/s 16 run ETA 5s", p.bar.postfix
    p.end_epoch()
    text = out.getvalue()
    assert "epoch 2/3" in text and "compiling the model" in text and p.bar is None


def test_a_closed_log_ends_the_lines_not_the_progress_object():
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError

    p = P.Progress(True, n_epochs=1, total_steps=4, global_batch=1, every_s=1e-9,
                   stream=Closed(), tty=False)
    p.start_epoch(0, 0, 4, 0)
    p.update(0, 1, 0.1, None)
    assert p.enabled is False


def _train(tmp_path, mnist_dir, *extra):
    return [sys.executable, "-m", "hpclb", "train", quick_recipe(tmp_path), "--epochs", "1",
            "--data-dir", str(mnist_dir.parent), "--out", str(tmp_path / "run"), *extra]


@pytest.mark.slow
def test_a_log_shows_progress_lines_during_the_epoch(tmp_path, mnist_dir):
    r = subprocess.run(_train(tmp_path, mnist_dir, "--progress-every", "1e-9"),
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("progress: epoch 1/1 step ")]
    assert len(lines) == 32 and "step 32/32 (100.0%)" in lines[-1], r.stderr[-2000:]
    assert "ETA epoch" in lines[0] and "samples/s" in lines[0]


def test_a_fractional_budget_is_shown_alike_in_progress_and_epoch_lines():
    """--epochs 0.5: the epoch line says `epoch 1/0.5`; the progress lines and bar say so too
    (the loop passes them the same figure), not `epoch 1/1`."""
    out = io.StringIO()
    p = P.Progress(True, n_epochs=0.5, total_steps=16, global_batch=8, every_s=1e-9,
                   stream=out, tty=False)
    p.start_epoch(0, 0, 16, 0)
    p.due_at = 0.0
    p.update(0, 1, 0.1, {"loss": 1.0})
    assert "progress: epoch 1/0.5 step 1/16" in out.getvalue(), out.getvalue()
    bar = io.StringIO()
    p = P.Progress(True, n_epochs=2, total_steps=4, global_batch=1, stream=bar, tty=True)
    p.start_epoch(1, 0, 2, 2)
    assert p.bar.desc == "epoch 2/2"
    p.end_epoch()


@pytest.mark.slow
def test_a_half_epoch_run_says_1_of_0_5_in_every_line(tmp_path, mnist_dir):
    argv = _train(tmp_path, mnist_dir, "--progress-every", "1e-9")
    argv[argv.index("--epochs") + 1] = "0.5"
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "progress: epoch 1/0.5 step 16/16" in said and "epoch   1/0.5  loss" in said, said
    assert "epoch 1/1" not in said, said


@pytest.mark.slow
def test_a_closed_stdout_does_not_end_the_run(tmp_path, mnist_dir):
    """`hpclb train ... | head -1`: the console lines stop, the run finishes and says so in its
    summary.json, exit 0."""
    head = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    r = subprocess.run(_train(tmp_path, mnist_dir), stdout=head.stdin, stderr=subprocess.PIPE,
                       text=True, env=ENV, timeout=120)
    head.stdin.close()
    first = head.stdout.read().decode()
    head.wait()
    assert first.startswith("hpclb ")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]


def test_due_at_says_when_an_update_has_something_to_show(monkeypatch):
    """The step log calls update() only from due_at on: every every_s for lines, every step
    for a bar, never when disabled or between epochs."""
    clock = {"t": 100.0}
    monkeypatch.setattr(P.time, "monotonic", lambda: clock["t"])
    lines = P.Progress(True, n_epochs=1, total_steps=10, global_batch=1, every_s=30,
                       stream=io.StringIO(), tty=False)
    off = P.Progress(False, n_epochs=1, total_steps=10, global_batch=1, stream=io.StringIO())
    bar = P.Progress(True, n_epochs=1, total_steps=10, global_batch=1, stream=io.StringIO(),
                     tty=True)
    for p in (lines, off, bar):
        p.start_epoch(0, 0, 10, 0)
    assert (lines.due_at, off.due_at, bar.due_at) == (130.0, float("inf"), 0.0)
    clock["t"] = 131.0
    lines.update(0, 1, 0.1, None)
    assert lines.due_at == 161.0
    lines.end_epoch()
    bar.end_epoch()
    assert lines.due_at == bar.due_at == float("inf")


def test_a_terminal_that_reports_no_size_still_shows_the_bar():
    """A TTY of 0 x 0 (``srun --pty``, ``script`` without ``stty``, some container TTYs): tqdm
    sized itself -1 x -1 from it and drew nothing; the bar now takes $COLUMNS/$LINES or 80 x 24."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    with open(slave, "w") as tty:
        p = P.Progress(True, n_epochs=1, total_steps=5, global_batch=1, stream=tty)
        p.start_epoch(0, 0, 5, 0)
        for i in range(5):
            p.update(i, i + 1, 0.1, {"loss": 1.0})
        p.bar.refresh()
        shown = b""
        while select.select([master], [], [], 0.5)[0]:
            shown += os.read(master, 65536)
        p.end_epoch()
    os.close(master)
    assert b"epoch 1/1" in shown and b"5/5" in shown, shown
