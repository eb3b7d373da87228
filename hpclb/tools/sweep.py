"""`hpclb sweep`: batch-size sweeps of one recipe under several scaling schemes (You et al.,
SC '19, Tables 2-6: LEGW vs linear vs sqrt scaling with a fixed warmup, recipe tuned at B0 only).

Every point ``(B, scheme)`` trains the B0 recipe moved to global batch ``B`` by ``scheme`` and
nothing else (no re-tuning). Points run one after another: in this process for one rank, as an
``mpirun -n N ... hpclb train`` subprocess for ``N > 1``. Each point's run directory is
``<runs_dir>/<experiment>/<scheme>-b<B>``; results go to ``<out_dir>/<experiment>.json`` (a list of
rows), ``.md`` (tables) and ``.png`` (metric vs batch size per scheme; the LR curve of every point,
one panel per scheme), written by :mod:`hpclb.tools.sweep_report`. ``out_dir`` defaults to
``<runs_dir>/<experiment>``, beside the points' run directories (the committed tables in
``results/sweeps`` change only when asked for with ``out_dir``). Points of different budgets
(epochs, ranks, seed, optimizer) share the files but never a table.

Resumable: a point whose row is already in the JSON (same epochs, ranks, seed, optimizer) is
skipped; a point whose run finished but was not recorded is read from its ``summary.json``; a
point interrupted mid-run continues from its checkpoint (``--resume``), bit for bit.

Several sweep processes may work on one sweep at once (e.g. each started with the points in a
different order): a point being trained holds an exclusive ``flock`` on
``<runs_dir>/<experiment>/.<scheme>-b<B>.lock`` and the others skip it; the results JSON is
re-read and rewritten under ``<runs_dir>/<experiment>/.results.lock``. Locks die with their process.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from hpclb.comm.launcher import explain_launch_failure, mpirun_path, remove_stale_session_dirs
from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.config.outputs import check_run_dir, point_name
from hpclb.errors import ConfigError
from hpclb.schedules import SCHEMES
from hpclb.tasks.spec import metric_mode, primary_metric
from hpclb.tools.sweep_report import write_results
from hpclb.train.loop import train

__all__ = ["failed_points", "metric_of", "run_sweep"]


def metric_of(recipe: dict) -> tuple[str, str]:
    """(metric name, ``"max"`` or ``"min"``) that a sweep reports for ``recipe``: its
    :func:`~hpclb.tasks.spec.primary_metric` (``target.metric``; else a task's own first
    metric; else ``test_accuracy``) and its :func:`~hpclb.tasks.spec.metric_mode`."""
    name = primary_metric(recipe)
    return name, metric_mode(name, recipe)


@contextlib.contextmanager
def _flock(path: Path, *, block: bool = True):
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


def _load_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def _same_point(row: dict, batch: int, scheme: str, settings: dict) -> bool:
    return row.get("batch_size") == batch and row.get("scheme") == scheme and \
        all(row.get(k) == v for k, v in settings.items())


def _row(summary: dict, *, batch: int, scheme: str, metric: str, settings: dict,
         run_dir: Path) -> dict:
    value = summary.get(f"final_{metric}")
    best = summary.get(f"best_{metric}")
    return {"batch_size": batch, "scheme": scheme, "metric_name": metric,
            "metric": value if value is None or math.isfinite(value) else None,
            "best_metric": best, **settings,
            "wall_time_s": summary["wall_time_s"], "steps": summary["steps"],
            "steps_per_epoch": summary["steps_per_epoch"],
            "time_to_target_s": summary.get("time_to_target_s"), "target": summary.get("target"),
            "batch_ratio_k": summary["batch_ratio_k"], "base_lr": summary["base_lr"],
            "peak_lr": summary["peak_lr"], "warmup_steps": summary["warmup_steps"],
            "warmup_epochs": summary["warmup_epochs"], "decay": summary["decay"],
            "mean_samples_per_s": summary.get("mean_samples_per_s"),
            "run_dir": _shown(run_dir), "error": None, "note": None}


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it (the rows of a sweep
    are committed with a repository and must not name this machine's directories)."""
    rel = os.path.relpath(Path(path).resolve(), Path.cwd().resolve())
    return str(path) if rel.startswith("..") else rel


def _run_in_process(experiment: str, batch: int, scheme: str, settings: dict, run_dir: Path,
                    data_dir: str | None, resume: bool, quiet: bool) -> dict:
    cfg = resolve(experiment, batch_size=batch, scaling=scheme, optimizer=settings["optimizer"],
                  epochs=settings["epochs"], seed=settings["seed"], data_dir=data_dir,
                  out=str(run_dir), resume=resume)
    return train(cfg, SelfCommunicator(), quiet=quiet)


def _run_mpi(experiment: str, batch: int, scheme: str, settings: dict, run_dir: Path,
             data_dir: str | None, resume: bool, quiet: bool) -> dict:
    ranks = settings["ranks"]
    cmd = [mpirun_path(), "-n", str(ranks), "--bind-to", "none", sys.executable, "-m", "hpclb",
           "train", experiment, "--batch-size", str(batch), "--scaling", scheme,
           "--optimizer", settings["optimizer"], "--epochs", str(settings["epochs"]),
           "--seed", str(settings["seed"]), "--out", str(run_dir),
           "--expect-world-size", str(ranks)]
    if data_dir:
        cmd += ["--data-dir", str(data_dir)]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    remove_stale_session_dirs()  # a reused process id would stop mpirun at start-up
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, text=True,
                          stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE)
    if proc.returncode == 2:
        raise ConfigError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                          "hpclb train rejected the settings")
    if proc.returncode != 0:
        hint = explain_launch_failure(proc.stderr)
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}" + (f"\n{hint}" if hint else ""))
    return json.loads((run_dir / "summary.json").read_text())


def _checked(batch_sizes: Iterable[int], schemes: Iterable[str],
             ranks: int) -> tuple[list[int], list[str]]:
    """(sorted distinct batches, schemes without repeats); ConfigError for a bad argument."""
    batch_sizes = sorted(set(int(b) for b in batch_sizes))
    schemes = list(dict.fromkeys(schemes))
    for s in schemes:
        if s not in SCHEMES:
            raise ConfigError(f"--schemes: {s!r} is not one of {tuple(SCHEMES)}")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"--ranks: must be an integer >= 1 (MPI ranks per point; 1 runs in "
                          f"this process), got {ranks}")
    if not batch_sizes or any(b <= 0 or b % ranks for b in batch_sizes):
        raise ConfigError(f"--batch-sizes: every batch must be a positive multiple of --ranks "
                          f"{ranks}, got {batch_sizes}")
    return batch_sizes, schemes


@dataclass
class _Sweep:
    """One sweep's fixed settings, its files and locks, and how it trains a point."""

    experiment: str
    recipe: dict
    settings: dict
    out_dir: Path
    runs_dir: Path
    data_dir: str | None
    quiet: bool
    log: Callable[[str], Any]
    overwrite: bool = False

    def __post_init__(self) -> None:
        self.name = self.recipe["name"]
        self.metric, self.mode = metric_of(self.recipe)
        self.json_path = self.out_dir / f"{self.name}.json"
        self.results_lock = self.runs_dir / ".results.lock"
        self.runner = _run_in_process if self.settings["ranks"] == 1 else _run_mpi

    def rows(self) -> list[dict]:
        with _flock(self.results_lock):
            return _load_rows(self.json_path)

    def record(self, row: dict) -> None:
        """Replace the point's row in the results (under the results lock) and rewrite them."""
        with _flock(self.results_lock):
            current = [r for r in _load_rows(self.json_path)
                       if not _same_point(r, row["batch_size"], row["scheme"], self.settings)]
            write_results(current + [row], self.out_dir, self.name, self.metric, self.mode)

    def point(self, batch: int, scheme: str) -> None:
        """Record ``(batch, scheme)`` unless done: from its twin at k = 1, else by training it
        (unless another sweep process holds its lock)."""
        name, rows = self.name, self.rows()
        if any(_same_point(r, batch, scheme, self.settings) for r in rows):
            self.log(f"sweep {name}: B={batch} {scheme}: already recorded, skipped")
            return
        twin = next((r for r in rows if batch == self.recipe["base_batch_size"]
                     and not r.get("error") and _same_point(r, batch, r["scheme"], self.settings)),
                    None)
        if twin is not None:  # k = 1: every scheme gives the same schedule, the same run
            self.record({**twin, "scheme": scheme,
                         "note": f"k = 1: the same run as {twin['scheme']}"})
            self.log(f"sweep {name}: B={batch} {scheme}: k = 1, same run as {twin['scheme']}")
            return
        with _flock(self.runs_dir / f".{scheme}-b{batch}.lock", block=False) as mine:
            if not mine:
                self.log(f"sweep {name}: B={batch} {scheme}: being trained by another sweep "
                         f"process, skipped")
                return
            self._run_point(batch, scheme)

    def _finished_summary(self, run_dir: Path, batch: int, scheme: str) -> dict | None:
        """The summary.json of this very point's finished run, else None."""
        path = run_dir / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        st = self.settings
        if summary is not None and (summary.get("global_batch_size"), summary.get("scaling"),
                                    summary.get("epochs"), summary.get("world_size"),
                                    summary.get("seed"), summary.get("optimizer")) != \
                (batch, scheme, st["epochs"], st["ranks"], st["seed"], st["optimizer"]):
            return None  # a different run left it there: rerun from scratch
        return summary

    def _can_resume(self, run_dir: Path, batch: int, scheme: str) -> bool:
        """True when ``run_dir`` holds a checkpoint of this point; else it is emptied."""
        st = self.settings
        try:
            old = json.loads((run_dir / "config.json").read_text())
            mine = (old.get("global_batch_size"), old.get("scaling"), old.get("epochs"),
                    old.get("world_size"), old.get("seed")) == \
                (batch, scheme, st["epochs"], st["ranks"], st["seed"])
        except (OSError, ValueError):
            mine = False
        resume = mine and (run_dir / "checkpoint.pt").exists()
        if not resume and run_dir.exists():  # another run's directory: only when told
            check_run_dir(run_dir, resume=False, overwrite=self.overwrite or mine,
                          flag="--runs-dir point", resumable=False)
            shutil.rmtree(run_dir)
        return resume

    def _run_point(self, batch: int, scheme: str) -> None:
        """Train (or resume, or read back) one point while holding its lock; record its row."""
        name, metric, st = self.name, self.metric, self.settings
        run_dir = self.runs_dir / point_name(scheme, batch)
        summary = self._finished_summary(run_dir, batch, scheme)
        if summary is None:
            resume = self._can_resume(run_dir, batch, scheme)
            self.log(f"sweep {name}: B={batch} {scheme}: {'resuming' if resume else 'training'} "
                     f"({st['ranks']} rank(s), {st['epochs']:g} epochs) -> {run_dir}")
            t0 = time.perf_counter()
            try:
                summary = self.runner(self.experiment, batch, scheme, st, run_dir,
                                      self.data_dir, resume, self.quiet)
            except ConfigError as e:
                self.log(f"sweep {name}: B={batch} {scheme}: rejected: {e}")
                self.record({"batch_size": batch, "scheme": scheme, "metric_name": metric,
                             "metric": None, **st, "wall_time_s": 0.0, "steps": 0,
                             "time_to_target_s": None, "run_dir": str(run_dir),
                             "error": str(e)})
                return
            self.log(f"sweep {name}: B={batch} {scheme}: {metric} "
                     f"{summary.get('final_' + metric)} in {time.perf_counter() - t0:.0f} s")
        self.record(_row(summary, batch=batch, scheme=scheme, metric=metric, settings=st,
                         run_dir=run_dir))


def run_sweep(experiment: str, batch_sizes: Iterable[int], schemes: Iterable[str], *,
              epochs: float | None = None, ranks: int = 1, seed: int = 0,
              optimizer: str | None = None, data_dir: str | None = None,
              out_dir: str | Path | None = None, runs_dir: str | Path = "runs/sweeps",
              quiet: bool = True, log=print, overwrite: bool = False) -> list[dict]:
    """Run every ``(batch size, scheme)`` point not yet recorded; returns the rows of this
    sweep's budget (its epochs, ranks, seed and optimizer; other budgets' rows stay in the files).

    Args: ``experiment`` (packaged name or recipe path), ``batch_sizes`` (global batches in
    samples, each divisible by ``ranks``), ``schemes`` (subset of legw/linear/sqrt/none),
    ``epochs`` (default the recipe's, the same for every point), ``ranks`` (MPI ranks per point),
    ``out_dir`` (default ``<runs_dir>/<recipe name>``).
    A point the schedule rejects (e.g. a warmup longer than training) is recorded with its
    ``error`` and no metric (:func:`failed_points` lists them). Raises ConfigError for bad
    arguments before any training, and RuntimeError when a point crashes (its row is not
    written; rerun to retry it). A point
    directory holding a run of other settings (another budget, seed or rank count) is
    deleted only with ``overwrite``; otherwise ConfigError names ``--overwrite``.
    """
    recipe = load_recipe(experiment, epochs=epochs)
    batch_sizes, schemes = _checked(batch_sizes, schemes, ranks)
    probe = resolve(experiment, optimizer=optimizer, epochs=epochs, seed=seed)  # validates
    settings = {"epochs": probe.epochs, "ranks": ranks, "seed": seed,
                "optimizer": probe.optimizer}
    out_dir = Path(runs_dir) / recipe["name"] if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = _Sweep(experiment, recipe, settings, out_dir, Path(runs_dir) / recipe["name"],
                   data_dir, quiet, log, overwrite)
    for batch in batch_sizes:
        for scheme in schemes:
            sweep.point(batch, scheme)
    with _flock(sweep.results_lock):
        rows = _load_rows(sweep.json_path)
        if rows:
            write_results(rows, out_dir, sweep.name, sweep.metric, sweep.mode)
    return [r for r in rows if all(r.get(k) == v for k, v in settings.items())]


def failed_points(rows: list[dict], batch_sizes: Iterable[int],
                  schemes: Iterable[str]) -> list[str]:
    """``"B=<batch> <scheme>: <error>"`` for each of the asked-for points in ``rows`` (as
    :func:`run_sweep` returns them) that was rejected."""
    asked = {(int(b), s) for b in batch_sizes for s in schemes}
    return [f"B={r['batch_size']} {r['scheme']}: {r['error']}" for r in rows
            if r.get("error") and (r["batch_size"], r["scheme"]) in asked]
