"""The verdict of a seeded sweep by the rules of docs/science.md, fixed before the runs.

- **LEGW holds at k** when its mean over seeds is within the tolerance of the B0 mean — for an
  accuracy ``max(0.3 pp, 2 sigma0)``, for a perplexity (or any metric to minimise)
  ``max(3 % of the B0 mean, 2 sigma0)``, ``sigma0`` the B0 seeds' standard deviation — and no
  seed is worse than the B0 mean by more than twice the tolerance, or non-finite (diverged).
- **A baseline loses** when it misses the same tolerance and is worse than LEGW (its mean over
  seeds) by more than ``2 * pooled sigma`` on every seed it ran; ``pooled sigma`` is the root
  mean square of the two schemes' seed standard deviations. A diverged seed is worse than any
  finite value.
- **The central claim is supported** at a workload only if LEGW holds at the largest k and both
  sqrt-with-fixed-warmup (``sqrt``) and Goyal's linear scaling (``goyal``) lose there.

Standard deviations use ``n - 1`` (sample); one seed gives sigma 0. A point the schedule
rejected (not trained: :func:`~hpclb.tools.sweep_points.is_rejected`) is not a result: it is left
out of every cell and shown as rejected, so it can neither fail nor support the claim.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from hpclb.tools.sweep_points import is_rejected

__all__ = ["Cell", "cells", "base_cell", "tolerance", "verdict", "verdict_markdown"]


@dataclass(frozen=True)
class Cell:
    """The seeds of one ``(batch, scheme)``: ``values`` by seed (None: diverged)."""

    batch: int
    scheme: str
    values: dict[int, float | None]

    @property
    def finite(self) -> list[float]:
        return [v for v in self.values.values() if v is not None and math.isfinite(v)]

    @property
    def complete(self) -> bool:
        """Every seed ran to a finite value."""
        return len(self.finite) == len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.finite) if self.finite else None

    @property
    def std(self) -> float:
        return statistics.stdev(self.finite) if len(self.finite) > 1 else 0.0


def cells(rows: list[dict]) -> dict[tuple[int, str], Cell]:
    """Rows of one budget (same epochs, ranks, optimizer) grouped by ``(batch, scheme)``;
    rejected rows (not trained) are left out."""
    out: dict[tuple[int, str], dict[int, float | None]] = {}
    for r in rows:
        if is_rejected(r):
            continue
        out.setdefault((r["batch_size"], r["scheme"]), {})[r.get("seed", 0)] = r.get("metric")
    return {key: Cell(key[0], key[1], dict(sorted(v.items()))) for key, v in out.items()}


def base_cell(rows: list[dict], base_batch: int) -> Cell:
    """The B0 cell: every row at ``base_batch``, whatever its scheme (at k = 1 every scheme is
    the B0 recipe), pooled by seed, so the rows' order does not matter. Raises ValueError when
    there is no finite B0 point, or when one seed has two different B0 values."""
    values: dict[int, float | None] = {}
    for r in rows:
        if r["batch_size"] != base_batch or is_rejected(r):
            continue
        seed, v = r.get("seed", 0), r.get("metric")
        if seed in values and values[seed] != v:
            raise ValueError(f"B0 (batch {base_batch}) seed {seed} has two values, "
                             f"{values[seed]!r} and {v!r}: the B0 runs of one seed must agree")
        values[seed] = v
    cell = Cell(base_batch, "all", dict(sorted(values.items())))
    if not cell.finite:
        raise ValueError(f"no finite B0 (batch {base_batch}) point to judge against")
    return cell


def tolerance(base: Cell, metric: str, mode: str) -> float:
    """``max(0.003, 2 sigma0)`` for an accuracy (a fraction), else ``max(3 % of the B0 mean,
    2 sigma0)``."""
    if "accuracy" in metric and mode == "max":
        return max(0.003, 2 * base.std)
    return max(0.03 * abs(base.mean), 2 * base.std)


def _worse_by(value: float | None, ref: float, mode: str) -> float:
    """How much worse ``value`` is than ``ref`` (inf for a non-finite value)."""
    if value is None or not math.isfinite(value):
        return math.inf
    return ref - value if mode == "max" else value - ref


def verdict(rows: list[dict], *, metric: str, mode: str, base_batch: int) -> dict:
    """The verdict of one budget's rows (see the module docstring): ``{"tolerance", "base",
    "largest_batch", "holds": {batch: bool | None}, "loses": {(batch, scheme): bool},
    "supported"}``. LEGW at a batch is pending (None) until it has as many seeds as B0, and
    the baselines there are not judged before; ``supported`` is False as soon as one of its
    conditions is decided False (LEGW does not hold, or a baseline does not lose), else None
    while a needed cell is missing or pending. Raises ValueError without B0 rows."""
    table = cells(rows)
    base = base_cell(rows, base_batch)
    tol = tolerance(base, metric, mode)
    holds, loses = {}, {}
    for (b, s), c in sorted(table.items()):
        if b == base_batch:
            continue
        miss = c.mean is None or _worse_by(c.mean, base.mean, mode) > tol
        if s == "legw":
            # pending (None) until LEGW has as many seeds as B0
            holds[b] = None if len(c.values) < len(base.values) else not miss and all(
                _worse_by(v, base.mean, mode) <= 2 * tol for v in c.values.values())
            continue
        legw = table.get((b, "legw"))
        if legw is None or legw.mean is None or len(legw.values) < len(base.values):
            continue
        pooled = math.sqrt((legw.std ** 2 + c.std ** 2) / 2)
        loses[(b, s)] = miss and all(_worse_by(v, legw.mean, mode) > 2 * pooled
                                     for v in c.values.values())
    largest = max((b for b, _ in table), default=base_batch)
    needed = [holds.get(largest), loses.get((largest, "sqrt")), loses.get((largest, "goyal"))]
    # all three must be True: one False decides it; otherwise a missing one leaves it open
    supported = False if False in needed else None if None in needed else True
    return {"tolerance": tol, "base": base, "largest_batch": largest, "holds": holds,
            "loses": loses, "supported": supported}


def _show(metric: str, v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "diverged"
    return f"{100 * v:.2f}%" if "accuracy" in metric else f"{v:.4g}"


def verdict_markdown(rows: list[dict], *, metric: str, mode: str, base_batch: int) -> str:
    """A markdown section: mean ± std over seeds per (batch, scheme), the seeds, and the
    verdict by the rules of the module docstring."""
    table = cells(rows)
    try:
        v = verdict(rows, metric=metric, mode=mode, base_batch=base_batch)
    except ValueError as e:
        return f"## Verdict\n\nNo verdict yet: {e}.\n"
    scale = 100 if "accuracy" in metric else 1
    unit = " pp" if scale == 100 else ""
    lines = ["## Seeds and verdict", "",
             f"Tolerance {v['tolerance'] * scale:.3g}{unit} (rules: docs/science.md).", "",
             "| batch | scheme | mean ± std | seeds | verdict |", "|---:|---|---:|---|---|"]
    for (b, s), c in sorted(table.items()):
        mean = "—" if c.mean is None else f"{c.mean * scale:.4g} ± {c.std * scale:.2g}{unit}"
        seeds = ", ".join(f"{seed}: {_show(metric, x)}" for seed, x in c.values.items())
        if b == base_batch:
            word = "B0"
        elif s == "legw":
            word = {True: "holds", False: "does not hold"}.get(
                v["holds"][b], f"pending ({len(c.values)} of {len(v['base'].values)} seeds)")
        else:
            word = {True: "loses", False: "does not lose"}.get(v["loses"].get((b, s)), "—")
        lines.append(f"| {b} | {s} | {mean} | {seeds} | {word} |")
    rejected = {}
    for r in rows:
        if is_rejected(r):
            rejected.setdefault((r["batch_size"], r["scheme"]), []).append(str(r.get("seed", 0)))
    for (b, s), seeds in sorted(rejected.items()):
        lines.append(f"| {b} | {s} | — | {', '.join(seeds)}: rejected, not trained | — (see the "
                     f"error column) |")
    claim = {None: "not decided yet (a point is missing)", True: "supported",
             False: "not supported"}[v["supported"]]
    lines += ["", f"Central claim at the largest batch ({v['largest_batch']}): **{claim}**.", ""]
    return "\n".join(lines)
