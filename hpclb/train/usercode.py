"""Where an exception from a user's plug-in came from: the phase of the run and the user's line.

An exception raised inside a plug-in (model constructor, data function, a data set's
``__getitem__``, forward/backward, loss or metric function) reaches the command line with a
traceback that runs through hpclb. :func:`describe` turns it into one line for the error message:
the phase (the innermost hpclb function of :data:`PHASES` on the traceback; the training step's
global step read from its frame; a failure inside a batch read, :data:`DATA_LOADING`, is a data
loading error naming the data set), the user's ``file:line`` (the innermost frame outside the
hpclb package and outside installed libraries; else the innermost outside hpclb) and how to get
the whole traceback (``HPCLB_TRACEBACK=1``).
Standard library only.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from types import TracebackType

__all__ = ["DATA_LOADING", "PHASES", "TRACEBACK_HINT", "describe", "phase_of", "user_frame"]

_HPCLB = str(Path(__file__).resolve().parents[1]) + os.sep
_LIBRARIES = tuple({str(Path(p).resolve()) + os.sep for p in (
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"])})
TRACEBACK_HINT = "set HPCLB_TRACEBACK=1 for the whole traceback"

#: (hpclb module file, function) -> the phase it runs (inside a training step, the global step
#: is added: "... of global step N")
PHASES = {
    ("setup.py", "build_recipe_model"): "in the model constructor (model.name)",
    ("plugin.py", "load_plugin_data"): "in the data function (data.name)",
    ("supervised.py", "_loss"): "in the loss function (task.loss)",
    ("supervised.py", "_metric_sums"): "in a metric function (task.metrics)",
    ("loop.py", "train_step"): "in the forward/backward",
    ("loop.py", "_epoch_row"): "in the evaluation after an epoch",
}
#: hpclb functions that read a batch from a data set (a failure inside is the data's, not the
#: forward/backward's)
DATA_LOADING = {("base.py", "batch"), ("classification.py", "batch"),
                ("language_model.py", "batch"), ("seq2seq.py", "batch")}


def _frames(tb: TracebackType | None):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _in_hpclb(filename: str) -> bool:
    return str(Path(filename).resolve()).startswith(_HPCLB)


def user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the innermost traceback frame of ``exc`` outside hpclb and
    outside the interpreter's libraries (else outside hpclb only); None when every frame is
    hpclb's or there is no traceback."""
    outside = [tb for tb in _frames(exc.__traceback__)
               if not _in_hpclb(tb.tb_frame.f_code.co_filename)]
    users = [tb for tb in outside if not str(Path(tb.tb_frame.f_code.co_filename).resolve())
             .startswith(_LIBRARIES)]
    for tb in (users or outside)[-1:]:
        code = tb.tb_frame.f_code
        return code.co_filename, tb.tb_lineno, code.co_name
    return None


def _global_step(frame) -> int | None:
    run = frame.f_locals.get("run")
    pos = getattr(run, "pos", None)
    step = getattr(pos, "global_step", None)
    return step + 1 if isinstance(step, int) else None  # the step being computed, 1-based


def _data_set(frame, run) -> str:
    """The data set a data-loading frame reads: a plug-in split's ``data.name`` and the class
    whose ``__getitem__`` (or ``__getitems__``) it calls; else the run's ``data.name``."""
    split = frame.f_locals.get("self")
    dataset = getattr(split, "dataset", None)
    while type(dataset).__name__ == "Subset":  # train_samples/test_samples: the first n
        dataset = getattr(dataset, "dataset", None)
    where = getattr(split, "where", None)
    if isinstance(where, str) and dataset is not None:
        get = "__getitems__" if hasattr(dataset, "__getitems__") else "__getitem__"
        return f"{where} ({type(dataset).__name__}.{get})"
    name = getattr(getattr(getattr(getattr(run, "cfg", None), "spec", None), "data", None),
                   "name", None)
    return f"data.name {name!r}" if name else "the recipe's data.name"


def phase_of(exc: BaseException) -> str | None:
    """The phase of :data:`PHASES` whose hpclb function is innermost on ``exc``'s traceback; a
    failure inside a batch read (:data:`DATA_LOADING`) is a data loading error naming the
    data set, in the phase around it (a training step, the evaluation)."""
    phase, step, data, run = None, None, None, None
    for tb in _frames(exc.__traceback__):
        code = tb.tb_frame.f_code
        key = (Path(code.co_filename).name, code.co_name)
        if not _in_hpclb(code.co_filename):
            continue
        if key in PHASES:
            phase = PHASES[key]
            if key[1] == "train_step":
                step, run = _global_step(tb.tb_frame), tb.tb_frame.f_locals.get("run")
        elif key in DATA_LOADING:
            data = tb.tb_frame
    if data is not None:
        text = f"a data loading error, in the data set {_data_set(data, run)}"
        if step is not None:
            return f"{text} for global step {step}"
        return text if phase is None else f"{text}, {phase}"
    if phase is None:
        return None
    return phase if step is None else f"{phase} of global step {step}"


def describe(exc: BaseException) -> str:
    """``"<phase>, at <file>:<line> (in <function>)"`` for an exception from user code (parts
    that are unknown left out), then the traceback hint; an empty string when neither the
    phase nor a frame outside hpclb is known."""
    phase, frame = phase_of(exc), user_frame(exc)
    parts = [phase] if phase else []
    if frame is not None:
        parts.append(f"at {frame[0]}:{frame[1]} (in {frame[2]})")
    return f" [{', '.join(parts)}; {TRACEBACK_HINT}]" if parts else ""
