"""``hpclb scale RUN_DIR --to-batch B``: carry a finished run's recipe to another batch size.

The run's resolved recipe (``RUN_DIR/config.json``, written by ``hpclb train``) is written out as
a recipe YAML that ``hpclb train RECIPE --batch-size B --scaling S`` runs as is. The written
recipe stays the *B0 recipe*: ``base_batch_size``, the optimizer's peak LR and
``warmup_epochs`` are the tuned B0 values (the run's ``--lr``/``--epochs``/``--optimizer``
overrides folded in), because ``hpclb train`` applies the scaling rule itself
(:mod:`hpclb.schedules`, You et al. SC '19): under LEGW the peak LR becomes ``eta0 * sqrt(k)``
and the warmup ``W0 * k`` epochs, the same number of steps, for ``k = B / B0``. What changes
from the source run to ``B`` (k, peak LR, warmup epochs and steps, steps per epoch, total steps)
is computed with the same functions and printed. Everything else the source run used is
carried: its run settings (device, precision, log_every, noise_scale, max_nonfinite_steps,
keep_checkpoints, accumulation_steps) are written into the recipe, its seed and data directory
go on the printed ``hpclb train`` line and into the job. With ``--scheduler`` the SLURM/PBS job
script for the new batch is rendered by :func:`hpclb.tools.jobs.render` beside the recipe.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpclb._io import read_json, write_text_atomic
from hpclb.config import SETTINGS, resolve
from hpclb.config.outputs import check_output_file
from hpclb.errors import ConfigError, JobError
from hpclb.schedules import SCHEMES, Schedule, scale_warmup_epochs
from hpclb.tools.dryrun import WARMUP_WARN_FRACTION
from hpclb.tools.jobs import render
from hpclb.tools.jobs_spec import JobSpec
from hpclb.tools.plot import num_train_samples

__all__ = ["Scaled", "b0_recipe", "describe", "scale_run", "format_changes", "write_job"]


@dataclass(frozen=True)
class Scaled:
    """The outcome of :func:`scale_run`: the written recipe, the command that runs it, and the
    schedules before (the source run's) and after (at ``batch``)."""

    recipe_path: Path
    command: str
    batch: int
    scaling: str
    base_batch: int
    before: dict[str, Any]
    after: dict[str, Any]
    seed: int = 0
    data_dir: str | None = None    # the source run's data directory (absolute), if recorded


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing; RUN_DIR must be a run directory written by `hpclb "
                          f"train --out RUN_DIR` (it holds config.json, metrics.jsonl)")
    try:
        cfg = read_json(path, "the config.json files of `hpclb train`")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{e}; RUN_DIR must be a run directory written by `hpclb train`"
                          if isinstance(e, ValueError) else f"{path}: cannot read it ({e})") \
            from None
    for key in ("recipe", "global_batch_size", "scaling", "optimizer"):
        if not isinstance(cfg, dict) or key not in cfg:
            raise ConfigError(f"{path}: no {key!r}; not a config.json of `hpclb train`")
    return cfg


def b0_recipe(cfg: dict, batch: int) -> dict:
    """The source run's recipe with its command-line overrides folded in (``--optimizer``,
    ``--lr`` as the B0 peak LR, ``--epochs`` and the run settings of
    :data:`hpclb.config.SETTINGS`: ``--accumulation-steps``, ``--device``, ...), named
    ``<name>-b<batch>`` so its default run directory is new."""
    recipe = json.loads(json.dumps(cfg["recipe"]))  # deep copy
    opt = cfg["optimizer"]
    recipe["optimizer"] = opt
    if cfg.get("lr") is not None:
        recipe["optimizers"][opt]["lr"] = cfg["lr"]
    if cfg.get("epochs") is not None:
        recipe["epochs"] = cfg["epochs"]
    for key in SETTINGS:  # the settings the run used, command line and recipe folded
        if cfg.get(key) is not None:
            recipe[key] = cfg[key]
    recipe["name"] = f"{cfg['recipe']['name']}-b{batch}"
    return recipe


def describe(sched: Schedule, recipe: dict, batch: int, scaling: str) -> dict[str, Any]:
    """The numbers :func:`scale_run` prints for one schedule (batch in samples).
    ``warmup_epochs`` is the scheme's rule (LEGW: ``W0 * k``), counted in samples as
    :mod:`hpclb.schedules` counts warmup (``warmup_steps = round(W * N / B)``)."""
    b0 = int(recipe["base_batch_size"])
    w_epochs = scale_warmup_epochs(float(recipe["warmup_epochs"]), b0, batch,
                                   SCHEMES[scaling][1])
    return {"batch": batch, "scaling": scaling, "k": batch / b0, "peak_lr": sched.peak_lr,
            "warmup_epochs": w_epochs, "warmup_steps": sched.warmup_steps,
            "steps_per_epoch": sched.steps_per_epoch, "total_steps": sched.total_steps}


def _source_data_dir(cfg: dict) -> str | None:
    """The data directory the source run read: ``data_root`` (absolute, recorded by ``hpclb
    train``), else its ``--data-dir`` as given, else None (not recorded: $HPCLB_DATA or ./data)."""
    return cfg.get("data_root") or cfg.get("data_dir")


def _in_scale_terms(message: str, to_batch: int) -> str:
    """A ``hpclb train`` error told in ``hpclb scale``'s flags (``--batch-size`` is
    ``--to-batch`` here; ``--epochs`` is scale's own)."""
    return message.replace(f"--batch-size {to_batch}", f"--to-batch {to_batch}") \
        .replace("--batch-size", "--to-batch")


def _check_request(to_batch, scaling: str, epochs) -> None:
    if scaling not in SCHEMES:
        raise ConfigError(f"--scaling {scaling!r} is not one of {tuple(SCHEMES)}")
    if isinstance(to_batch, bool) or not isinstance(to_batch, int) or to_batch <= 0:
        raise ConfigError(f"--to-batch must be a positive integer (global batch in samples), "
                          f"got {to_batch!r}")
    if epochs is not None and not (isinstance(epochs, (int, float)) and epochs > 0):
        raise ConfigError(f"--epochs must be a number > 0 (the training budget), got {epochs!r}")


def scale_run(run_dir: str | Path, to_batch: int, *, scaling: str = "legw",
              out: str | Path | None = None, num_samples: int | None = None,
              epochs: float | None = None, overwrite: bool = False) -> Scaled:
    """Write the B0 recipe of ``run_dir`` for batch ``to_batch`` under ``scaling`` to ``out``
    (default ``RUN_DIR/recipe-b<B>-<scaling>.yaml``) and return what changed.

    ``num_samples``: the training-set size, needed only for data sets that
    the data-set registry has no size for; ``epochs``: a new training budget (default the
    run's). ConfigError (nothing written) for a directory without config.json, a bad batch or
    scheme, or a schedule that cannot run at ``to_batch`` (e.g. LEGW's warmup longer than
    training; the message names the fix in ``hpclb scale``'s flags), or a recipe file that
    exists unless ``overwrite``."""
    run = Path(run_dir)
    cfg = _read_config(run)
    _check_request(to_batch, scaling, epochs)
    recipe = b0_recipe(cfg, to_batch)
    if epochs is not None:
        recipe["epochs"] = epochs
    path = Path(out) if out else run / f"recipe-b{to_batch}-{scaling}.yaml"
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--out {path}: a recipe file must end in .yaml")
    check_output_file(path, overwrite=overwrite)
    n = num_train_samples(recipe, num_samples)
    seed, data = int(cfg.get("seed", 0)), _source_data_dir(cfg)
    ranks = int(cfg.get("world_size", 1))  # the source run's launch: its recipe may need it
    command = (f"mpirun -n {ranks} " if ranks > 1 else "") + \
        f"hpclb train {path} --batch-size {to_batch} --scaling {scaling}" + \
        (f" --seed {seed}" if seed else "") + (f" --data-dir {data}" if data else "")
    header = (f"# {recipe['name']}: the B0 recipe of the run {run} ({cfg['recipe']['name']}, "
              f"batch {cfg['global_batch_size']}, {cfg['scaling']}), to run at batch "
              f"{to_batch} with --scaling {scaling}:\n#   {command}\n# base_batch_size, peak "
              f"LR and warmup_epochs are B0's; hpclb train scales them (hpclb/schedules.py).\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, header + yaml.safe_dump(recipe, sort_keys=False))
    try:  # the file must resolve exactly as the printed command will resolve it
        after = resolve(str(path), batch_size=to_batch, scaling=scaling).schedule(n)
        before = resolve(str(path), batch_size=cfg["global_batch_size"],  # the run's budget
                         scaling=cfg["scaling"], epochs=cfg.get("epochs")).schedule(n)
    except ConfigError as e:
        path.unlink()
        raise ConfigError(f"--to-batch {to_batch} --scaling {scaling}: "
                          f"{_in_scale_terms(str(e), to_batch)}") from e
    return Scaled(recipe_path=path, batch=to_batch, scaling=scaling,
                  base_batch=int(recipe["base_batch_size"]), command=command,
                  before=describe(before, recipe, cfg["global_batch_size"], cfg["scaling"]),
                  after=describe(after, recipe, to_batch, scaling), seed=seed, data_dir=data)


def format_changes(s: Scaled) -> str:
    """A small table of the source run's and the new batch's schedule, then the command."""
    rows = [("batch", "{:d}"), ("scaling", "{}"), ("k", "{:g}"), ("peak_lr", "{:.4g}"),
            ("warmup_epochs", "{:.4g}"), ("warmup_steps", "{:d}"),
            ("steps_per_epoch", "{:d}"), ("total_steps", "{:d}")]
    lines = [f"{'':16s} {'run':>12s} {'-> new':>12s}"]
    for key, fmt in rows:
        a, b = fmt.format(s.before[key]), fmt.format(s.after[key])
        lines.append(f"{key:16s} {a:>12s} {b:>12s}{'' if a == b else '  *'}")
    share = s.after["warmup_steps"] / s.after["total_steps"]
    if share > WARMUP_WARN_FRACTION:  # as hpclb train --dry-run warns
        lines.append(f"warning: warmup takes {share:.0%} of the new run (more than half): train "
                     f"more epochs (--epochs) or scale to a smaller --to-batch")
    lines.append(f"B0 = {s.base_batch}; recipe written to {s.recipe_path}")
    lines.append(f"run it with:  {s.command}")
    return "\n".join(lines)


def write_job(s: Scaled, scheduler: str, nodes: int, gpus_per_node: int, *,
              tasks_per_node: int | None = None, overwrite: bool = False) -> Path:
    """Render the ``scheduler`` job script for the scaled recipe on ``nodes`` x (``gpus_per_node``
    or ``tasks_per_node``) ranks, each with ``batch / ranks`` samples, with the source run's
    seed and data directory (exported as ``HPCLB_DATA``), through
    :func:`hpclb.tools.jobs.render`; written beside the recipe (its path with ``.sbatch`` or
    ``.pbs``). ConfigError when the batch does not split evenly over the ranks or the job
    cannot be rendered (the message says what to change), or the file exists unless
    ``overwrite``."""
    ranks = nodes * (tasks_per_node or gpus_per_node or 1) if nodes > 0 else 0
    if ranks <= 0 or s.batch % ranks:
        raise ConfigError(f"--to-batch {s.batch} must split evenly over --nodes {nodes} x "
                          f"{'--tasks-per-node' if tasks_per_node else '--gpus-per-node'} "
                          f"{tasks_per_node or gpus_per_node} = {ranks} ranks")
    spec = JobSpec(experiment=str(s.recipe_path), scheduler=scheduler, nodes=nodes,
                   gpus_per_node=gpus_per_node, tasks_per_node=tasks_per_node,
                   batch_size=s.batch, scaling=s.scaling, seed=s.seed, data_dir=s.data_dir)
    try:
        text, plan = render(spec)
    except JobError as e:
        raise ConfigError(str(e)) from e
    if plan.global_batch != s.batch or plan.warmup_steps != s.after["warmup_steps"]:
        raise AssertionError(f"job plan {plan} disagrees with the scaled recipe {s.after}")
    path = s.recipe_path.with_suffix(".sbatch" if scheduler == "slurm" else ".pbs")
    check_output_file(path, overwrite=overwrite)
    write_text_atomic(path, text)
    path.chmod(0o755)
    return path
