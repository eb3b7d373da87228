"""``hpclb train --profile START:END``: a ``torch.profiler`` trace of a window of training steps.

The window is given as ``START:END`` global steps, a half-open range like a Python slice: the
``END - START`` optimizer steps after the first ``START``, i.e. the steps numbered ``START + 1``
to ``END`` in ``metrics.jsonl`` (``10:15`` traces steps 11 to 15). :func:`parse_profile_steps`
checks the syntax (integers, ``0 <= START < END``) from the command line alone, so every rank
refuses a bad one alike before any work; :func:`check_profile_window` checks that ``END`` lies
inside the run once its number of steps is known (after the data is sized, before the first
step).

Each rank writes its own trace, through ``torch.profiler.tensorboard_trace_handler``, under
``<out>/profile/rank<r>/``: one ``rank<r>.<time>.pt.trace.json`` per rank, a Chrome trace
(``chrome://tracing``, https://ui.perfetto.dev) that ``tensorboard --logdir <out>/profile`` also
shows (the torch-tb-profiler plug-in: one run per rank). CPU activity always, CUDA kernels on a
GPU. Inside the window the training step is labelled with ``record_function`` ranges:
``hpclb/data`` (reading a micro-batch), ``hpclb/forward_backward``, ``hpclb/allreduce_wait``
(inside the window's last backward, at its end: waiting for the gradient allreduce, the
communication backward did not hide; labelled by :class:`~hpclb.sync.gradients.GradientSync`),
``hpclb/optimizer`` (the synchronised optimizer step: guard, clipping, update), and every call
of the communicator's collectives (``hpclb/allreduce``, ``hpclb/iallreduce``,
``hpclb/allgather_object``, ``hpclb/broadcast``). The gradient buckets' calls show under
``overlap=nonblocking`` (issued from backward's hooks); under ``overlap=thread`` they run on the
communication thread, which the profiler does not record, and show as ``hpclb/allreduce_wait``.
Outside the window nothing is recorded and the labels cost nothing.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
from pathlib import Path

import torch

from hpclb.config.outputs import mark_run
from hpclb.errors import ConfigError

__all__ = ["PROFILE_DIR", "COLLECTIVES", "StepProfiler", "check_profile_window",
           "parse_profile_steps"]

log = logging.getLogger(__name__)
PROFILE_DIR = "profile"
#: communicator methods labelled inside the window -> their ``record_function`` name
COLLECTIVES = {"allreduce_": "hpclb/allreduce", "iallreduce_": "hpclb/iallreduce",
               "iallreduce": "hpclb/iallreduce", "allgather_object": "hpclb/allgather_object",
               "broadcast_": "hpclb/broadcast", "broadcast_object": "hpclb/broadcast"}
_SYNTAX = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    """``"START:END"`` -> ``(START, END)`` (None -> None). Raises ConfigError naming
    ``--profile`` and the fix unless both are integers with ``0 <= START < END``."""
    if text is None:
        return None
    m = _SYNTAX.match(str(text))
    if m is None:
        raise ConfigError(f"--profile {text!r}: must be START:END, two integers >= 0 (global "
                          f"steps, as a Python slice: 10:15 traces steps 11 to 15)")
    start, end = int(m.group(1)), int(m.group(2))
    if start >= end:
        raise ConfigError(f"--profile {text}: START must be smaller than END (START:END traces "
                          f"the END - START steps after the first START, e.g. {start}:"
                          f"{start + 5})")
    return start, end


def check_profile_window(window: tuple[int, int] | None, total_steps: int) -> None:
    """ConfigError when the window's END lies past the run's ``total_steps`` optimizer steps."""
    if window is not None and window[1] > total_steps:
        raise ConfigError(f"--profile {window[0]}:{window[1]}: the run has only {total_steps} "
                          f"optimizer steps (global steps 1 to {total_steps}); choose END <= "
                          f"{total_steps}")


class StepProfiler:
    """The profiler of one rank over ``window`` (``(START, END)`` or None: off). The loop calls
    :meth:`before_step` with the global step about to run (0-based: the steps done) and
    :meth:`after_step` after it; :meth:`label` gives a step phase's ``record_function`` (a no-op
    outside the window); :meth:`close` ends an open trace (a run stopped inside the window)."""

    def __init__(self, window: tuple[int, int] | None, out: Path, comm, device: torch.device,
                 done: int = 0):
        self.window, self.comm, self.device = window, comm, device
        self.dir = Path(out) / PROFILE_DIR / f"rank{comm.rank}"
        self._prof = None
        self._wrapped: list[str] = []
        if window is not None and done >= window[1]:
            if comm.rank == 0:
                log.warning("--profile %d:%d: this run resumed after step %d, past the window; "
                            "no trace", window[0], window[1], done)
            self.window = None
        elif window is not None and done > window[0] and comm.rank == 0:
            log.warning("--profile %d:%d: this run resumed after step %d; the trace covers "
                        "steps %d to %d", window[0], window[1], done, done + 1, window[1])
        if self.window is not None and comm.rank == 0:  # before any rank writes there
            mark_run(out, PROFILE_DIR)

    def label(self, name: str):
        """``torch.profiler.record_function(name)`` inside the window, else a null context."""
        return torch.profiler.record_function(name) if self._prof is not None else \
            contextlib.nullcontext()

    def before_step(self, done: int) -> None:
        """Start the trace when the step after ``done`` steps is the window's first (or, after a
        resume inside the window, the first one this run takes)."""
        if self.window is None or self._prof is not None or not (
                self.window[0] <= done < self.window[1]):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prof = torch.profiler.profile(
            activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.dir), worker_name=f"rank{self.comm.rank}"))
        self._prof.__enter__()
        self._wrap_collectives()

    def after_step(self, done: int) -> None:
        """Write the trace once ``done`` (steps done) reaches the window's END."""
        if self._prof is not None and done >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop an open trace and write it (``on_trace_ready``); idempotent."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        self._unwrap_collectives()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        self.window = None
        if self.comm.rank == 0:
            log.info("--profile: trace of rank 0 written under %s", self.dir)

    def _wrap_collectives(self) -> None:
        """Label the communicator's collectives (instance attributes over its methods; removed
        again by :meth:`_unwrap_collectives`)."""
        for method, name in COLLECTIVES.items():
            fn = getattr(self.comm, method, None)
            if fn is None or method in getattr(self.comm, "__dict__", {}):  # not a method
                continue

            @functools.wraps(fn)
            def labelled(*args, _fn=fn, _name=name, **kwargs):
                with torch.profiler.record_function(_name):
                    return _fn(*args, **kwargs)
            try:
                setattr(self.comm, method, labelled)
            except AttributeError:  # a communicator without instance attributes: unlabelled
                continue
            self._wrapped.append(method)

    def _unwrap_collectives(self) -> None:
        for method in self._wrapped:
            delattr(self.comm, method)
        self._wrapped = []
