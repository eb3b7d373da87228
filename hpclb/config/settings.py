"""Run settings: a recipe plus the command line, resolved into a :class:`RunConfig`.

Every problem is a :class:`ConfigError` naming the command-line flag (and the recipe field it
overrides); the checks are pure functions of the command line and the recipe file, so every
rank raises the same error.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property

from hpclb import schedules
from hpclb.config.fields import (
    SETTINGS,
    RunSettings,
    option,
    resolve_options,
    resolve_sync,
    setting_value,
)
from hpclb.config.outputs import default_run_dir
from hpclb.config.recipe import load_recipe, recipe_path
from hpclb.config.schema import check_lr, number, positive_int, positive_number, require
from hpclb.errors import ConfigError
from hpclb.optim import OPTIMIZERS
from hpclb.sync.options import check_environment, shares_per_step
from hpclb.tasks.registry import TASKS
from hpclb.tasks.spec import Recipe

__all__ = ["COMPILE_MODES", "KEYWORDS", "OPTIONS", "RESUME_CHANGES", "RunConfig",
           "check_checkpoint_interval", "check_expect_world_size", "resolve", "resume_changes",
           "resume_mode"]

#: ``torch.compile`` modes ``hpclb train --compile MODE`` takes (torch's documented ones)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: what ``--resume-changed`` lets a resumed run find changed (docs/faults.md)
RESUME_CHANGES = ("code", "data")


def resume_changes(value: str) -> tuple[str, ...]:
    """``--resume-changed``'s value: ``code``, ``data`` or ``code,data``."""
    parts = tuple(p.strip() for p in value.split(","))
    if not set(parts) <= set(RESUME_CHANGES):
        raise argparse.ArgumentTypeError(
            f"{value!r}: takes code, data or code,data (what may differ from the checkpoint's "
            f"run: the recipe's plug-in modules, the data files)")
    return parts


def resume_mode(value: str):
    """``--resume``'s optional value: only ``auto``."""
    if value != "auto":
        raise argparse.ArgumentTypeError(
            f"{value!r}: --resume takes no value (continue the run in --out) or auto (continue "
            f"when --out holds a checkpoint, else start afresh); write the experiment before "
            f"--resume")
    return value


@dataclass(frozen=True, kw_only=True)
class RunConfig(RunSettings):
    """One run, fully resolved: the recipe plus command-line choices, transferred to the global
    batch by ``scaling``. All batch sizes in samples; ``epochs`` may be fractional.

    The fields of :class:`~hpclb.config.fields.RunSettings` (``accumulation_steps``,
    ``device``, ``precision``, ``log_every``, ...): command line, else recipe, else their
    declared defaults. The fields declared by :func:`~hpclb.config.fields.option`
    (:data:`OPTIONS`: ``global_batch_size``, ``scaling``, ...): the command line, else their
    defaults (or the recipe's). ``compile``: None (eager) or a ``torch.compile`` mode of
    :data:`COMPILE_MODES` (``--compile``). ``out`` (default ``runs/<experiment>/<scaling>-b<B>``)
    must not hold a run unless ``resume`` (True, or ``"auto"``: resume when it holds a
    checkpoint) or ``overwrite`` (:mod:`hpclb.config.outputs`). ``resume_changed``: what of
    :data:`RESUME_CHANGES` a resume may find changed since the checkpoint (``--resume-changed``:
    the plug-in code, the data), on purpose."""

    experiment: str
    recipe: dict
    global_batch_size: int = option(
        None, "--batch-size", "global batch in samples (default: the recipe's B0); split evenly "
        "over the ranks", keyword="batch_size", type=int, column="batch",
        from_recipe=lambda spec: spec.base_batch_size,
        check=lambda v: isinstance(v, int) and v > 0,
        problem=lambda v: f"must be a positive integer (the global batch in samples), got {v}")
    scaling: str = option(
        "legw", "--scaling", "how the B0 recipe moves to this batch: legw (sqrt LR, warmup "
        "epochs x k), goyal (LR x k, a 5-epoch warmup from the B0 LR: Goyal et al. 2017), "
        "linear (LR x k, the recipe's warmup), sqrt (sqrt LR, the recipe's warmup), none",
        choices=list(schedules.SCHEMES), check=lambda v: v in schedules.SCHEMES, column="scheme",
        problem=lambda v: f"{v!r} is not one of {tuple(schedules.SCHEMES)}")
    optimizer: str = option(
        None, "--optimizer", "default: the recipe's", choices=OPTIMIZERS, column="optimizer",
        from_recipe=lambda spec: spec.optimizer, check=lambda v: v in OPTIMIZERS,
        problem=lambda v: f"{v!r} is not one of {tuple(OPTIMIZERS)}")
    optimizer_params: dict
    epochs: float = option(  # checked against the recipe's warmup by load_recipe
        None, "--epochs", "default: the recipe's (fractional allowed)", type=float,
        from_recipe=lambda spec: spec.epochs, column="epochs")
    seed: int = option(0, "--seed", type=int,  # < 2**32: every stream seeded from it fits
                       check=lambda v: isinstance(v, int) and 0 <= v < 2 ** 32,
                       problem=lambda v: f"must be in [0, 2**32 - 1 = 4294967295], got {v}")
    data_dir: str | None = option(
        None, "--data-dir", "where the data lives (default $HPCLB_DATA or ./data)")
    out: str = option(
        None, "--out", "run directory (default runs/<experiment>/<scaling>-b<B>); one that holds "
        "a run is refused unless --resume or --overwrite",
        check=lambda v: v is None or str(v).strip() != "",
        problem=lambda v: f"{v!r} is empty; give the run directory, or leave --out out for the "
        f"default runs/<experiment>/<scaling>-b<B>")
    resume: bool | str = option(
        False, "--resume", "continue from the newest checkpoint in --out that verifies (exit 2 "
        "when there is none); --resume auto: continue when --out holds one, else start afresh (a "
        "run stopped before its first checkpoint is started again from step 0, its logs "
        "replaced): what a requeued or restarted job needs. Write it after EXPERIMENT",
        nargs="?", const=True, type=resume_mode, metavar="auto",
        check=lambda v: v in (False, True, "auto"),
        problem=lambda v: f"must be True, False or 'auto' (resume when --out holds a checkpoint, "
        f"else start afresh), got {v!r}")
    lr: float | None = option(
        None, "--lr", "override the recipe's peak LR at B0 (for tuning)", type=float,
        check=lambda v: v is None or positive_number(v),
        problem=lambda v: f"must be a positive finite number (the peak LR at B0), got {v}")
    overwrite: bool = option(
        False, "--overwrite", "delete the run already in --out (summary, metrics, checkpoints) "
        "and start afresh", action="store_true")
    compile: str | None = option(
        None, "--compile", "torch.compile the model's forward (MODE: default, reduce-overhead, "
        "max-autotune; bare --compile: default); off by default", nargs="?", const="default",
        metavar="MODE", check=lambda v: v is None or v in COMPILE_MODES,
        problem=lambda v: f"{v!r} is not one of {COMPILE_MODES}")
    resume_changed: tuple[str, ...] = option(
        (), "--resume-changed", "with --resume: continue although the recipe's plug-in modules "
        "(code) or the data files (data) differ from the checkpoint's (refused otherwise, naming "
        "each); on purpose, recorded in config.json", type=resume_changes, metavar="code,data",
        check=lambda v: set(v) <= set(RESUME_CHANGES),
        problem=lambda v: f"{','.join(v)!r}: takes {' or '.join(RESUME_CHANGES)} or both, "
        f"comma-separated (the run's code or data changed since its checkpoint, on purpose), "
        f"and only with --resume")
    #: the gradient-sync settings (:data:`~hpclb.config.fields.SYNC_SETTINGS`, resolved:
    #: flag, else ``$HPCLB_*``, else the recipe's ``sync:``, else the default; ``stall_abort_s``
    #: None: never); empty: the library's (``GradientSync`` reads ``$HPCLB_*`` itself)
    sync: dict = field(default_factory=dict)

    @cached_property
    def spec(self) -> Recipe:
        """:attr:`recipe` parsed (:class:`~hpclb.tasks.spec.Recipe`); ``recipe`` stays the
        mapping written to config.json and checkpoints."""
        return Recipe.from_dict(self.recipe)

    @property
    def base_batch_size(self) -> int:
        return int(self.spec.base_batch_size)

    @property
    def base_lr(self) -> float:
        return float(self.lr if self.lr is not None else self.optimizer_params["lr"])

    def per_rank_batch_size(self, world_size: int) -> int:
        """``global_batch_size / world_size``; ConfigError if it does not divide."""
        if self.global_batch_size % world_size:
            raise ConfigError(
                f"--batch-size {self.global_batch_size} (the global batch) is not divisible by "
                f"the world size {world_size}; choose a multiple of {world_size} or change the "
                f"number of ranks")
        return self.global_batch_size // world_size

    def micro_batch_size(self, world_size: int) -> int:
        """Samples per micro-batch, ``global_batch_size / (world_size * accumulation_steps)``:
        each rank runs ``accumulation_steps`` of them per optimizer step. ConfigError if it does
        not divide."""
        k = self.accumulation_steps
        if k == 1:
            return self.per_rank_batch_size(world_size)
        n = shares_per_step(world_size, k)
        if self.global_batch_size % n:
            raise ConfigError(
                f"--batch-size {self.global_batch_size} (the global batch) is not divisible by "
                f"the world size {world_size} x --accumulation-steps {k} = {n} (each rank runs "
                f"{k} micro-batches of B / {n} samples); choose a --batch-size that is a "
                f"multiple of {n}, or another --accumulation-steps (recipe field "
                f"accumulation_steps)")
        return self.global_batch_size // n

    def schedule(self, num_samples: int) -> schedules.Schedule:
        """The LR schedule of this run on a training set of ``num_samples`` samples.

        Raises ConfigError when the global batch is larger than the training set, the
        warmup is not shorter than training, the budget is more than
        :data:`~hpclb.schedules.MAX_TOTAL_STEPS` optimizer steps, or the recipe's
        ``decay.end_lr`` is not below the peak LR, naming the command-line or recipe fixes."""
        b = self.global_batch_size
        self._check_end_lr(b)
        if b > num_samples:
            unit = TASKS[self.spec.task].sample_unit
            raise ConfigError(
                f"--batch-size {b}: the global batch is larger than the training set "
                f"({num_samples} {unit} of {self.spec.data.name}), so every step would "
                f"see the whole set while the LR and warmup were scaled for k = B / B0 = "
                f"{b / self.base_batch_size:g}; use --batch-size {num_samples} or less")
        try:
            return schedules.Schedule.from_recipe(
                base_lr=self.base_lr, base_batch_size=self.base_batch_size,
                base_warmup_epochs=float(self.spec.warmup_epochs),
                global_batch_size=b, num_samples=num_samples,
                epochs=self.epochs, scheme=self.scaling, decay=self.spec.decay.name,
                decay_params=dict(self.spec.decay.params))
        except schedules.BudgetTooLarge as e:
            given = self.epochs != float(self.recipe["epochs"])
            field = "--epochs" if given else f"{self.spec.name}: epochs (recipe field)"
            raise ConfigError(
                f"{field} {self.epochs:g}: {e.problem} at --batch-size {b} on "
                f"{num_samples} samples; give the training budget in epochs "
                f"(at most {schedules.MAX_TOTAL_STEPS // e.steps_per_epoch:.4g} at this "
                f"batch)") from e
        except schedules.WarmupTooLong as e:
            fixes = [f"train more epochs (--epochs, at least {e.min_epochs:g} for this batch)"]
            if schedules.SCHEMES[self.scaling][1] == "legw":
                fixes.append("use a smaller --batch-size (LEGW's warmup, warmup_epochs x k "
                             "epochs, grows with the batch)")
            fixes.append("use another --scaling (goyal's warmup is a fixed "
                         f"{schedules.GOYAL_WARMUP_EPOCHS:g} epochs, whatever the batch or the "
                         f"recipe's warmup_epochs)" if self.scaling == "goyal" else
                         "shorten the recipe's warmup_epochs")
            raise ConfigError(
                f"schedule: {e.problem} at --batch-size {b} (--scaling {self.scaling}); "
                f"{', '.join(fixes[:-1])}, or {fixes[-1]}") from e
        except ValueError as e:
            raise ConfigError(f"schedule: {e}") from e

    def _check_end_lr(self, batch: int) -> None:
        """ConfigError naming the recipe's ``decay.end_lr`` when it is not below the B0 peak
        ``eta0`` (or the peak at ``batch``, lower for k = B / B0 < 1): the decay would raise
        the LR. Below ``eta0`` is the rule at every k >= 1: every scaling keeps the peak there
        at or above ``eta0``."""
        end = self.spec.decay.params.get("end_lr")
        eta0 = self.base_lr
        peak = schedules.scale_lr(eta0, self.base_batch_size, batch,
                                  schedules.SCHEMES[self.scaling][0])
        if not number(end) or end < min(eta0, peak):
            return  # absent (0), below both, or not a number (refused by the schedule's check)
        source = "--lr" if self.lr is not None else f"optimizers.{self.optimizer}.lr"
        at = (f"; the peak at --batch-size {batch} (--scaling {self.scaling}) is {peak:g}"
              if peak < eta0 else "")
        raise ConfigError(
            f"{self.spec.name}: decay.end_lr {end:g} (recipe field) is not below the peak LR: a "
            f"{self.spec.decay.name} decay goes from the peak down to end_lr, so this one would "
            f"raise the LR to {end:g}; the B0 peak is {eta0:g} ({source}){at}; set decay.end_lr "
            f"below {min(eta0, peak):g} (e.g. 0): below the B0 peak is the rule at every batch "
            f"from B0 up, where every --scaling keeps the peak at or above it")

    def to_dict(self) -> dict:
        return asdict(self)


#: the fields of :class:`RunConfig` the command line sets and the recipe does not: field name ->
#: declaration (:func:`~hpclb.config.fields.option`: flag, help, check, default)
OPTIONS = {f.name: f.metadata["option"] for f in fields(RunConfig) if "option" in f.metadata}
#: :func:`resolve`'s keywords for the command line's values: :data:`OPTIONS`', then
#: :data:`~hpclb.config.fields.SETTINGS`' (each the flag's ``dest``)
KEYWORDS = (*(o.keyword or name for name, o in OPTIONS.items()), *SETTINGS)


def check_checkpoint_interval(seconds: float | None) -> float | None:
    """``--checkpoint-interval``: None or 0 (off) or a number of seconds > 0; ConfigError for a
    negative value or nan (which would checkpoint at every step or never)."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and
                                    not isinstance(seconds, bool) and seconds >= 0):
        raise ConfigError(f"--checkpoint-interval {seconds}: must be a number of seconds >= 0 "
                          f"(0: off, checkpoints at epoch ends and on preemption only; e.g. "
                          f"1800 for every half hour)")
    return seconds


def check_expect_world_size(n: int | None) -> int | None:
    """``--expect-world-size``: None or an integer >= 1; ConfigError otherwise."""
    if n is not None and not positive_int(n):
        raise ConfigError(f"--expect-world-size {n}: must be an integer >= 1 (the number of "
                          f"ranks, as in `mpirun -n N`), or leave it out")
    return n


def _check_environment() -> None:
    """The ``HPCLB_*`` gradient-sync variables, before any rank trains (ConfigError)."""
    try:
        check_environment()
    except ValueError as e:
        raise ConfigError(f"environment: {e}") from e


def resolve(experiment: str, *, sync: dict | None = None, **given) -> RunConfig:
    """Build a :class:`RunConfig` from a recipe and command-line overrides (None = recipe's).

    ``given``: the command line's values of :data:`OPTIONS` by their keywords (``batch_size``,
    ``scaling``, ``optimizer``, ``lr``: the recipe's B0 peak LR, for tuning at B0; ``epochs``,
    ``seed``, ``data_dir``, ``out``, ``resume``, ``overwrite``, ``compile``; each flag's default
    or the recipe's when not given) and of the settings of :data:`hpclb.config.fields.SETTINGS`
    (``accumulation_steps=4``, ``device="cpu"``, ...; None: the recipe's, else the declared
    default). ``resume``: True continues the run in ``out`` (a checkpoint must be there),
    ``"auto"`` continues it when ``out`` holds a checkpoint, else starts afresh. ``out``
    defaults to ``runs/<name>/<scaling>-b<batch>``; ``overwrite`` lets a new run replace a run
    already there (checked by :func:`hpclb.train.setup.setup_run`). ``compile``: None, or the
    ``torch.compile`` mode the model's forward is compiled with (:data:`COMPILE_MODES`).
    ``sync``: the command line's gradient-sync settings (``{"compression": "bf16"}``;
    :func:`~hpclb.sync.options.resolve_sync` applies ``$HPCLB_*`` and the recipe's ``sync:``
    once, here). ``resume_changed``: with ``resume``, what of :data:`RESUME_CHANGES` may have
    changed since the checkpoint (``--resume-changed code,data``).
    Raises ConfigError naming the bad field and its command-line flag, TypeError for a keyword
    that is not a setting; warns (:class:`RecipeWarning`) for valid values outside their
    sensible range.
    """
    unknown = sorted(set(given) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"resolve() got unexpected keyword argument(s) {unknown}; the settings "
                        f"are {', '.join(KEYWORDS)}")
    _check_environment()
    recipe = load_recipe(experiment, epochs=given.get("epochs"))  # warmup vs the budget
    spec = Recipe.from_dict(recipe)
    values = resolve_options(OPTIONS, given, spec)
    opt = values["optimizer"]
    require(opt in spec.optimizers, "--optimizer",
            f"the recipe {spec.name} has no tuned hyper-parameters for {opt!r}; add "
            f"optimizers.{opt} to it or choose one of {sorted(spec.optimizers)}")
    changed = values["resume_changed"] = tuple(sorted(set(values["resume_changed"])))
    require(values["resume"] or not changed, "--resume-changed",
            OPTIONS["resume_changed"].problem(changed))
    if values["lr"] is not None:
        check_lr(values["lr"], "--lr")
    return RunConfig(experiment=spec.name, recipe=recipe,
                     optimizer_params=dict(spec.optimizers[opt].params),
                     **{**values, "epochs": float(values["epochs"]),
                        "out": values["out"] or default_run_dir(spec.name, values["scaling"],
                                                                 values["global_batch_size"])},
                     sync=resolve_sync(recipe.get("sync"), sync or {}, dict(os.environ),
                                       recipe_path(experiment).name),
                     **{name: setting_value(name, given.get(name), recipe) for name in SETTINGS})
