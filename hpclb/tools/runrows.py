"""A finished run's ``metrics.jsonl`` as ``hpclb plot runs`` and ``hpclb advise`` read it: every
line or value they leave out is reported (``file:line`` and why), never a traceback.

:func:`read_run` keeps the epoch and step rows, each with its line number under ``_line``;
a line that is not JSON (a torn last line of a killed writer, or a damaged line in the middle)
is skipped with a warning. :func:`points` turns rows into ``(x, y)`` pairs and warns for each row
whose value is there but not a finite number (NaN, inf, null), or that cannot be placed on x.
Warnings go to the ``warn`` callable the caller passes (the command line prints them on stderr),
by default to the ``hpclb`` logger.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hpclb._io import json_lines_numbered
from hpclb.errors import ConfigError
from hpclb.train.metrics import METRICS_FILE, finite

__all__ = ["Warn", "RunRows", "metrics_path", "read_run", "points"]

Warn = Callable[[str], None]


def _log_warning(message: str) -> None:
    logging.getLogger("hpclb").warning(message)


@dataclass
class RunRows:
    """The rows of one run's ``metrics.jsonl`` (``path``), each dict with ``_line`` (1-based);
    ``diverged``: the line of a run that stopped on non-finite values (``step``, ``error``),
    else None."""

    path: Path
    epochs: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    diverged: dict | None = None
    warn: Warn = _log_warning


def metrics_path(run: Path) -> Path:
    """``run/metrics.jsonl`` (or ``run`` when it is a ``.jsonl`` file); ConfigError naming
    ``run`` when it is another file, not a directory, or a directory with no metrics file."""
    if run.is_file() and run.suffix == ".jsonl":
        return run
    if run.is_file():
        raise ConfigError(f"{run}: a file, not a run directory: give the --out directory of "
                          f"`hpclb train` ({run.parent}?) or its {METRICS_FILE}")
    if not run.is_dir():
        raise ConfigError(f"{run}: no such run directory (give the --out directory of `hpclb "
                          f"train`)")
    path = run / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: no metrics file; is {run} a run directory written by "
                          f"`hpclb train --out`?")
    return path


def read_run(run_dir: str | Path, warn: Warn | None = None) -> RunRows:
    """Read ``run_dir/metrics.jsonl`` (or that file itself). Lines without ``kind`` are epoch
    rows (runs made before per-step logging), other kinds are ignored. ConfigError naming the
    directory when it or its metrics file is missing or unreadable; ``warn`` for each line left
    out."""
    path = metrics_path(Path(run_dir))
    rows = RunRows(path, warn=warn or _log_warning)
    try:
        lines = list(json_lines_numbered(path))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e})") from e
    for number, _, row, last in lines:
        if not isinstance(row, dict):
            why = ("not JSON (a torn last line: the writer was killed)" if last and row is None
                   else "not JSON (a damaged line)" if row is None else "not a JSON object")
            rows.warn(f"{path}:{number}: {why}; line skipped")
            continue
        kind = row.pop("kind", "epoch")
        row["_line"] = number
        if kind == "epoch":
            rows.epochs.append(row)
        elif kind == "step":
            rows.steps.append(row)
        elif kind == "diverged":
            rows.diverged = row
    return rows


def _lines(numbers: list[int], limit: int = 20) -> str:
    shown = ", ".join(map(str, numbers[:limit]))
    return shown + (f", ... ({len(numbers)} lines in all)" if len(numbers) > limit else "")


def points(rows: RunRows, which: list[dict], key: str,
           x_of: Callable[[dict], float | None]) -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of ``key`` over ``which`` (rows of ``rows``), in order. A row without ``key``
    is not a point; rows whose ``key`` is not a finite number (NaN, inf, null), or whose x is
    None, are dropped with one warning per reason naming their lines."""
    xs, ys = [], []
    bad: dict[str, list[int]] = {}
    no_x: list[int] = []
    for r in which:
        if key not in r:
            continue
        y, x = r[key], x_of(r)
        if not finite(y):
            bad.setdefault("null" if y is None else repr(y), []).append(r["_line"])
        elif x is None:
            no_x.append(r["_line"])
        else:
            xs.append(x)
            ys.append(y)
    for value, numbers in bad.items():
        rows.warn(f"{rows.path}: line {_lines(numbers)}: {key} = {value} is not a finite number; "
                  f"point dropped")
    if no_x:
        rows.warn(f"{rows.path}: line {_lines(no_x)}: {key} has no place on the epoch axis (steps "
                  f"per epoch unknown: no summary.json and no epoch row with a step); point "
                  f"dropped")
    return xs, ys
