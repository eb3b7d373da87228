"""`hpclb sweep`: batch-size sweeps of one recipe under several scaling schemes (You et al.,
SC '19, Tables 2-6: LEGW vs linear vs sqrt scaling with a fixed warmup, recipe tuned at B0 only).

Every point ``(B, scheme)`` trains the B0 recipe moved to global batch ``B`` by ``scheme`` and
nothing else (no re-tuning). Points run one after another: in this process for one rank, as an
``mpirun -n N ... hpclb train`` subprocess for ``N > 1``. Each point's run directory is
``<runs_dir>/<experiment>/<scheme>-b<B>``; results go to ``<out_dir>/<experiment>.json`` (a list of
rows), ``.md`` (tables) and ``.png`` (metric vs batch size per scheme; the LR curve of every point,
one panel per scheme).

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
from pathlib import Path
from typing import Iterable

from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError
from hpclb.schedules import SCHEMES, Schedule

ROW_KEYS = ("batch_size", "scheme", "metric_name", "metric", "epochs", "wall_time_s", "steps")


def metric_of(recipe: dict) -> tuple[str, str]:
    """(metric name, ``"max"`` or ``"min"``) that a sweep reports for ``recipe``: its
    ``target.metric`` (default ``test_accuracy``); perplexity, loss and error are minimised unless
    ``target.mode`` says otherwise."""
    target = recipe.get("target") or {}
    name = target.get("metric", "test_accuracy")
    lower = any(w in name for w in ("perplexity", "loss", "error"))
    return name, target.get("mode", "min" if lower else "max")


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
            "run_dir": str(run_dir), "error": None, "note": None}


def _run_in_process(experiment: str, batch: int, scheme: str, settings: dict, run_dir: Path,
                    data_dir: str | None, resume: bool, quiet: bool) -> dict:
    from hpclb.dist import SelfCommunicator
    from hpclb.train.loop import train

    cfg = resolve(experiment, batch_size=batch, scaling=scheme, optimizer=settings["optimizer"],
                  epochs=settings["epochs"], seed=settings["seed"], data_dir=data_dir,
                  out=str(run_dir), resume=resume)
    return train(cfg, SelfCommunicator(), quiet=quiet)


def _run_mpi(experiment: str, batch: int, scheme: str, settings: dict, run_dir: Path,
             data_dir: str | None, resume: bool, quiet: bool) -> dict:
    ranks = settings["ranks"]
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        mpirun = Path(shutil.which("mpirun") or "mpirun")
    cmd = [str(mpirun), "-n", str(ranks), "--bind-to", "none", sys.executable, "-m", "hpclb",
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
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, text=True,
                          stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE)
    if proc.returncode == 2:
        raise ConfigError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                          "hpclb train rejected the settings")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def run_sweep(experiment: str, batch_sizes: Iterable[int], schemes: Iterable[str], *,
              epochs: float | None = None, ranks: int = 1, seed: int = 0,
              optimizer: str | None = None, data_dir: str | None = None,
              out_dir: str | Path = "results/sweeps", runs_dir: str | Path = "runs/sweeps",
              quiet: bool = True, log=print) -> list[dict]:
    """Run every ``(batch size, scheme)`` point not yet recorded; returns all rows of the sweep.

    Args: ``experiment`` (packaged name or recipe path), ``batch_sizes`` (global batches in
    samples, each divisible by ``ranks``), ``schemes`` (subset of legw/linear/sqrt/none),
    ``epochs`` (default the recipe's, the same for every point), ``ranks`` (MPI ranks per point).
    A point the schedule rejects (e.g. a warmup longer than training) is recorded with its
    ``error`` and no metric. Raises ConfigError for bad arguments before any training, and
    RuntimeError when a point crashes (its row is not written; rerun to retry it).
    """
    recipe = load_recipe(experiment)
    name = recipe["name"]
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
    probe = resolve(experiment, optimizer=optimizer, epochs=epochs, seed=seed)  # validates
    settings = {"epochs": probe.epochs, "ranks": ranks, "seed": seed,
                "optimizer": probe.optimizer}
    metric, mode = metric_of(recipe)
    out_dir, runs_dir = Path(out_dir), Path(runs_dir) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    results_lock = runs_dir / ".results.lock"
    runner = _run_in_process if ranks == 1 else _run_mpi

    def record(row: dict) -> None:
        with _flock(results_lock):
            current = [r for r in _load_rows(json_path)
                       if not _same_point(r, row["batch_size"], row["scheme"], settings)]
            write_results(current + [row], out_dir, name, metric, mode)

    for batch in batch_sizes:
        for scheme in schemes:
            with _flock(results_lock):
                rows = _load_rows(json_path)
            if any(_same_point(r, batch, scheme, settings) for r in rows):
                log(f"sweep {name}: B={batch} {scheme}: already recorded, skipped")
                continue
            twin = next((r for r in rows if batch == recipe["base_batch_size"] and not r.get("error")
                         and _same_point(r, batch, r["scheme"], settings)), None)
            if twin is not None:  # k = 1: every scheme gives the same schedule, the same run
                record({**twin, "scheme": scheme,
                        "note": f"k = 1: the same run as {twin['scheme']}"})
                log(f"sweep {name}: B={batch} {scheme}: k = 1, same run as {twin['scheme']}")
                continue
            with _flock(runs_dir / f".{scheme}-b{batch}.lock", block=False) as mine:
                if not mine:
                    log(f"sweep {name}: B={batch} {scheme}: being trained by another sweep "
                        f"process, skipped")
                    continue
                _run_point(name, experiment, batch, scheme, settings, runs_dir, data_dir, quiet,
                           runner, metric, record, log)
    with _flock(results_lock):
        rows = _load_rows(json_path)
        if rows:
            write_results(rows, out_dir, name, metric, mode)
    return rows


def _run_point(name, experiment, batch, scheme, settings, runs_dir, data_dir, quiet, runner,
               metric, record, log) -> None:
    """Train (or resume, or read back) one point while holding its lock; record its row."""
    ranks, seed = settings["ranks"], settings["seed"]
    run_dir = runs_dir / f"{scheme}-b{batch}"
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if summary is not None and (summary.get("global_batch_size"), summary.get("scaling"),
                                summary.get("epochs"), summary.get("world_size"),
                                summary.get("seed"), summary.get("optimizer")) != \
            (batch, scheme, settings["epochs"], ranks, seed, settings["optimizer"]):
        summary = None  # a different run left it there: rerun from scratch
    if summary is None:
        resume = (run_dir / "checkpoint.pt").exists() and (run_dir / "config.json").exists()
        if not resume and run_dir.exists():
            shutil.rmtree(run_dir)
        if resume:
            try:
                old = json.loads((run_dir / "config.json").read_text())
                resume = (old.get("global_batch_size"), old.get("scaling"),
                          old.get("epochs"), old.get("world_size"), old.get("seed")) == \
                    (batch, scheme, settings["epochs"], ranks, seed)
            except (OSError, ValueError):
                resume = False
            if not resume:
                shutil.rmtree(run_dir)
        log(f"sweep {name}: B={batch} {scheme}: {'resuming' if resume else 'training'} "
            f"({ranks} rank(s), {settings['epochs']:g} epochs) -> {run_dir}")
        t0 = time.perf_counter()
        try:
            summary = runner(experiment, batch, scheme, settings, run_dir, data_dir,
                             resume, quiet)
        except ConfigError as e:
            log(f"sweep {name}: B={batch} {scheme}: rejected: {e}")
            record({"batch_size": batch, "scheme": scheme, "metric_name": metric,
                    "metric": None, **settings, "wall_time_s": 0.0, "steps": 0,
                    "time_to_target_s": None, "run_dir": str(run_dir),
                    "error": str(e)})
            return
        log(f"sweep {name}: B={batch} {scheme}: {metric} "
            f"{summary.get('final_' + metric)} in {time.perf_counter() - t0:.0f} s")
    record(_row(summary, batch=batch, scheme=scheme, metric=metric, settings=settings,
                run_dir=run_dir))


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "—"
    if "accuracy" in metric:
        return f"{100 * value:.2f}%"
    if value >= 1e5:
        return f"{value:.2e}"
    return f"{value:.2f}" if value >= 10 else f"{value:.4f}"


def markdown_table(rows: list[dict], name: str, metric: str, mode: str) -> str:
    """The sweep as markdown: final ``metric`` per batch size (rows) and scheme (columns), the
    gap to the B0 point of the same scheme, and every point's schedule and cost."""
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    batches = sorted({r["batch_size"] for r in rows})
    by = {(r["batch_size"], r["scheme"]): r for r in rows}
    base = min(batches) if batches else None
    lines = [f"# Sweep: {name}", "",
             f"Final {metric} ({'higher' if mode == 'max' else 'lower'} is better); in brackets "
             f"the difference to the smallest batch ({base}) under the same scheme "
             f"({'percentage points' if 'accuracy' in metric else 'as a ratio'}). — = not run or "
             f"rejected (see the detail table).", "",
             "| batch | " + " | ".join(schemes) + " |", "|---:|" + "---:|" * len(schemes)]
    for b in batches:
        cells = []
        for s in schemes:
            r = by.get((b, s))
            if r is None or r.get("metric") is None:
                cells.append("—")
                continue
            ref = by.get((base, s))
            txt = _fmt(metric, r["metric"])
            if b != base and ref and ref.get("metric") is not None:
                d = r["metric"] - ref["metric"]
                txt += f" ({100 * d:+.2f})" if "accuracy" in metric else \
                    f" (x{r['metric'] / ref['metric']:.3g})" if ref["metric"] else f" ({d:+.3g})"
            cells.append(txt)
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "| batch | scheme | k | peak LR | warmup steps (epochs) | steps | epochs | "
              f"{metric} | best | wall time (s) | time to target (s) | ranks | note |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["batch_size"], list(SCHEMES).index(r["scheme"]))):
        if r.get("error"):
            lines.append(f"| {r['batch_size']} | {r['scheme']} | | | | | {r['epochs']:g} | — | | "
                         f"| | {r['ranks']} | {r['error'].replace('|', '/')} |")
            continue
        ttt = r.get("time_to_target_s")
        lines.append(
            f"| {r['batch_size']} | {r['scheme']} | {r['batch_ratio_k']:g} | {r['peak_lr']:.4g} | "
            f"{r['warmup_steps']} ({r['warmup_epochs']:.3g}) | {r['steps']} | {r['epochs']:g} | "
            f"{_fmt(metric, r['metric'])} | {_fmt(metric, r.get('best_metric'))} | "
            f"{r['wall_time_s']:.0f} | {'—' if ttt is None else f'{ttt:.0f}'} | {r['ranks']} | "
            f"{r.get('note') or ''} |")
    return "\n".join(lines) + "\n"


def lr_curve(row: dict, points: int = 400) -> tuple[list[float], list[float]]:
    """(epochs, LR) of a recorded point, rebuilt from its schedule (a pure function of the step)."""
    decay = dict(row["decay"])
    sched = Schedule(peak_lr=row["peak_lr"], warmup_steps=row["warmup_steps"],
                     total_steps=row["steps"], steps_per_epoch=row["steps_per_epoch"],
                     decay=decay.pop("name"), decay_params=decay)
    stride = max(1, row["steps"] // points)
    steps = list(range(0, row["steps"], stride)) + [row["steps"] - 1]
    return [s / row["steps_per_epoch"] for s in steps], [sched.lr(s) for s in steps]


def plot(rows: list[dict], path: Path, name: str, metric: str):
    """PNG: the metric vs batch size (log2) per scheme with B0 marked, then one LR-vs-epoch
    panel per scheme. Returns the (closed) figure."""
    from hpclb.extras import require

    matplotlib = require("matplotlib", "the sweep plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    fig, axes = plt.subplots(1, 1 + len(schemes), figsize=(4.2 * (1 + len(schemes)), 3.6),
                             squeeze=False)
    ax = axes[0][0]
    scale = 100.0 if "accuracy" in metric else 1.0
    for s in schemes:
        pts = sorted((r["batch_size"], r["metric"]) for r in rows
                     if r["scheme"] == s and r.get("metric") is not None)
        if pts:
            ax.plot([p[0] for p in pts], [scale * p[1] for p in pts], marker="o", label=s)
    for b0 in sorted({round(r["batch_size"] / r["batch_ratio_k"]) for r in rows
                      if r.get("batch_ratio_k")}):  # the batch the recipe was tuned at
        ax.axvline(b0, color="gray", ls=":", lw=1.2, label=f"B0 = {b0}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel(metric + (" (%)" if scale == 100.0 else ""))
    ax.set_title(f"{name}: final {metric}")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    for ax, s in zip(axes[0][1:], schemes):
        for r in sorted((r for r in rows if r["scheme"] == s and not r.get("error")),
                        key=lambda r: r["batch_size"]):
            x, y = lr_curve(r)
            ax.plot(x, y, label=f"B={r['batch_size']}")
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel("learning rate")
        ax.set_title(f"LR schedule: {s}")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return fig


def write_results(rows: list[dict], out_dir: Path, name: str, metric: str, mode: str) -> None:
    """Write ``<name>.json``, ``.md`` and ``.png`` under ``out_dir`` (each atomically)."""
    for suffix, text in ((".json", json.dumps(rows, indent=2) + "\n"),
                         (".md", markdown_table(rows, name, metric, mode))):
        path = out_dir / f"{name}{suffix}"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    if rows:
        plot(rows, out_dir / f"{name}.png", name, metric)
