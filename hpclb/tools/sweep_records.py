"""Whether what a sweep finds on disk is its own and of its settings (:mod:`hpclb.tools.sweep`).

A recorded point belongs to the recipe that produced it. Each row written since rows carry
``recipe`` (:func:`recipe_fields`: every recipe field that can change a number of that point)
is compared field by field with the recipe now; a row of an earlier version, without
``recipe``, is compared on the schedule it holds (:data:`SCHEDULE_KEYS`: base and peak LR,
warmup, decay, k, target) with the schedule the recipe now gives that point; a row holding
neither (a point rejected before it had a schedule) is accepted as before. A point's run
directory is compared through the ``recipe`` of its ``config.json``.

The files a sweep writes under ``--out-dir`` (:func:`output_files`) are replaced only when they
are the sweep's own: its ``<name>.json`` reads as a list of sweep rows, its ``<name>.md`` starts
with ``# Sweep:``; the ``.png`` and ``points/`` beside them are the sweep's when the ``.json``
is. Anything else is someone else's file (:func:`foreign_outputs`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from hpclb.errors import ConfigError
from hpclb.schedules import SCHEMES
from hpclb.tools.sweep_points import Point

__all__ = ["SCHEDULE_KEYS", "Settings", "check_outputs", "differences", "foreign_outputs",
           "load_rows", "output_files", "recipe_fields", "refuse_stale"]

# recipe fields that change no number of a point: text, locations, the point's own identity
# (epochs, optimizer), job-script defaults, logging and checkpoint keeping, sync watchdogs
_NOT_COMPARED = {"name", "tuning", "plugin_path", "epochs", "optimizer", "per_gpu_batch",
                 "log_every", "keep_checkpoints", "sync.stall_timeout_s", "sync.stall_abort_s"}
#: the schedule columns of a row of an earlier version compared with the recipe's now
SCHEDULE_KEYS = ("batch_ratio_k", "base_lr", "peak_lr", "warmup_steps", "warmup_start_lr",
                 "decay", "target")
_SHOWN = 6  # points named in a refusal


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flat(sub, f"{path}.{key}" if path else str(key)))
        return out
    return {path: value}


def recipe_fields(recipe: dict, optimizer: str) -> dict[str, Any]:
    """The fields of ``recipe`` that can change a number of a point trained with ``optimizer``,
    flattened to ``"a.b": value`` (JSON-normalised; ``optimizers.<optimizer>`` only)."""
    flat = _flat(json.loads(json.dumps(recipe, default=str)))
    return {k: v for k, v in sorted(flat.items())
            if k not in _NOT_COMPARED and k.split(".")[0] not in _NOT_COMPARED
            and not (k.startswith("optimizers.") and k.split(".")[1] != optimizer)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not \
            isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _compare(then: dict, now: dict, what: str) -> list[str]:
    absent = "absent"
    return [f"{what} {k}: {json.dumps(then.get(k, absent))} recorded, "
            f"{json.dumps(now.get(k, absent))} now"
            for k in sorted(then.keys() | now.keys())
            if not _same(then.get(k, absent), now.get(k, absent))]


def differences(row: dict, now: dict[str, Any],
                schedule: Callable[[dict], dict]) -> list[str]:
    """How the recorded ``row`` differs from the settings now (empty: it is of them). ``now``:
    :func:`recipe_fields` of the recipe; ``schedule(row)``: the :data:`SCHEDULE_KEYS` the
    recipe now gives the row's point (on the training set the run reads), used for a row without
    ``recipe``; it may raise ConfigError (the point is rejected now)."""
    if isinstance(row.get("recipe"), dict):
        return _compare(row["recipe"], now, "recipe field")
    held = {k: row[k] for k in SCHEDULE_KEYS if row.get(k) is not None}
    if not held or not row.get("steps_per_epoch"):
        return []  # nothing to compare (a row rejected before it had a schedule): as before
    try:
        expected = schedule(row)
    except ConfigError as e:
        return [f"schedule: recorded, rejected now ({e})"]
    return _compare(held, {k: expected.get(k) for k in held}, "schedule")


def refuse_stale(stale: dict[str, list[str]], name: str) -> None:
    """ConfigError naming the points of ``stale`` (point -> its differences) and the fixes."""
    if not stale:
        return
    lines = [f"{p}: {'; '.join(d)}" for p, d in list(stale.items())[:_SHOWN]]
    more = f" (and {len(stale) - _SHOWN} more points)" if len(stale) > _SHOWN else ""
    raise ConfigError(f"sweep {name}: {len(stale)} recorded point(s) were made with other "
                      f"settings than now{more}: " + " | ".join(lines) + "; restore the "
                      "recipe those points were made with, choose another --out-dir and "
                      "--runs-dir for the new settings, or add --overwrite to re-run them")


def load_rows(path: Path) -> list[dict]:
    """The rows of a sweep's JSON (an empty list when it does not exist). ConfigError naming
    the file when it is not a sweep's record (a list of rows with batch_size and scheme)."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        rows = e
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and {"batch_size", "scheme"} <= r.keys() for r in rows):
        raise ConfigError(f"--out-dir: {path} is not a sweep's record (expected the JSON list "
                          f"of rows hpclb sweep writes): move it away, choose another "
                          f"--out-dir, or add --overwrite to replace it")
    return rows


def output_files(out_dir: Path, name: str) -> list[Path]:
    """What a sweep writes under ``out_dir`` besides ``points/``: ``<name>.json``, ``.md``,
    ``.png``."""
    return [out_dir / f"{name}{suffix}" for suffix in (".json", ".md", ".png")]


def foreign_outputs(out_dir: Path, name: str, point_dirs: list[str]) -> list[Path]:
    """The files a sweep would replace under ``out_dir`` that are not its own: an unreadable
    or foreign ``<name>.json``, a ``<name>.md`` not starting with ``# Sweep:``, and, without a
    record of the sweep's there, a ``<name>.png`` or ``points/<point>/`` files of
    ``point_dirs``."""
    json_path, md, png = output_files(out_dir, name)
    try:
        own = bool(load_rows(json_path) is not None and json_path.exists())
    except ConfigError:
        own = False
    found = [] if own or not json_path.exists() else [json_path]
    if md.exists():
        try:
            mine = md.read_text(errors="replace").startswith("# Sweep:")
        except OSError:
            mine = False
        if not mine:
            found.append(md)
    if not own:
        found += [png] if png.exists() else []
        for d in point_dirs:
            found += [out_dir / "points" / d / f for f in ("summary.json", "metrics.jsonl")
                      if (out_dir / "points" / d / f).exists()]
    return found


def check_outputs(out_dir: Path, name: str, point_dirs: list[str], overwrite: bool) -> None:
    """Before any point trains: ConfigError naming the :func:`foreign_outputs` under
    ``out_dir`` and the fixes; with ``overwrite`` they are deleted instead (the sweep writes
    its own in their place)."""
    found = foreign_outputs(out_dir, name, point_dirs)
    if found and not overwrite:
        shown = ", ".join(str(f) for f in found[:_SHOWN]) + \
            (f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else "")
        raise ConfigError(f"--out-dir {out_dir} holds files the sweep would replace that are "
                          f"not its own ({shown}); choose another --out-dir, move them away, "
                          f"or add --overwrite to replace them")
    for f in found:
        f.unlink()


class Settings:
    """The settings a sweep's points are made with now: :meth:`stale` compares a recorded row
    with them, :meth:`stale_run` a run directory's ``config.json``. ``resolve(p)``: the
    :class:`~hpclb.config.RunConfig` of point ``p`` (its batch, scheme, optimizer, epochs,
    seed and micro-batches)."""

    def __init__(self, recipe: dict, resolve: Callable[[Any], Any]):
        self.recipe, self.resolve = recipe, resolve
        self._train_samples: int | None = None

    def train_samples(self, cfg) -> int:
        """The training set's size, as the run counts it (read once)."""
        if self._train_samples is None:
            from hpclb.tools.dryrun import train_set_size_of
            self._train_samples = train_set_size_of(cfg)[0]
        return self._train_samples

    def fields(self, optimizer: str) -> dict[str, Any]:
        """:func:`recipe_fields` of the recipe now, for ``optimizer``."""
        return recipe_fields(self.recipe, optimizer)

    def _schedule(self, p) -> dict:
        cfg = self.resolve(p)
        sched = cfg.schedule(self.train_samples(cfg))
        return {"batch_ratio_k": p.batch / cfg.base_batch_size, "base_lr": cfg.base_lr,
                "peak_lr": sched.peak_lr, "warmup_steps": sched.warmup_steps,
                "warmup_start_lr": sched.warmup_start_lr, "decay": cfg.recipe["decay"],
                "target": cfg.recipe.get("target") or None}

    def stale(self, p, row: dict) -> list[str]:
        """How the row of point ``p`` differs from the settings now (:func:`differences`). At
        k = 1 every scheme's row is the run of one of them (the sweep copies it), so a row
        without ``recipe`` there is of the settings now when it matches any scheme's schedule."""
        now = self.fields(p.optimizer)
        found = differences(row, now, lambda r: self._schedule(p))
        if found and "recipe" not in row and p.batch == self.recipe["base_batch_size"]:
            for scheme in SCHEMES:
                q = p.with_scheme(scheme)
                if not differences(row, now, lambda r, q=q: self._schedule(q)):
                    return []
        return found

    def stale_run(self, p, run_dir: Path) -> list[str]:
        """How the run of point ``p`` in ``run_dir`` (its ``config.json``'s recipe) differs
        from the recipe now; empty without a readable one, or when it is another point's."""
        try:
            config = json.loads((run_dir / "config.json").read_text())
            if Point.of_summary(config) != p:
                return []  # another point's run: the sweep handles it as such
            then = recipe_fields(config["recipe"], config["optimizer"])
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return _compare(then, self.fields(p.optimizer), "recipe field")
