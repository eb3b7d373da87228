"""Experiment recipes (YAML) and run settings, validated before any rank starts work.

Every problem is a :class:`ConfigError` whose message names the field and the fix. Validation
is a pure function of the command line and the recipe file, so every rank raises the same error
and none is left waiting in a collective.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from . import schedules
from .models import MODELS

OPTIMIZERS = ("sgd", "momentum", "adam", "lars", "lamb")
DATASETS = ("mnist", "fashion-mnist", "imagenet", "synthetic", "ptb", "bible-en-es")
# task kind -> the data sets it reads (hpclb/tasks.py). seq2seq recipes validate (job scripts
# are rendered from them) but `hpclb train` refuses them until the translation pipeline exists.
TASKS = {"classification": ("mnist", "fashion-mnist", "imagenet", "synthetic"),
         "language_model": ("ptb",), "seq2seq": ("bible-en-es",)}


class ConfigError(ValueError):
    """An invalid experiment recipe or command-line setting."""


def available_experiments() -> list[str]:
    """Names of the packaged recipes (``hpclb/experiments/*.yaml``; ``_`` read as ``-``)."""
    files = resources.files("hpclb.experiments").iterdir()
    return sorted(f.name[:-5].replace("_", "-") for f in files if f.name.endswith(".yaml"))


def _recipe_path(experiment: str) -> Path:
    path = Path(experiment)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"experiment file {path} does not exist")
        return path
    packaged = resources.files("hpclb.experiments") / (experiment.replace("-", "_") + ".yaml")
    if not packaged.is_file():
        raise ConfigError(f"unknown experiment {experiment!r}; choose one of "
                          f"{available_experiments()} or give a path to a recipe .yaml")
    return Path(str(packaged))


def _require(cond: bool, field: str, problem: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {problem}")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0


def load_recipe(experiment: str) -> dict[str, Any]:
    """Read and validate a recipe by packaged name (``mnist-lstm``) or path to a YAML file.

    Returns the recipe as a dict. Raises ConfigError naming the offending field.
    """
    path = _recipe_path(experiment)
    try:
        recipe = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    _require(isinstance(recipe, dict), str(path), "a recipe must be a YAML mapping")
    where = f"{path.name}"
    for key in ("name", "data", "model", "base_batch_size", "epochs", "warmup_epochs", "decay",
                "optimizer", "optimizers"):
        _require(key in recipe, f"{where}: {key}", "missing; see hpclb/experiments/mnist_lstm.yaml")
    _require(recipe["data"].get("name") in DATASETS, f"{where}: data.name",
             f"{recipe['data'].get('name')!r} is not one of {DATASETS}")
    kind = recipe.get("task", "classification")
    _require(kind in TASKS, f"{where}: task", f"{kind!r} is not one of {tuple(TASKS)}")
    _require(recipe["data"]["name"] in TASKS[kind], f"{where}: data.name",
             f"a {kind} task reads one of {TASKS[kind]}, not {recipe['data']['name']!r}")
    if kind == "seq2seq":
        for key in ("source", "target"):
            _require(recipe["data"].get(key, "en" if key == "source" else "es") in ("en", "es"),
                     f"{where}: data.{key}", "must be en or es")
        for key in ("vocab_size", "max_length", "eval_samples"):
            n = recipe["data"].get(key, 10)
            _require(isinstance(n, int) and not isinstance(n, bool) and n > 0,
                     f"{where}: data.{key}", f"must be a positive integer, got {n!r}")
        beam = recipe["data"].get("beam_size", 1)
        _require(isinstance(beam, int) and not isinstance(beam, bool) and beam >= 1,
                 f"{where}: data.beam_size", f"must be an integer >= 1 (1: greedy decoding; "
                 f"GNMT decodes with 10), got {beam!r}")
        alpha = recipe["data"].get("length_penalty", 0.6)
        _require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and
                 math.isfinite(alpha) and alpha >= 0, f"{where}: data.length_penalty",
                 f"must be a number >= 0 (alpha of GNMT's ((5 + length) / 6) ** alpha; 0: none, "
                 f"default 0.6), got {alpha!r}")
    if kind == "language_model":
        for key in ("bptt", "eval_streams"):
            n = recipe["data"].get(key, 10)
            _require(isinstance(n, int) and not isinstance(n, bool) and n > 0,
                     f"{where}: data.{key}", f"must be a positive integer, got {n!r}")
    for key in ("train_samples", "test_samples"):
        n = recipe["data"].get(key)
        _require(n is None or (isinstance(n, int) and n > 0), f"{where}: data.{key}",
                 f"must be a positive integer (a smoke-run subset) or absent, got {n!r}")
    if "augment" in recipe["data"]:
        aug = recipe["data"]["augment"]
        _require(isinstance(aug, bool), f"{where}: data.augment",
                 f"must be true or false (random-resized crop + horizontal flip of the imagenet "
                 f"training split; default true), got {aug!r}")
        _require(recipe["data"]["name"] == "imagenet", f"{where}: data.augment",
                 f"only the imagenet reader augments its training split; remove the field for "
                 f"data.name {recipe['data']['name']!r}")
    _require(recipe["model"].get("name") in MODELS, f"{where}: model.name",
             f"{recipe['model'].get('name')!r} is not one of {sorted(MODELS)}")
    _require(isinstance(recipe["base_batch_size"], int) and recipe["base_batch_size"] > 0,
             f"{where}: base_batch_size", "must be a positive integer")
    _require(_positive_number(recipe["epochs"]), f"{where}: epochs", "must be > 0")
    w0 = recipe["warmup_epochs"]
    _require(isinstance(w0, (int, float)) and w0 >= 0, f"{where}: warmup_epochs", "must be >= 0")
    decay = dict(recipe["decay"])
    try:
        schedules.validate_decay(decay.pop("name", None), decay)
    except ValueError as e:
        raise ConfigError(f"{where}: decay: {e}") from e
    for name, hp in recipe["optimizers"].items():
        _require(name in OPTIMIZERS, f"{where}: optimizers.{name}", f"not one of {OPTIMIZERS}")
        _require(_positive_number(hp.get("lr")), f"{where}: optimizers.{name}.lr",
                 f"must be a positive learning rate, got {hp.get('lr')!r}")
    clip = recipe.get("grad_clip_norm")
    _require(clip is None or _positive_number(clip), f"{where}: grad_clip_norm",
             "must be null or > 0")
    acc = recipe.get("accumulation_steps", 1)
    _require(isinstance(acc, int) and not isinstance(acc, bool) and acc >= 1,
             f"{where}: accumulation_steps", f"must be an integer >= 1 (micro-batches per "
             f"optimizer step; 1: no accumulation), got {acc!r}")
    return recipe


@dataclass(frozen=True)
class RunConfig:
    """One run, fully resolved: the recipe plus command-line choices, transferred to the global
    batch by ``scaling``. All batch sizes in samples; ``epochs`` may be fractional."""

    experiment: str
    recipe: dict
    global_batch_size: int
    scaling: str
    optimizer: str
    optimizer_params: dict
    epochs: float
    seed: int
    data_dir: str | None
    out: str
    resume: bool
    lr: float | None = None
    accumulation_steps: int = 1

    @property
    def base_batch_size(self) -> int:
        return int(self.recipe["base_batch_size"])

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
        if self.global_batch_size % (world_size * k):
            n = world_size * k
            raise ConfigError(
                f"--batch-size {self.global_batch_size} (the global batch) is not divisible by "
                f"the world size {world_size} x --accumulation-steps {k} = {n} (each rank runs "
                f"{k} micro-batches of B / {n} samples); choose a --batch-size that is a "
                f"multiple of {n}, or another --accumulation-steps (recipe field "
                f"accumulation_steps)")
        return self.global_batch_size // (world_size * k)

    def schedule(self, num_samples: int) -> schedules.Schedule:
        """The LR schedule of this run on a training set of ``num_samples`` samples."""
        decay = dict(self.recipe["decay"])
        try:
            return schedules.Schedule.from_recipe(
                base_lr=self.base_lr, base_batch_size=self.base_batch_size,
                base_warmup_epochs=float(self.recipe["warmup_epochs"]),
                global_batch_size=self.global_batch_size, num_samples=num_samples,
                epochs=self.epochs, scheme=self.scaling, decay=decay.pop("name"),
                decay_params=decay)
        except ValueError as e:
            raise ConfigError(f"schedule: {e}") from e

    def to_dict(self) -> dict:
        return asdict(self)


def resolve(experiment: str, *, batch_size: int | None = None, scaling: str = "legw",
            optimizer: str | None = None, epochs: float | None = None, seed: int = 0,
            data_dir: str | None = None, out: str | None = None, resume: bool = False,
            lr: float | None = None, accumulation_steps: int | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from a recipe and command-line overrides (None = recipe's).

    ``lr`` overrides the recipe's B0 peak LR (for tuning at B0). ``accumulation_steps``
    overrides the recipe's ``accumulation_steps`` (default 1): micro-batches per optimizer step;
    the global batch (the unit of the scaling rules) does not change. Raises ConfigError naming
    the bad field.
    """
    recipe = load_recipe(experiment)
    _require(scaling in schedules.SCHEMES, "--scaling",
             f"{scaling!r} is not one of {tuple(schedules.SCHEMES)}")
    batch = recipe["base_batch_size"] if batch_size is None else batch_size
    _require(isinstance(batch, int) and batch > 0, "--batch-size",
             f"must be a positive integer (the global batch in samples), got {batch}")
    opt = optimizer or recipe["optimizer"]
    _require(opt in OPTIMIZERS, "--optimizer", f"{opt!r} is not one of {OPTIMIZERS}")
    _require(opt in recipe["optimizers"], "--optimizer",
             f"the recipe {recipe['name']} has no tuned hyper-parameters for {opt!r}; add "
             f"optimizers.{opt} to it or choose one of {sorted(recipe['optimizers'])}")
    n_epochs = recipe["epochs"] if epochs is None else epochs
    _require(_positive_number(n_epochs), "--epochs", f"must be > 0, got {n_epochs}")
    _require(lr is None or _positive_number(lr), "--lr", f"must be a positive number, got {lr}")
    _require(isinstance(seed, int) and seed >= 0, "--seed", f"must be >= 0, got {seed}")
    acc = recipe.get("accumulation_steps", 1) if accumulation_steps is None else accumulation_steps
    _require(isinstance(acc, int) and not isinstance(acc, bool) and acc >= 1,
             "--accumulation-steps", f"must be an integer >= 1 (micro-batches per optimizer "
             f"step; 1: no accumulation), got {acc!r}")
    return RunConfig(experiment=recipe["name"], recipe=recipe, global_batch_size=batch,
                     scaling=scaling, optimizer=opt, optimizer_params=dict(recipe["optimizers"][opt]),
                     epochs=float(n_epochs), seed=seed, data_dir=data_dir,
                     out=out or f"runs/{recipe['name']}", resume=resume, lr=lr,
                     accumulation_steps=acc)
