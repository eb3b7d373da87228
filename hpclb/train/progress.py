"""Rank 0's progress during an epoch (:class:`Progress`), owned by :func:`hpclb.train.loop.train`
and updated by the step log (:meth:`hpclb.train.loop.StepLog.after_step`) when ``due_at``.

On a terminal (stderr a TTY): a tqdm bar per epoch (its rate in steps/s, its ETA the epoch's),
its postfix, at each step-log line, the last logged loss, the LR, samples/s and the run's ETA;
$COLUMNS/$LINES or 80 x 24 wide where the terminal reports a size of 0 (:func:`_bar_size`).
Elsewhere (a SLURM or PBS log, a pipe): one line every ``every_s`` seconds, so a log shows life
long before the first epoch ends::

    progress: epoch 1/20 step 120/469 (25.6%)  loss 0.4123  lr 1.230e-03  samples/s 3,950
      ETA epoch 1m28s, run 24m13s

The loss is the one the step log last read from the device (``--log-every``), with its step when
that is not the current one (``loss 1.5451 (step 50)``); progress reads nothing from the device
itself. Samples/s and the ETAs come from the wall clock since this
process's first step of the epoch / of the run (a resumed run counts from its resumption).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``3725 -> "1h02m"``, ``88 -> "1m28s"``, ``7 -> "7s"``."""
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _bar_size(stream: TextIO) -> dict:
    """tqdm's size arguments: the terminal's own, followed as it is resized; where it reports
    0 columns or rows (``srun --pty``, ``script`` without ``stty``, some container TTYs), from
    which tqdm would draw nothing, :func:`shutil.get_terminal_size`'s ($COLUMNS/$LINES, else
    80 x 24)."""
    try:
        if min(os.get_terminal_size(stream.fileno())) > 0:
            return {"dynamic_ncols": True}
    except (AttributeError, OSError, ValueError):  # no file descriptor: tqdm asks nothing
        return {"dynamic_ncols": True}
    cols, rows = shutil.get_terminal_size()
    return {"ncols": cols, "nrows": rows}


class Progress:
    """Progress lines or a bar on rank 0 (nothing when ``enabled`` is False).

    Args: ``n_epochs`` (the run's epochs as the epoch lines show them: ``0.5`` for a
    fractional budget, the last epoch may be partial), ``total_steps`` (optimizer
    steps in the run), ``global_batch`` (samples per step), ``every_s`` (seconds between
    lines when not on a terminal; 0 or None: no lines), ``stream`` (default stderr), ``tty``
    (default ``stream.isatty()``).
    """

    def __init__(self, enabled: bool, *, n_epochs: float, total_steps: int, global_batch: int,
                 every_s: float | None = 60.0, stream: TextIO | None = None,
                 tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s or 0.0
        self.n_epochs, self.total, self.batch = n_epochs, total_steps, global_batch
        self.bar = None
        self._run_t0 = self._run_step0 = None
        # when update() next has something to show (time.monotonic()): every step for a bar,
        # every ``every_s`` for lines, never when disabled; the step log checks it per step
        self.due_at = float("inf")

    def start_epoch(self, epoch: int, begin: int, steps: int, global_step: int) -> None:
        """Before the first step of epoch ``epoch`` (0-based), at step ``begin`` of ``steps``."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self._run_t0 is None:
            self._run_t0, self._run_step0 = now, global_step
        self.epoch, self.steps, self._t0, self._i0, self._last = epoch, steps, now, begin, now
        self.due_at = now + self.every_s if self.every_s else float("inf")
        if self.tty:
            self.due_at = 0.0
            self.bar = tqdm(total=steps, initial=begin, desc=f"epoch {epoch + 1}/{self.n_epochs:g}",
                            leave=False, file=self.stream, **_bar_size(self.stream))

    def update(self, i: int, global_step: int, lr: float, logged: dict | None) -> None:
        """After step ``i`` (0-based in the epoch) = global step ``global_step`` (count so far);
        ``logged``: the step log's last line (its ``loss``), or None."""
        if not self.enabled:
            return
        loss = logged.get("loss") if logged else None
        at = logged.get("step") if logged else None
        if loss is not None:  # the step log's last value, which may be some steps old
            loss = f"loss {loss:.4f}" + (f" (step {at})" if at not in (None, global_step) else "")
        if self.bar is not None:
            self.bar.update(1)
            if logged is not None:  # the bar's own rate is steps/s, its ETA the epoch's
                sps, _, run_eta = self._rates(i + 1, global_step, time.monotonic())
                shown = f"{loss} " if loss is not None else ""
                self.bar.set_postfix_str(f"{shown}lr {lr:.3e} samples/s {sps:,.0f} run ETA "
                                         f"{format_duration(run_eta)}", refresh=False)
            return
        now = time.monotonic()
        if not self.every_s or now - self._last < self.every_s:
            return
        self._last, self.due_at = now, now + self.every_s
        self._line(i + 1, global_step, lr, loss, now)

    def _rates(self, done: int, global_step: int, now: float) -> tuple[float, float, float]:
        """(samples/s in this epoch, the epoch's ETA and the run's, in seconds) after ``done``
        steps of the epoch = global step ``global_step``."""
        per_step = (now - self._t0) / max(1, done - self._i0)
        run_rate = (now - self._run_t0) / max(1, global_step - self._run_step0)
        sps = self.batch / per_step if per_step > 0 else 0.0
        return sps, (self.steps - done) * per_step, (self.total - global_step) * run_rate

    def _line(self, done: int, global_step: int, lr: float, loss: str | None,
              now: float) -> None:
        sps, epoch_eta, run_eta = self._rates(done, global_step, now)
        shown = f"  {loss}" if loss is not None else ""
        self._write(f"progress: epoch {self.epoch + 1}/{self.n_epochs:g} step {done}/{self.steps} "
                    f"({100 * done / self.steps:.1f}%){shown}  lr {lr:.3e}  samples/s "
                    f"{sps:,.0f}  ETA epoch {format_duration(epoch_eta)}, "
                    f"run {format_duration(run_eta)}")

    def note(self, text: str) -> None:
        """A line of its own (e.g. that the first steps compile the model)."""
        if self.enabled:
            self._write(text)

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
            return
        try:
            print(text, file=self.stream, flush=True)
        except (BrokenPipeError, OSError, ValueError):
            self.enabled = False  # a closed log does not stop training

    def end_epoch(self) -> None:
        self.due_at = float("inf")
        if self.bar is not None:
            self.bar.close()
            self.bar = None
