"""``hpclb plot schedule|runs|sweep``: PNGs of LR schedules, finished runs and batch sweeps.

- :func:`plot_schedule`: the LEGW picture. For each scaling scheme of :mod:`hpclb.schedules`
  (one column each) and each ``k = B / B0``, the LR of every step against epochs (top row) and
  against steps (bottom row, log x): under LEGW the warmup stretches ``k``-fold in epochs and
  stays the same number of steps, the peak grows ``sqrt(k)``-fold. Default output
  ``results/schedules/<experiment>.png``.
- :func:`plot_runs`: loss, metric, LR and LARS/LAMB trust ratios (min-median-max) of one or
  several run directories against epochs, shared x axes, from their ``metrics.jsonl`` (per-step
  lines where there are some, else the per-epoch rows). Written into the run directory (one
  run) or beside the run directories (several).
- :func:`plot_sweep`: a sweep's ``<experiment>.json`` (``hpclb sweep``) drawn by
  :func:`hpclb.tools.sweep_report.plot` (metric against batch size per scheme with B0 marked, and
  the LR of every point), written beside the JSON.

Every figure is drawn with matplotlib's Agg backend (no display needed) and written atomically.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from hpclb._io import read_json
from hpclb.config import load_recipe, resolve
from hpclb.config.outputs import check_output_file
from hpclb.errors import ConfigError, JobError
from hpclb.schedules import SCHEMES, Schedule
from hpclb.tools import sweep_report
from hpclb.tools.figures import pyplot, save
from hpclb.tools.jobs import train_set_size
from hpclb.tools.runrows import RunRows, Warn, metrics_path, points, read_run
from hpclb.train.metrics import finite

__all__ = ["Curve", "sample_steps", "num_train_samples", "schedule_curves", "plot_schedule",
           "plot_runs", "plot_sweep"]


@dataclass(frozen=True)
class Curve:
    """The LR of one ``(scheme, k)`` at the sampled ``steps`` (0-based global steps)."""

    scheme: str
    k: float
    batch: int
    schedule: Schedule
    steps: list[int]

    @property
    def epochs(self) -> list[float]:
        return [s / self.schedule.steps_per_epoch for s in self.steps]

    @property
    def lr(self) -> list[float]:
        return [self.schedule.lr(s) for s in self.steps]

    @property
    def label(self) -> str:
        return f"k={self.k:g} (B={self.batch})"


def sample_steps(sched: Schedule, points: int = 300) -> list[int]:
    """Steps to draw: evenly spaced, log-spaced (for the log-x panel) and both ends of warmup."""
    t = sched.total_steps
    even = {round(i * (t - 1) / (points - 1)) for i in range(points)}
    geo = {round(math.exp(i * math.log(t) / (points - 1))) - 1 for i in range(points)}
    ends = {sched.warmup_steps - 1, sched.warmup_steps} if sched.warmup_steps else set()
    return sorted(s for s in even | geo | ends if 0 <= s < t)


def num_train_samples(recipe: dict, num_samples: int | None = None) -> int:
    """Training-set size of a recipe without reading the data: ``num_samples`` if given, else
    :func:`hpclb.tools.jobs.train_set_size` (published sizes, ``data.train_samples`` subsets).
    ConfigError naming ``--num-samples`` for a data set that table does not know."""
    if num_samples is not None:
        if not (isinstance(num_samples, int) and num_samples > 0):
            raise ConfigError(f"--num-samples must be a positive integer, got {num_samples!r}")
        return num_samples
    try:
        return train_set_size(recipe)[0]
    except JobError as e:
        raise ConfigError(f"{e}; or pass --num-samples N (the training-set size)") from e


def schedule_curves(experiment: str, ks: Sequence[float], schemes: Iterable[str] = SCHEMES, *,
                    num_samples: int | None = None, epochs: float | None = None,
                    optimizer: str | None = None) -> tuple[list[Curve], list[str]]:
    """(curves, skipped): the schedule ``hpclb train EXPERIMENT --batch-size B0*k --scaling S``
    would run for every scheme and ``k`` (``B0*k`` rounded to a whole batch); ``skipped`` says
    why a pair could not run (e.g. LEGW's warmup longer than training). ConfigError for a bad
    recipe, ``k <= 0`` or an unknown scheme."""
    recipe = load_recipe(experiment)
    n = num_train_samples(recipe, num_samples)
    b0 = int(recipe["base_batch_size"])
    curves, skipped = [], []
    for scheme in schemes:
        if scheme not in SCHEMES:
            raise ConfigError(f"--schemes: {scheme!r} is not one of {tuple(SCHEMES)}")
        for k in ks:
            if not (isinstance(k, (int, float)) and math.isfinite(k) and k > 0):
                raise ConfigError(f"--k: batch ratios must be positive numbers, got {k!r}")
            batch = max(1, round(b0 * k))
            try:
                cfg = resolve(experiment, batch_size=batch, scaling=scheme, epochs=epochs,
                              optimizer=optimizer)
                sched = cfg.schedule(n)
            except ConfigError as e:
                skipped.append(f"{scheme} k={k:g} (B={batch}): {e}")
                continue
            curves.append(Curve(scheme, batch / b0, batch, sched, sample_steps(sched)))
    return curves, skipped


def plot_schedule(experiment: str, ks: Sequence[float], out: str | Path | None = None, *,
                  schemes: Iterable[str] = SCHEMES, num_samples: int | None = None,
                  epochs: float | None = None, optimizer: str | None = None,
                  overwrite: bool = True):
    """Draw :func:`schedule_curves` (columns: schemes; rows: LR vs epoch, LR vs step) to ``out``
    (default ``results/schedules/<recipe name>.png``). Returns ``(path, figure, skipped)``; the
    figure is closed but keeps its data (each line's label is :attr:`Curve.label`). With
    ``overwrite`` False an existing PNG at the path is a ConfigError (``hpclb plot``'s
    default; likewise in :func:`plot_runs` and :func:`plot_sweep`)."""
    plt = pyplot("hpclb plot")
    curves, skipped = schedule_curves(experiment, ks, schemes, num_samples=num_samples,
                                      epochs=epochs, optimizer=optimizer)
    if not curves:
        raise ConfigError("no schedule to draw: " + "; ".join(skipped))
    name = load_recipe(experiment)["name"]
    cols = [s for s in SCHEMES if any(c.scheme == s for c in curves)]
    fig, axes = plt.subplots(2, len(cols), figsize=(4.2 * len(cols), 6.4), squeeze=False)
    for j, scheme in enumerate(cols):
        top, bottom = axes[0][j], axes[1][j]
        for c in (c for c in curves if c.scheme == scheme):
            lr = c.lr
            top.plot(c.epochs, lr, label=c.label)
            bottom.plot([s + 1 for s in c.steps], lr, label=c.label)
        top.set_title(f"{name}: {scheme}")
        top.set_xlabel("epoch")
        bottom.set_xlabel("step (update number, log scale)")
        bottom.set_xscale("log")
        for ax in (top, bottom):
            ax.set_ylabel("learning rate")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) if out else Path("results/schedules") / f"{name}.png"
    return save(fig, check_output_file(path, overwrite=overwrite)), fig, skipped


def _run_info(run: Path, warn) -> dict:
    """config.json + summary.json of a run (either may be missing or unreadable: left out, an
    unreadable one with a warning)."""
    info = {}
    for name in ("config.json", "summary.json"):
        p = run / name
        if p.is_file():
            try:
                info[name] = read_json(p, f"a run's {name}")
            except ValueError as e:
                warn(f"{e}; its settings are not used")
    return info


def _steps_per_epoch(info: dict, epoch_rows: list[dict]) -> float | None:
    spe = info.get("summary.json", {}).get("steps_per_epoch")
    if finite(spe) and spe > 0:
        return float(spe)
    full = [r for r in epoch_rows if finite(r.get("step")) and finite(r.get("epoch"))
            and r["epoch"] > 0]
    return full[0]["step"] / full[0]["epoch"] if full else None


def _declared_metric(info: dict) -> str | None:
    """The recipe's target metric (config.json), else the summary's ``metric_name`` (a sweep
    point keeps only summary.json); None when the run declares neither."""
    target = ((info.get("config.json", {}).get("recipe") or {}).get("target") or {})
    return target.get("metric") or info.get("summary.json", {}).get("metric_name")


def _metric_of(info: dict, epoch_rows: list[dict], shared: str | None = None) -> str | None:
    """The run's declared metric, else ``shared`` (the one the other runs on the axes declare:
    a diverged sweep point has no summary), else the first ``test_``/``valid_`` key."""
    keys = [k for r in epoch_rows for k in r if k.startswith(("test_", "valid_"))]
    for name in (_declared_metric(info), shared):
        if name in keys:
            return name
    return keys[0] if keys else None


def _label(run: Path, info: dict) -> str:
    cfg = info.get("config.json", {})
    if cfg.get("global_batch_size"):
        return f"{run.name} (B={cfg['global_batch_size']}, {cfg.get('scaling', '?')})"
    return run.name


def _warn_missing_steps(rows: RunRows, info: dict) -> None:
    """Say what a run without per-step lines (or without trust ratios in them) loses."""
    cfg = info.get("config.json", {})
    layerwise = cfg.get("optimizer") in ("lars", "lamb")
    if not rows.steps:
        rows.warn(f"{rows.path}: no per-step lines (the run took fewer optimizer steps than "
                  f"log_every = {cfg.get('log_every', '?')}, or was trained with --log-every 0): "
                  f"loss and LR are drawn at epoch ends only, the LR as markers (its value "
                  f"between epoch ends is not logged)"
                  + ("; no trust ratios (they are in step lines only)" if layerwise else ""))
    elif layerwise and not any("trust_median" in r for r in rows.steps):
        rows.warn(f"{rows.path}: a {cfg['optimizer']} run whose step lines hold no trust "
                  f"ratios; the trust-ratio panel has no line for it")


def _draw_run(axes, i: int, run: Path, warn, shared: str | None = None
              ) -> tuple[str | None, bool]:
    """One run's lines (colour ``C<i>``) on the four panels of :func:`plot_runs`; returns
    (its metric, whether it logged trust ratios)."""
    ax_loss, ax_metric, ax_lr, ax_trust = axes
    rows = read_run(run, warn)
    info = _run_info(run, rows.warn)
    spe = _steps_per_epoch(info, rows.epochs)
    color, label = f"C{i % 10}", _label(run, info)
    by_step = lambda r: r["step"] / spe if spe and finite(r.get("step")) else None  # noqa: E731
    by_epoch = lambda r: r["epoch"] if finite(r.get("epoch")) else None  # noqa: E731
    _warn_missing_steps(rows, info)
    # Per-step lines where they are at least as dense as the epoch rows; else the epoch rows
    # (a large-batch run logs a step line every log_every steps: 3 lines over 20 epochs would
    # draw a straight line through 6 epochs of loss and LR that nobody logged)
    x, y = points(rows, rows.steps, "loss", by_step)
    ex, ey = points(rows, rows.epochs, "train_loss", by_epoch)
    if x and len(x) >= len(ex):
        ax_loss.plot(x, y, color=color, lw=0.8, label=label)
    else:
        if x:
            rows.warn(f"{rows.path}: {len(x)} per-step lines against {len(ex)} epoch rows: "
                      f"loss and LR are drawn at epoch ends")
        ax_loss.plot(ex, ey, color=color, marker="o", label=label)
    metric = _metric_of(info, rows.epochs, shared)
    if metric:
        ax_metric.plot(*points(rows, rows.epochs, metric, by_epoch), color=color, marker="o",
                       label=label)
    x, y = points(rows, rows.steps, "lr", by_step)
    ex, ey = points(rows, rows.epochs, "lr", by_epoch)
    if x and len(x) >= len(ex):
        ax_lr.plot(x, y, color=color, label=label)
    else:  # known at epoch ends only: markers, no line claiming the LR in between
        ax_lr.plot(ex, ey, color=color, marker="o", linestyle="none", label=label)
    x, med = points(rows, rows.steps, "trust_median", by_step)
    if x:
        ax_trust.plot(x, med, color=color, lw=0.8, label=label)
        lo = points(rows, rows.steps, "trust_min", by_step)
        hi = points(rows, rows.steps, "trust_max", by_step)
        if lo[0] == x and hi[0] == x:
            ax_trust.fill_between(x, lo[1], hi[1], color=color, alpha=0.2, lw=0)
    return metric, bool(x)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None,
              warn: Warn | None = None, *, overwrite: bool = True):
    """Four panels against epochs, one line (colour) per run: training loss (per-step ``loss``
    if logged, else the epoch rows' ``train_loss``), the recipe's target metric (else the first
    ``test_``/``valid_`` key), LR, and trust ratios (median line, min-max band). Default ``out``:
    ``RUN/plot.png`` for one run, ``<parent>/plot-<run>+<run>....png`` beside several. Returns
    ``(path, figure)``. Every line or value left out (a torn line, NaN, a run without step lines)
    goes to ``warn`` naming the file and line (:mod:`hpclb.tools.runrows`). ConfigError naming
    a directory that does not exist or holds no metrics.jsonl."""
    plt = pyplot("hpclb plot")
    runs = [Path(r) for r in run_dirs]
    if not runs:
        raise ConfigError("plot runs: give at least one run directory")
    for run in runs:  # before drawing: a missing one is named, nothing half drawn
        metrics_path(run)
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8), sharex=True)
    declared = [_declared_metric(_run_info(run, lambda _: None)) for run in runs]
    shared = next((m for m in declared if m), None)  # one metric on the shared panel
    drawn = [_draw_run(axes, i, run, warn, shared) for i, run in enumerate(runs)]
    metrics = {m for m, _ in drawn if m}
    ax_loss, ax_metric, ax_lr, ax_trust = axes
    ax_loss.set_ylabel("training loss")
    ax_metric.set_ylabel(" / ".join(sorted(metrics)) or "no test metric")
    ax_lr.set_ylabel("learning rate")
    ax_trust.set_ylabel("trust ratio (median, min-max)")
    for ax in (ax_loss, ax_lr):  # a loss that blew up 100x, or LRs k apart: log scale
        ys = [v for line in ax.get_lines() for v in line.get_ydata() if finite(v)]
        if ys and min(ys) > 0 and max(ys) > 100 * min(ys):
            ax.set_yscale("log")
    if not any(t for _, t in drawn):
        ax_trust.text(0.5, 0.5, "no trust ratios logged\n(LARS/LAMB runs with per-step lines)",
                      ha="center", va="center", transform=ax_trust.transAxes, fontsize=8)
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    if out is None:
        out = runs[0] / "plot.png" if len(runs) == 1 else \
            runs[0].parent / f"plot-{'+'.join(r.name for r in runs)[:150]}.png"
    return save(fig, check_output_file(out, overwrite=overwrite)), fig


def plot_sweep(sweep_json: str | Path, out: str | Path | None = None, *,
               overwrite: bool = True):
    """Redraw a sweep's results (``results/sweeps/<experiment>.json``) with
    :func:`hpclb.tools.sweep_report.plot` to ``out`` (default: the JSON's path with ``.png``);
    returns ``(path, figure)``. ConfigError when the file is missing, not a sweep's JSON or has
    no rows."""
    path = Path(sweep_json)
    if not path.is_file():
        raise ConfigError(f"{path}: no such sweep file (hpclb sweep writes "
                          f"results/sweeps/<experiment>.json)")
    try:
        rows = read_json(path, "sweep results")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (isinstance(rows, list) and rows and all(isinstance(r, dict) and
                                                    "batch_size" in r for r in rows)):
        raise ConfigError(f"{path}: not the rows of an `hpclb sweep` (a non-empty JSON list of "
                          f"points with batch_size, scheme, metric)")
    out = check_output_file(Path(out) if out else path.with_suffix(".png"), overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, sweep_report.plot(rows, out, path.stem, rows[0]["metric_name"])
