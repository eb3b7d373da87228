"""``hpclb compare RUN...``: runs side by side, one row each, as Markdown or CSV.

A run directory (``hpclb train --out``) holds ``config.json`` (the resolved settings and the
recipe, written when the run starts), ``metrics.jsonl`` (one epoch line per epoch,
:mod:`hpclb.tools.runrows` reads it) and, once it finished, ``summary.json``. A finished run's row
comes from its summary; an unfinished one's (stopped, preempted, or still training) from its
config and epoch lines so far, marked ``unfinished``, or ``diverged at step S`` when it stopped
on non-finite values (its ``metrics.jsonl`` says so). The metric of a row is the recipe's
:func:`~hpclb.tasks.spec.primary_metric` (``target.metric``, as sweeps report), its best value
taken in the metric's direction (:func:`~hpclb.tasks.spec.metric_mode`).

Row fields (:data:`COLUMNS`): ``run`` (the directory as given), ``experiment``, ``batch`` (the
global batch in samples), ``scheme`` (the scaling), ``optimizer``, ``peak_lr`` (the
schedule's peak learning rate), ``warmup_steps``, ``ranks``, ``steps`` (optimizer steps done;
for a diverged run the step it stopped at; None when no epoch ended), ``epochs`` (the budget),
``metric`` (its name), ``final`` and ``best`` (its values),
``time_to_target_s`` (wall seconds to the first epoch that reached the recipe's target; None when
not reached or without a target), ``samples_per_s`` (mean over the epochs measured in one
go), ``wall_time_s`` and ``status`` (``finished``, ``unfinished`` or ``diverged at step S``).
"""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from hpclb._io import read_json
from hpclb.config.settings import OPTIONS
from hpclb.errors import ConfigError
from hpclb.sync.options import (
    DEFAULT_COMM_POLL_S,
    DEFAULT_FIRST_BUCKET_BYTES,
    DEFAULT_FUSION_THRESHOLD_BYTES,
    DEFAULT_STALL_TIMEOUT_S,
    TRAIN_STALL_ABORT_S,
)
from hpclb.tasks.spec import metric_mode, primary_metric
from hpclb.tools.runrows import RunRows, Warn, read_run
from hpclb.tools.sweep_report import format_metric

__all__ = ["COLUMNS", "compare_rows", "csv_table", "markdown_table", "run_row"]

COLUMNS = ("run", "experiment", "batch", "scheme", "optimizer", "peak_lr", "warmup_steps",
           "ranks", "steps", "epochs", "metric", "final", "best", "time_to_target_s",
           "samples_per_s", "wall_time_s", "status", "sync")
# gradient-sync settings shown when a run's differ from these (config.json's "sync": what
# hpclb train uses unless an HPCLB_* variable says otherwise; stall_abort_s None: never)
_SYNC_DEFAULTS = {"fusion_threshold_bytes": DEFAULT_FUSION_THRESHOLD_BYTES, "compression": "none",
                  "first_bucket_bytes": DEFAULT_FIRST_BUCKET_BYTES, "overlap_setting": "auto",
                  "stall_timeout_s": DEFAULT_STALL_TIMEOUT_S, "stall_abort_s": TRAIN_STALL_ABORT_S,
                  "comm_poll_s": DEFAULT_COMM_POLL_S}


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = read_json(path, "a run's JSON files")
    except ValueError as e:
        raise ConfigError(f"{e}; is the run directory damaged?") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e}); is the run directory damaged?") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object; is the run directory damaged?")
    return value


def _metric(recipe: dict | None, summary: dict | None) -> str | None:
    """The row's metric: the recipe's primary metric, else the summary's last evaluated one."""
    evaluated = [k[len("final_"):] for k in (summary or {}) if k.startswith("final_")]
    name = primary_metric(recipe) if recipe else (summary or {}).get("metric_name")
    if summary is not None and name not in evaluated:
        return evaluated[-1] if evaluated else None
    return name


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and v == v]
    return sum(values) / len(values) if values else None


def _from_epochs(row: dict, rows: RunRows, recipe: dict | None) -> None:
    """Fill an unfinished run's numbers from its epoch lines, and its status: ``diverged at
    step S`` when it stopped on non-finite values, else ``unfinished`` (cut, preempted, or
    still training)."""
    epochs, metric = rows.epochs, row["metric"]
    if rows.diverged is not None:
        row["status"] = f"diverged at step {rows.diverged.get('step')}"
    values = [r[metric] for r in epochs if isinstance(r.get(metric), (int, float))]
    mode = metric_mode(metric or "", recipe)
    target = (recipe or {}).get("target") or {}
    reached = [r for r in epochs if target.get("metric") == metric and "value" in target and
               isinstance(r.get(metric), (int, float)) and
               (r[metric] >= target["value"] if mode == "max" else r[metric] <= target["value"])]
    last = epochs[-1] if epochs else {}
    steps = rows.diverged.get("step") if rows.diverged is not None else last.get("step")
    row.update(steps=steps, final=values[-1] if values else None,
               best=(max if mode == "max" else min)(values) if values else None,
               time_to_target_s=reached[0].get("elapsed_s") if reached else None,
               samples_per_s=_mean([r.get("samples_per_s") for r in epochs]),
               wall_time_s=last.get("elapsed_s"))


def run_row(run_dir: str | Path, warn: Warn | None = None) -> dict[str, Any]:
    """The row of one run directory (:data:`COLUMNS`). ConfigError naming the path and the fix
    when it is not a run directory (no ``summary.json`` and no ``metrics.jsonl``)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a run directory (no such directory); give the --out "
                          f"directory of `hpclb train`")
    summary, config = _read_json(path / "summary.json"), _read_json(path / "config.json")
    if summary is None and not (path / "metrics.jsonl").is_file():
        raise ConfigError(f"{path}: not a run directory (no summary.json and no metrics.jsonl); "
                          f"give the --out directory of `hpclb train`")
    source = summary or config or {}
    recipe = (config or {}).get("recipe")
    row = {"run": str(run_dir), "experiment": source.get("experiment"),
           **{o.column: source.get(name) for name, o in OPTIONS.items() if o.column},
           "peak_lr": source.get("peak_lr"), "warmup_steps": source.get("warmup_steps"),
           "ranks": source.get("world_size"), "metric": _metric(recipe, summary),
           "status": "finished" if summary is not None else "unfinished",
           "sync": _sync_shown(config)}
    if summary is not None:
        metric = row["metric"]
        row.update(steps=summary.get("steps"), final=summary.get(f"final_{metric}"),
                   best=summary.get(f"best_{metric}"),
                   time_to_target_s=summary.get("time_to_target_s"),
                   samples_per_s=summary.get("mean_samples_per_s"),
                   wall_time_s=summary.get("wall_time_s"))
    else:
        _from_epochs(row, read_run(path, warn=warn), recipe)
    return {k: row.get(k) for k in COLUMNS}


def _sync_shown(config: dict | None) -> str | None:
    """The run's gradient-sync settings that differ from hpclb train's defaults, e.g.
    ``"compression fp16, overlap thread"`` (the overlap mode only when set, not chosen by auto;
    ``stall_abort_s never``),
    or None (a run from before config.json recorded them: unknown)."""
    sync = (config or {}).get("sync")
    if sync is None:
        return None
    shown = [f"{k.removesuffix('_setting')} {'never' if sync[k] is None else sync[k]}"
             for k, v in _SYNC_DEFAULTS.items() if k in sync and sync[k] != v]
    if (config or {}).get("trust_backend", "auto") != "auto":
        shown.append(f"trust_backend {config['trust_backend']}")
    return ", ".join(shown) or "defaults"


def compare_rows(run_dirs: list[str | Path], warn: Warn | None = None) -> list[dict[str, Any]]:
    """One :func:`run_row` per directory, in the order given (ConfigError for the first that is
    not a run directory)."""
    if not run_dirs:
        raise ConfigError("give at least one run directory (the --out of `hpclb train`)")
    return [run_row(d, warn) for d in run_dirs]


def _number(value: Any, digits: str = ",.0f") -> str:
    return "—" if value is None else format(value, digits)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: metrics as in sweep tables (accuracies in %), times in
    seconds, throughput in samples/s; "—" for a value a run does not have."""
    head = ("run", "experiment", "batch", "scheme", "optimizer", "peak LR", "warmup steps",
            "ranks", "steps", "epochs", "metric",
            "final", "best", "time to target (s)", "samples/s", "wall time (s)", "status",
            "sync settings")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r["metric"] or ""
        cells = (r["run"], r["experiment"] or "—", _number(r["batch"], "d"), r["scheme"] or "—",
                 r["optimizer"] or "—", _number(r["peak_lr"], ".4g"),
                 _number(r["warmup_steps"], "d"), _number(r["ranks"], "d"),
                 _number(r["steps"], "d"), _number(r["epochs"], "g"),
                 m or "—", format_metric(m, r["final"]), format_metric(m, r["best"]),
                 _number(r["time_to_target_s"], ".1f"), _number(r["samples_per_s"]),
                 _number(r["wall_time_s"], ".1f"), r["status"], r["sync"] or "—")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def csv_table(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV with a header of :data:`COLUMNS`, numbers unformatted, empty for None."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if v is None else v for k, v in r.items()})
    return out.getvalue()
