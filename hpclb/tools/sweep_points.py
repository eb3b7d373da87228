"""A sweep's points (:mod:`hpclb.tools.sweep`): their identity, their rows, and the sweep's
status (done, running, left, hours expected)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

__all__ = ["Point", "SweepStatus", "flock", "is_rejected", "row_of", "shown"]


@contextlib.contextmanager
def flock(path: Path, *, block: bool = True):
    """An exclusive ``flock`` on ``path`` for the ``with`` block; yields False (and holds
    nothing) when ``block`` is False and another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def shown(path: Path, *, scratch: bool = False) -> str:
    """``path`` relative to the working directory when it lies under it (the rows of a sweep
    are committed with a repository and must not name this machine's directories); else the
    path itself, or for a ``scratch`` one (a point's run directory under a ``--runs-dir``
    elsewhere) ``…/`` and its last two parts."""
    rel = os.path.relpath(Path(path).resolve(), Path.cwd().resolve())
    if not rel.startswith(".."):
        return rel
    return str(Path("…", *Path(path).parts[-2:])) if scratch else str(path)


@dataclass(frozen=True)
class Point:
    """One point of a sweep, its identity: global ``batch`` (samples), ``scheme``, ``seed``,
    ``optimizer``, ``epochs``, ``ranks`` and ``accumulation`` (micro-batches per step on each
    rank; it changes BatchNorm's statistics). Two rows or runs are the same point when all
    agree. ``default_epochs`` (the recipe's own ``epochs``; not part of the identity) only
    decides whether :attr:`dir_name` names the epochs."""

    batch: int
    scheme: str
    seed: int
    optimizer: str
    epochs: float
    ranks: int
    accumulation: int = 1
    default_epochs: float | None = field(default=None, compare=False)

    @classmethod
    def of_row(cls, row: dict) -> "Point":
        return cls(row["batch_size"], row["scheme"], row.get("seed", 0), row.get("optimizer"),
                   row.get("epochs"), row.get("ranks", 1), row.get("accumulation_steps", 1))

    @classmethod
    def of_summary(cls, s: dict) -> "Point":
        """The point of a run's ``summary.json`` or ``config.json`` (KeyError if it is not a
        run's)."""
        return cls(s["global_batch_size"], s["scaling"], s["seed"], s["optimizer"], s["epochs"],
                   s.get("world_size", s.get("expect_world_size") or 1),
                   s.get("accumulation_steps") or 1)

    def with_scheme(self, scheme: str) -> "Point":
        return replace(self, scheme=scheme)

    @property
    def dir_name(self) -> str:
        """``<optimizer>-<scheme>-b<B>[-a<K>][-e<epochs>][-r<ranks>]-s<seed>``: the point's run
        directory (and lock, and ``points/``) name, naming every part of its identity that
        differs from the default: ``-a<K>`` for K > 1 micro-batches per step, ``-e<epochs>``
        for epochs other than ``default_epochs`` (when known), ``-r<ranks>`` for more than one
        rank. So two points never share a directory; a point of the recipe's epochs on one
        rank keeps the name of earlier versions (``adam-legw-b256-s0``)."""
        acc = f"-a{self.accumulation}" if self.accumulation > 1 else ""
        epochs = f"-e{self.epochs:.12g}" if self.default_epochs is not None \
            and self.epochs != self.default_epochs else ""
        ranks = f"-r{self.ranks}" if self.ranks > 1 else ""
        return f"{self.optimizer}-{self.scheme}-b{self.batch}{acc}{epochs}{ranks}-s{self.seed}"

    def __str__(self) -> str:
        return f"B={self.batch} {self.scheme} seed {self.seed}"

    def settings(self) -> dict:
        return {"epochs": self.epochs, "ranks": self.ranks, "seed": self.seed,
                "optimizer": self.optimizer, "accumulation_steps": self.accumulation}

    def failed_row(self, metric: str, error: Exception, run_dir: Path, wall_s: float,
                   diverged_at_step: int | None) -> dict:
        """The row of a point rejected before training (``diverged_at_step`` None) or stopped
        on non-finite values at ``diverged_at_step``; a diverged point's row has its schedule
        (:data:`SCHEDULE_COLUMNS`, known before training) from its run's ``config.json``."""
        what = "rejected" if diverged_at_step is None and "diverg" not in str(error) else \
            "diverged"
        return {"batch_size": self.batch, "scheme": self.scheme, "metric_name": metric,
                "metric": None, **self.settings(), "wall_time_s": wall_s, "steps": 0,
                "time_to_target_s": None,
                **(_schedule_of(run_dir, self) if what == "diverged" else {}),
                "run_dir": shown(run_dir, scratch=True), "status": what,
                "diverged_at_step": diverged_at_step,
                "error": str(error).replace(str(run_dir), shown(run_dir, scratch=True))}


#: a row's schedule columns: known before the first step, so a diverged point's row has them
SCHEDULE_COLUMNS = ("batch_ratio_k", "base_lr", "peak_lr", "warmup_steps", "warmup_epochs",
                    "warmup_start_lr", "decay", "steps_per_epoch")


def _schedule_of(run_dir: Path, p: Point) -> dict:
    """:data:`SCHEDULE_COLUMNS` from ``run_dir/config.json`` when it is ``p``'s run ({} when
    there is none, or it is another point's)."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        if Point.of_summary(config) != p:
            return {}
    except (OSError, ValueError, KeyError):
        return {}
    return {k: config[k] for k in SCHEDULE_COLUMNS if k in config}


def row_of(summary: dict, p: Point, *, metric: str, run_dir: Path) -> dict:
    """The row of a finished point from its ``summary.json``; a non-finite final metric is
    recorded as None."""
    value = summary.get(f"final_{metric}")
    return {"batch_size": p.batch, "scheme": p.scheme, "metric_name": metric,
            "metric": value if value is None or math.isfinite(value) else None,
            "best_metric": summary.get(f"best_{metric}"), **p.settings(),
            "wall_time_s": summary["wall_time_s"], "steps": summary["steps"],
            "steps_per_epoch": summary["steps_per_epoch"],
            "time_to_target_s": summary.get("time_to_target_s"), "target": summary.get("target"),
            "batch_ratio_k": summary["batch_ratio_k"], "base_lr": summary["base_lr"],
            "peak_lr": summary["peak_lr"], "warmup_steps": summary["warmup_steps"],
            "warmup_epochs": summary["warmup_epochs"],
            "warmup_start_lr": summary.get("warmup_start_lr", 0.0), "decay": summary["decay"],
            "mean_samples_per_s": summary.get("mean_samples_per_s"),
            "run_dir": shown(run_dir, scratch=True), "status": "done", "error": None, "note": None}


def is_rejected(row: dict) -> bool:
    """Whether a sweep row records a rejected point (an error, not trained; a diverged point
    has an error too, but it is a result)."""
    return bool(row.get("error")) and row.get("status") != "diverged"


@dataclass
class SweepStatus:
    """A sweep's points split into ``done`` (recorded), ``stale`` (recorded with other settings
    than now: the sweep refuses them without ``--overwrite``), ``running`` (another process
    holds the point's lock) and ``left``; ``expected_s``: the seconds the left points are
    expected to take, from the mean wall time of recorded points at the same batch (else of all
    recorded points; None when nothing is recorded yet)."""

    done: list[Point] = field(default_factory=list)
    running: list[Point] = field(default_factory=list)
    left: list[Point] = field(default_factory=list)
    expected_s: float | None = None
    stale: list[Point] = field(default_factory=list)
    array: str | None = None  # the job array submitted for the sweep (hpclb sweep --submit)
    #: of ``done``, the points recorded as rejected (an error, not trained: not a result)
    rejected: list[Point] = field(default_factory=list)

    @classmethod
    def of(cls, points: list[Point], rows: list[dict], runs_dir: Path, base_batch: int,
           current: Callable[[Point, dict], bool] = lambda p, row: True) -> "SweepStatus":
        """``current(p, row)``: whether ``row`` records ``p`` under the settings now."""
        recorded = {Point.of_row(r): r for r in rows}
        st = cls()
        for p in points:
            if p in recorded:
                row = recorded[p]
                (st.done if current(p, row) else st.stale).append(p)
                if current(p, row) and is_rejected(row):  # of the done points
                    st.rejected.append(p)
            elif _held(runs_dir / f".{p.dir_name}.lock"):
                st.running.append(p)
            else:
                st.left.append(p)
        trained = [r for r in rows if r.get("status", "done") == "done" and not r.get("note")
                   and isinstance(r.get("wall_time_s"), (int, float))]
        if trained:
            overall = sum(r["wall_time_s"] for r in trained) / len(trained)
            st.expected_s = 0.0
            b0_seeds = {p.seed for p in st.done + st.running if p.batch == base_batch}
            for p in st.left:
                if p.batch == base_batch:  # at k = 1 one scheme trains, the others copy its row
                    if p.seed in b0_seeds:
                        continue
                    b0_seeds.add(p.seed)
                same = [r["wall_time_s"] for r in trained if r["batch_size"] == p.batch]
                st.expected_s += sum(same) / len(same) if same else overall
        return st

    def line(self) -> str:
        """``"3 done, 1 running, 8 left (about 1.2 h expected)"``."""
        eta = "time unknown until a point is recorded" if self.expected_s is None else \
            f"about {self.expected_s / 3600:.1f} h expected on this machine"
        stale = f", {len(self.stale)} recorded with other settings than now (refused " \
            f"without --overwrite)" if self.stale else ""
        refused = f" ({len(self.rejected)} of them rejected, not trained: see the table's " \
            f"error column)" if self.rejected else ""
        return (f"{len(self.done)} done{refused}{stale}, {len(self.running)} running elsewhere, "
                f"{len(self.left)} left ({eta})")


def _held(lock: Path) -> bool:
    """Whether another process holds the exclusive lock ``lock`` (False when it does not
    exist)."""
    if not lock.exists():
        return False
    with flock(lock, block=False) as mine:
        return not mine
