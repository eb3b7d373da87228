"""`hpclb sweep`: batch-size sweeps of one recipe under several scaling schemes and seeds (You et
al., SC '19: LEGW vs linear vs sqrt scaling with a fixed warmup, recipe tuned at B0 only).

Every point ``(B, scheme, seed)`` trains the B0 recipe moved to global batch ``B`` by ``scheme``
and nothing else (no re-tuning). Points run one after another: in this process for one rank, as
an ``mpirun -n N ... hpclb train`` subprocess for ``N > 1``; or as ONE job array of SLURM or
PBS, a task per point (:func:`submit_sweep`, :mod:`hpclb.tools.sweep_jobs`). A point's identity
is its batch, scheme, seed, optimizer, epochs, ranks and micro-batches; its run directory is
``<runs_dir>/<experiment>/<optimizer>-<scheme>-b<B>[-a<K>][-e<epochs>][-r<ranks>]-s<seed>``
(:attr:`~hpclb.tools.sweep_points.Point.dir_name`: each part that differs from the default).
Results go to ``<out_dir>/<experiment>.json`` (a list of rows), ``.md`` (tables) and ``.png``
(:mod:`hpclb.tools.sweep_report`), and each finished point's ``summary.json`` and per-epoch
``metrics.jsonl`` to ``<out_dir>/points/<point>/``, as soon as it ends. ``out_dir`` defaults to
``<runs_dir>/<experiment>`` (the committed tables in ``results/sweeps`` change only when asked
for with ``out_dir``).

Across interruptions: a point whose row is already in the JSON is skipped; a point whose run
finished but was not recorded is read from its ``summary.json``; a point interrupted mid-run
continues from its checkpoint (``--resume``), bit for bit. A point that diverges (exit 3) is
recorded as failed, with the step it diverged at, and the sweep goes on.

Several sweep processes may work on one sweep at once: a point being trained holds an exclusive
``flock`` on ``<runs_dir>/<experiment>/.<point>.lock`` and the others skip it (and count it as
running); the results JSON is re-read and rewritten under ``<runs_dir>/<experiment>/.results.lock``.
Locks die with their process.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from hpclb._io import write_text_atomic
from hpclb.comm.device import select_device
from hpclb.comm.launcher import (
    FORWARD_GRACE_S,
    explain_launch_failure,
    mpirun_path,
    run_forwarding_signals,
)
from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.config.outputs import check_run_dir, clear_run, refuse_foreign
from hpclb.errors import (
    PREEMPTED_EXIT_CODE,
    ConfigError,
    DataError,
    Diverged,
    NonFiniteError,
    Preempted,
)
from hpclb.schedules import SCHEMES
from hpclb.tasks.spec import metric_mode, primary_metric
from hpclb.tools.figures import pyplot
from hpclb.tools.jobs_spec import JobSpec
from hpclb.tools.sweep_jobs import array_status, submit_array, sweep_argv, task_indices, task_points
from hpclb.tools.sweep_points import Point, SweepStatus, flock, is_rejected, row_of, shown
from hpclb.tools.sweep_records import Settings, check_outputs, load_rows, refuse_stale
from hpclb.tools.sweep_report import write_results
from hpclb.train.loop import train

__all__ = ["failed_points", "metric_of", "run_sweep", "submit_sweep", "sweep_status"]


def metric_of(recipe: dict) -> tuple[str, str]:
    """(metric name, ``"max"`` or ``"min"``) that a sweep reports for ``recipe``: its
    :func:`~hpclb.tasks.spec.primary_metric` (``target.metric``; else a task's own first
    metric; else ``test_accuracy``) and its :func:`~hpclb.tasks.spec.metric_mode`."""
    name = primary_metric(recipe)
    return name, metric_mode(name, recipe)


# Each rank starts with the preemption signals blocked; `hpclb train` unblocks them once its
# handler is in (a USR2 passed on by the sweep before that stays pending instead of killing it).
_BLOCKED = ("env", "--block-signal=USR2", "--block-signal=TERM")


def _run_in_process(experiment: str, p: Point, run_dir: Path, data_dir: str | None,
                    resume: bool, quiet: bool) -> dict:
    cfg = resolve(experiment, batch_size=p.batch, scaling=p.scheme, optimizer=p.optimizer,
                  epochs=p.epochs, seed=p.seed, data_dir=data_dir, out=str(run_dir),
                  resume=resume, accumulation_steps=p.accumulation)
    try:
        return train(cfg, SelfCommunicator(), quiet=quiet)
    except NonFiniteError as e:
        raise Diverged(str(e), e.step) from e


def _run_mpi(experiment: str, p: Point, run_dir: Path, data_dir: str | None, resume: bool,
             quiet: bool) -> dict:
    """One point as ``mpirun -n RANKS ... hpclb train``; its summary. A USR2, TERM or INT sent
    to the sweep meanwhile reaches the ranks through mpirun (as USR2: they checkpoint at their
    next step), and the sweep stops with Preempted (``"interrupted"`` for a Ctrl-C) however the
    point ended, unless it was rejected or diverged; the ranks start with USR2/TERM blocked
    until their handlers are in (``env --block-signal``, as in the job templates)."""
    cmd = [mpirun_path(), "-n", str(p.ranks), "--bind-to", "none", *_BLOCKED, sys.executable,
           "-m", "hpclb", "train", experiment, "--batch-size", str(p.batch), "--scaling",
           p.scheme, "--optimizer", p.optimizer, "--epochs", str(p.epochs), "--seed",
           str(p.seed), "--out", str(run_dir), "--expect-world-size", str(p.ranks),
           "--accumulation-steps", str(p.accumulation)]
    if data_dir:
        cmd += ["--data-dir", str(data_dir)]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // p.ranks)))
    done = run_forwarding_signals(cmd, env=env, stdout=subprocess.DEVNULL if quiet else None)
    err = done.stderr.strip()
    if done.returncode == 2:
        raise ConfigError(err.splitlines()[-1] if err else "hpclb train rejected the settings")
    if done.returncode == 3:
        step = re.findall(r"(?:global|optimizer) step (\d+)", err)
        raise Diverged(err.splitlines()[-1] if err else "diverged (exit 3)",
                       int(step[-1]) if step else None)
    if done.signal is not None or done.returncode == PREEMPTED_EXIT_CODE:
        # the point checkpointed (or keeps its last checkpoint when stopped): the sweep stops
        if done.forced:
            print(f"hpclb sweep: mpirun did not end within {FORWARD_GRACE_S:g} s of the signal "
                  f"(or a second Ctrl-C came): stopped with its ranks; the point keeps its "
                  f"last checkpoint", file=sys.stderr, flush=True)
        # the step its ranks checkpointed (stderr: "preempted after step S"), or None: stopped
        # before training began or forced, so no new checkpoint
        saved = re.findall(r"preempted after step (\d+)", err) if not done.forced else []
        step = int(saved[-1]) if saved else None
        raise Preempted(step, "interrupted") if done.signal == signal.SIGINT else Preempted(step)
    if done.returncode != 0:
        hint = explain_launch_failure(done.stderr)
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: "
                           f"{err[-2000:]}" + (f"\n{hint}" if hint else ""))
    return json.loads((run_dir / "summary.json").read_text())


def _checked(batch_sizes: Iterable[int], schemes: Iterable[str], ranks: int,
             seeds: Iterable[int]) -> tuple[list[int], list[str], list[int]]:
    """(sorted distinct batches, schemes, seeds without repeats); ConfigError for a bad
    argument."""
    batch_sizes = sorted(set(int(b) for b in batch_sizes))
    schemes = list(dict.fromkeys(schemes))
    seeds = list(dict.fromkeys(seeds))
    if not schemes:
        raise ConfigError(f"--schemes: give at least one of {tuple(SCHEMES)}")
    for s in schemes:
        if s not in SCHEMES:
            raise ConfigError(f"--schemes: {s!r} is not one of {tuple(SCHEMES)}")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"--ranks: must be an integer >= 1 (MPI ranks per point; 1 runs in "
                          f"this process), got {ranks}")
    if not batch_sizes or any(b <= 0 or b % ranks for b in batch_sizes):
        raise ConfigError(f"--batch-sizes: every batch must be a positive multiple of --ranks "
                          f"{ranks}, got {batch_sizes}")
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ConfigError(f"--seeds: expected integers >= 0, got {seeds}")
    return batch_sizes, schemes, seeds


@dataclass
class _Sweep:
    """One sweep's fixed settings, its files and locks, and how it trains a point."""

    experiment: str
    recipe: dict
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
        self.settings = Settings(self.recipe, lambda p: resolve(
            self.experiment, batch_size=p.batch, scaling=p.scheme, optimizer=p.optimizer,
            epochs=p.epochs, seed=p.seed, accumulation_steps=p.accumulation,
            data_dir=self.data_dir))

    def check(self, points: list[Point]) -> None:
        """Before any point trains: the files under ``out_dir`` are the sweep's own
        (:func:`~hpclb.tools.sweep_records.check_outputs`), and each recorded point and run
        directory of ``points`` is of the settings now; else ConfigError naming them and the
        fixes (unless ``overwrite``: they are replaced)."""
        check_outputs(self.out_dir, self.name, [p.dir_name for p in points], self.overwrite)
        rows, stale = self.rows(), {}
        for p in points:
            row = next((r for r in rows if Point.of_row(r) == p), None)
            found = self.settings.stale(p, row) if row is not None else \
                self.settings.stale_run(p, self.runs_dir / p.dir_name)
            if found:
                stale[str(p)] = found
        if not self.overwrite:
            refuse_stale(stale, self.name)

    def done(self, p: Point, row: dict) -> bool:
        """Whether ``row`` records ``p`` under the settings now."""
        return Point.of_row(row) == p and not self.settings.stale(p, row)

    def rows(self) -> list[dict]:
        """The recorded rows, read under the results lock; without a runs directory (no sweep
        process has run here: ``--status`` on committed results) read as they are, creating
        nothing."""
        if not self.runs_dir.is_dir():
            return load_rows(self.json_path)
        with flock(self.results_lock):
            return load_rows(self.json_path)

    def record(self, row: dict, run_dir: Path | None = None) -> None:
        """Copy the point's summary and metrics under ``out_dir/points`` (when it has a run
        directory), then replace its row in the results (under the results lock)."""
        p = replace(Point.of_row(row), default_epochs=self.recipe["epochs"])
        if run_dir is not None:
            dest = self.out_dir / "points" / p.dir_name
            dest.mkdir(parents=True, exist_ok=True)
            for name in ("summary.json", "metrics.jsonl"):  # config.json names local paths
                if (run_dir / name).exists():
                    write_text_atomic(dest / name, (run_dir / name).read_text())
            row = {**row, "points_dir": shown(dest)}
        with flock(self.results_lock):
            current = [r for r in load_rows(self.json_path) if Point.of_row(r) != p]
            write_results(current + [row], self.out_dir, self.name, self.metric, self.mode,
                          self.recipe["base_batch_size"])

    def point(self, p: Point) -> None:
        """Record ``p`` unless done: from its twin at k = 1, else by training it (unless
        another sweep process holds its lock)."""
        rows = self.rows()
        if any(self.done(p, r) for r in rows):
            self.log(f"sweep {self.name}: {p}: already recorded, skipped")
            return
        twin = next((r for r in rows if p.batch == self.recipe["base_batch_size"]
                     and r.get("status", "done") in ("done", "diverged")
                     and self.done(p.with_scheme(r["scheme"]), r)), None)
        if twin is not None:  # k = 1: every scheme starts from the same B0 recipe
            self.record({**twin, "scheme": p.scheme,
                         "note": f"k = 1: the B0 recipe, the run of {twin['scheme']}"})
            self.log(f"sweep {self.name}: {p}: k = 1, the B0 recipe's run ({twin['scheme']})")
            return
        with flock(self.runs_dir / f".{p.dir_name}.lock", block=False) as mine:
            if not mine:
                self.log(f"sweep {self.name}: {p}: being trained by another sweep process, "
                         f"skipped")
                return
            self._run_point(p)

    def reject_early(self, points: list[Point]) -> None:
        """Record at once, as rejected, each point of ``points`` above B0 and not yet recorded
        whose settings or LR schedule are refused (a warmup not shorter than training, a batch
        over the training set, ...): the sweep says so before it trains any point, not when it
        reaches that one. A B0 point is left to its turn (at k = 1 it takes another scheme's
        run)."""
        rows = self.rows()
        for p in points:
            if p.batch == self.recipe["base_batch_size"] or any(self.done(p, r) for r in rows):
                continue
            try:
                cfg = self.settings.resolve(p)
                cfg.schedule(self.settings.train_samples(cfg))
            except ConfigError as e:
                self.log(f"sweep {self.name}: {p}: rejected: {e}")
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self.record({**p.failed_row(self.metric, e, self.runs_dir / p.dir_name, 0.0,
                                            None), "recipe": self.settings.fields(p.optimizer)})

    def _finished_summary(self, run_dir: Path, p: Point) -> dict | None:
        """The summary.json of this very point's finished run, else None."""
        path = run_dir / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        if summary is not None and (Point.of_summary(summary) != p or
                                    self.settings.stale_run(p, run_dir)):
            return None  # a different run left it there: rerun from scratch
        return summary

    def _can_resume(self, run_dir: Path, p: Point) -> bool:
        """True when ``run_dir`` holds a checkpoint of this point; else it is emptied."""
        try:
            mine = Point.of_summary(json.loads((run_dir / "config.json").read_text())) == p
        except (OSError, ValueError, KeyError):
            mine = False
        mine = mine and not self.settings.stale_run(p, run_dir)
        resume = mine and (run_dir / "checkpoint.pt").exists()
        if not resume and run_dir.exists():  # another run's directory: only when told
            check_run_dir(run_dir, resume=False, overwrite=self.overwrite or mine,
                          flag="--runs-dir point", resumable=False)
            clear_run(run_dir, "--runs-dir point")  # hpclb's files only
        return resume

    def _run_point(self, p: Point) -> None:
        """Train (or resume, or read back) one point while holding its lock; record its row."""
        run_dir = self.runs_dir / p.dir_name
        refuse_foreign(run_dir, "--runs-dir point")  # another tool's files: never read or deleted
        summary = self._finished_summary(run_dir, p)
        if summary is None:
            resume = self._can_resume(run_dir, p)
            self.log(f"sweep {self.name}: {p}: {'resuming' if resume else 'training'} "
                     f"({p.ranks} rank(s), {p.epochs:g} epochs) -> {run_dir}")
            runner = _run_in_process if p.ranks == 1 else _run_mpi
            t0 = time.perf_counter()
            try:
                summary = runner(self.experiment, p, run_dir, self.data_dir, resume, self.quiet)
            except (ConfigError, Diverged) as e:
                diverged = isinstance(e, Diverged)
                self.log(f"sweep {self.name}: {p}: {'diverged' if diverged else 'rejected'}: {e}")
                self.record({**p.failed_row(self.metric, e, run_dir, time.perf_counter() - t0,
                                            getattr(e, "step", None) if diverged else None),
                             "recipe": self.settings.fields(p.optimizer)},
                            run_dir if diverged else None)
                return
            self.log(f"sweep {self.name}: {p}: {self.metric} "
                     f"{summary.get('final_' + self.metric)} in {time.perf_counter() - t0:.0f} s")
        self.record({**row_of(summary, p, metric=self.metric, run_dir=run_dir),
                     "recipe": self.settings.fields(p.optimizer)}, run_dir)


def _accumulation(batch: int, ranks: int, micro_batch: int) -> int:
    """Micro-batches per step on each rank so that one is ``micro_batch`` samples; ConfigError
    when it does not divide."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1 \
            or batch % (ranks * micro_batch):
        raise ConfigError(f"--micro-batch {micro_batch}: every batch must be a multiple of "
                          f"--ranks {ranks} x --micro-batch (got batch {batch}); choose a "
                          f"micro-batch that divides batch / ranks")
    return batch // (ranks * micro_batch)


def _prepare(experiment: str, *, epochs, ranks, optimizer, seeds, out_dir, runs_dir, data_dir,
             quiet, log, overwrite, batch_sizes, schemes,
             micro_batch=None) -> tuple[_Sweep, list[Point]]:
    """The sweep and its points in run order (batch, then seed, then scheme); ConfigError for
    bad arguments, before anything is written."""
    recipe = load_recipe(experiment, epochs=epochs)
    batch_sizes, schemes, seeds = _checked(batch_sizes, schemes, ranks, seeds)
    probe = resolve(experiment, optimizer=optimizer, epochs=epochs, seed=seeds[0])  # validates
    out_dir = Path(runs_dir) / recipe["name"] if out_dir is None else Path(out_dir)
    sweep = _Sweep(experiment, recipe, out_dir, Path(runs_dir) / recipe["name"], data_dir,
                   quiet, log, overwrite)
    points = [Point(b, s, seed, probe.optimizer, probe.epochs, ranks,
                    _accumulation(b, ranks, micro_batch) if micro_batch is not None
                    else probe.accumulation_steps,  # the recipe's without --micro-batch
                    default_epochs=recipe["epochs"])
              for b in batch_sizes for seed in seeds for s in schemes]
    return sweep, points


def sweep_status(experiment: str, batch_sizes: Iterable[int], schemes: Iterable[str], *,
                 seeds: Iterable[int] = (0,), epochs: float | None = None, ranks: int = 1,
                 optimizer: str | None = None, out_dir: str | Path | None = None,
                 runs_dir: str | Path = "runs/sweeps", micro_batch: int | None = None,
                 data_dir: str | None = None) -> SweepStatus:
    """What a sweep has done, what other processes are training and what is left, with the
    hours expected (:class:`~hpclb.tools.sweep_points.SweepStatus`); trains nothing."""
    sweep, points = _prepare(experiment, epochs=epochs, ranks=ranks, optimizer=optimizer,
                             seeds=seeds, out_dir=out_dir, runs_dir=runs_dir, data_dir=data_dir,
                             quiet=True, log=print, overwrite=False, batch_sizes=batch_sizes,
                             schemes=schemes, micro_batch=micro_batch)
    status = SweepStatus.of(points, sweep.rows(), sweep.runs_dir,
                            base_batch=sweep.recipe["base_batch_size"], current=sweep.done)
    status.array = array_status(sweep.runs_dir)
    return status


def _check_device(experiment: str, epochs: float | None, ranks: int) -> None:
    """The recipe's device can be had here for ``ranks`` ranks (one GPU each, unless
    ``$HPCLB_SHARE_GPU`` lets them share), before any point: a sweep of a ``device: cuda``
    recipe on a machine without enough GPUs stops with ConfigError instead of recording every
    point as rejected (and never trains on the CPU: :func:`hpclb.train.setup.run_device`)."""
    device = resolve(experiment, epochs=epochs).device
    try:
        select_device(device, 0, ranks)
    except ConfigError as e:  # its fixes name hpclb train's flags: say the sweep's instead
        own = "set the recipe's `device:` to cpu or auto"
        msg = (str(e).replace(f"--device {device}, but", f"the recipe's device is {device!r}, but")
               .replace("train with --device cpu", own).replace("use --device cpu", own)
               .replace("pass --share-gpu (or set", "set").replace("=1) to let", "=1 to let"))
        raise ConfigError(f"{experiment} ({ranks} rank(s) per point): {msg}") from e


def run_sweep(experiment: str, batch_sizes: Iterable[int], schemes: Iterable[str], *,
              epochs: float | None = None, ranks: int = 1,
              seeds: Iterable[int] | None = None, optimizer: str | None = None,
              data_dir: str | None = None, out_dir: str | Path | None = None,
              runs_dir: str | Path = "runs/sweeps", quiet: bool = True, log=print,
              overwrite: bool = False, micro_batch: int | None = None,
              task_index: int | None = None) -> list[dict]:
    """Run every ``(batch size, seed, scheme)`` point not yet recorded, in that order; returns
    the rows of this sweep's points (other points' rows stay in the files). ``task_index`` I:
    only point I of that order (a task of :func:`submit_sweep`'s job array; at k = 1 also the
    other schemes' points of its seed, whose rows are its run's) and only their rows.

    Args: ``experiment`` (packaged name or recipe path), ``batch_sizes`` (global batches in
    samples, each divisible by ``ranks``; run smallest first), ``schemes`` (subset of
    :data:`~hpclb.schedules.SCHEMES`), ``seeds`` (default ``[0]``), ``epochs``
    (default the recipe's, the same for every point), ``ranks`` (MPI ranks per point),
    ``out_dir`` (default ``<runs_dir>/<recipe name>``), ``micro_batch`` (samples per forward
    pass on a rank: each point accumulates ``B / (ranks * micro_batch)`` micro-batches per step,
    so BatchNorm sees the micro-batch, as it would on that many ranks; default: the whole
    per-rank batch). Before each point ``log`` gets the
    status line (:meth:`SweepStatus.line`: done, running, left, hours expected).
    A point the schedule rejects (e.g. a warmup longer than training) is recorded with its
    ``error`` and no metric, before any point trains; a point that diverges with its
    ``error`` and ``diverged_at_step``
    (:func:`failed_points` lists both). Raises ConfigError for bad arguments or a recipe
    device that cannot be had here (``device: cuda`` without a GPU), and
    MissingExtraError without matplotlib (the figure), both before any training, and
    RuntimeError when a point crashes (its row is not written; rerun to retry
    it). A point directory holding a run of other settings is deleted only with
    ``overwrite``; otherwise ConfigError names ``--overwrite``.
    """
    seeds = list(seeds) if seeds is not None else [0]
    sweep, points = _prepare(experiment, epochs=epochs, ranks=ranks, optimizer=optimizer,
                             seeds=seeds, out_dir=out_dir, runs_dir=runs_dir, data_dir=data_dir,
                             quiet=quiet, log=log, overwrite=overwrite,
                             batch_sizes=batch_sizes, schemes=schemes, micro_batch=micro_batch)
    todo = points if task_index is None else \
        task_points(points, task_index, sweep.recipe["base_batch_size"])
    pyplot("the sweep's figure")  # without matplotlib: say so before the first point trains
    _check_device(experiment, epochs, ranks)
    sweep.check(points)
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    sweep.reject_early(todo)
    for p in todo:
        status = SweepStatus.of(points, sweep.rows(), sweep.runs_dir,
                                base_batch=sweep.recipe["base_batch_size"])
        if p in status.left:
            log(f"sweep {sweep.name}: {status.line()}")
        sweep.point(p)
    with flock(sweep.results_lock):
        rows = load_rows(sweep.json_path)
        if rows:
            write_results(rows, sweep.out_dir, sweep.name, sweep.metric, sweep.mode,
                          sweep.recipe["base_batch_size"])
    log(f"sweep {sweep.name}: "
        f"{SweepStatus.of(points, rows, sweep.runs_dir, sweep.recipe['base_batch_size']).line()}")
    return [r for r in rows if Point.of_row(r) in set(todo)]


def submit_sweep(experiment: str, batch_sizes: Iterable[int], schemes: Iterable[str], *,
                 job: JobSpec, submit: bool = True, log=print, seeds: Iterable[int] = (0,),
                 epochs: float | None = None, ranks: int = 1, optimizer: str | None = None,
                 data_dir: str | None = None, out_dir: str | Path | None = None,
                 runs_dir: str | Path = "runs/sweeps", micro_batch: int | None = None,
                 overwrite: bool = False) -> Path | None:
    """Submit the sweep's points not yet recorded as ONE job array of ``job``'s scheduler and
    size, a task per point (:mod:`hpclb.tools.sweep_jobs`; ``submit`` False: the script only);
    returns the script (None when every point is recorded). The arguments are
    :func:`run_sweep`'s; each task runs its point as ``run_sweep(..., task_index=I)``.
    ConfigError (bad arguments, points recorded with other settings, a job of other than
    ``ranks`` ranks, no submit command here), JobError (a job that cannot be rendered) and
    RuntimeError (the submit command failed) before anything is submitted. A point whose
    schedule is refused (a warmup not shorter than training, ...) is recorded as rejected
    and gets no task."""
    seeds = list(seeds)
    sweep, points = _prepare(experiment, epochs=epochs, ranks=ranks, optimizer=optimizer,
                             seeds=seeds, out_dir=out_dir, runs_dir=runs_dir, data_dir=data_dir,
                             quiet=True, log=log, overwrite=overwrite, batch_sizes=batch_sizes,
                             schemes=schemes, micro_batch=micro_batch)
    sweep.check(points)
    try:  # a task certain to be refused is not submitted: its rejection is recorded now
        sweep.reject_early(points)
    except DataError as e:  # the data is not here: each task checks its own point
        log(f"sweep {sweep.name}: schedules not checked before submitting (the training set "
            f"cannot be counted here: {e})")
    rows = sweep.rows()
    indices = task_indices(points, lambda p: any(sweep.done(p, r) for r in rows),
                           sweep.recipe["base_batch_size"])
    if not indices:
        log(f"sweep {sweep.name}: every point is recorded; nothing to submit")
        return None
    argv = sweep_argv(experiment, sorted({p.batch for p in points}),
                      list(dict.fromkeys(p.scheme for p in points)), seeds, epochs=epochs,
                      ranks=ranks, optimizer=optimizer, micro_batch=micro_batch,
                      data_dir=data_dir, out_dir=out_dir, runs_dir=runs_dir, overwrite=overwrite)
    return submit_array(job, sweep.runs_dir, argv, points, indices, ranks=ranks,
                        name=sweep.name, submit=submit, log=log)


def failed_points(rows: list[dict], batch_sizes: Iterable[int],
                  schemes: Iterable[str]) -> list[str]:
    """``"B=<batch> <scheme> seed <s>: <error>"`` for each of the asked-for points in ``rows``
    (as :func:`run_sweep` returns them) that was rejected (diverged points are results and are
    not listed)."""
    asked = {(int(b), s) for b in batch_sizes for s in schemes}
    return [f"B={r['batch_size']} {r['scheme']} seed {r.get('seed')}: {r['error']}" for r in rows
            if is_rejected(r) and (r["batch_size"], r["scheme"]) in asked]
