"""Experiment recipes (YAML) and run settings, validated before any rank starts work.

Every problem is a :class:`ConfigError` whose message names the field and the fix. Validation
is a pure function of the command line and the recipe file, so every rank raises the same error
and none is left waiting in a collective.
"""
from __future__ import annotations

import difflib
import inspect
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
# task kind -> the data sets it reads (hpclb/tasks.py); `hpclb train` runs all three kinds.
TASKS = {"classification": ("mnist", "fashion-mnist", "imagenet", "synthetic"),
         "language_model": ("ptb",), "seq2seq": ("bible-en-es",)}


# Every top-level recipe field the code reads; any other key is a typo and is rejected.
RECIPE_KEYS = (
    "name",                # the run's name (runs/<name>, results/sweeps/<name>.*)
    "task",                # classification (default), language_model, seq2seq
    "data",                # {name: <data set>, ...}: reader options (hpclb/tasks.py)
    "model",               # {name: <model>, ...}: constructor arguments (hpclb/models)
    "base_batch_size",     # B0, the batch the recipe was tuned at
    "epochs",              # training budget (fractional allowed)
    "warmup_epochs",       # W0 at B0
    "decay",               # {name: <decay>, ...} (hpclb/schedules.py)
    "optimizer",           # the default optimizer, a key of optimizers
    "optimizers",          # {<optimizer>: {lr: ..., <hyper-parameter>: ...}, ...}
    "grad_clip_norm",      # null or > 0
    "accumulation_steps",  # micro-batches per optimizer step (default 1)
    "target",              # {metric, value, mode}: time-to-target (train) and sweep metric
    "tuning",              # free text: how the B0 hyper-parameters were tuned
    "per_gpu_batch",       # hpclb jobs render's default per-rank batch
)


class ConfigError(ValueError):
    """An invalid experiment recipe or command-line setting."""


def _did_you_mean(word: Any, choices) -> str:
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


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


def _number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _positive_number(value: Any) -> bool:
    return _number(value) and value > 0


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_types(recipe: dict, where: str) -> None:
    """Unknown top-level keys, and fields of the wrong type, before anything reads them."""
    for key in recipe:
        _require(key in RECIPE_KEYS, f"{where}: {key}",
                 f"not a recipe field{_did_you_mean(key, RECIPE_KEYS)}; the fields are "
                 f"{', '.join(RECIPE_KEYS)} (see hpclb/experiments/mnist_lstm.yaml)")
    for key in ("name", "data", "model", "base_batch_size", "epochs", "warmup_epochs", "decay",
                "optimizer", "optimizers"):
        _require(key in recipe, f"{where}: {key}", "missing; see hpclb/experiments/mnist_lstm.yaml")
    name = recipe["name"]
    _require(isinstance(name, str) and name.strip() != "" and "/" not in name, f"{where}: name",
             f"must be a non-empty string without '/' (the run's name: runs/<name>), got {name!r}")
    for key, example in (("data", "data: {name: mnist}"),
                         ("model", "model: {name: mnist_lstm, hidden_size: 128}"),
                         ("decay", "decay: {name: poly, power: 2.0}")):
        value = recipe[key]
        _require(isinstance(value, dict) and "name" in value, f"{where}: {key}",
                 f"must be a mapping with a name, e.g. `{example}`, got {value!r}")
        _require(isinstance(value["name"], str), f"{where}: {key}.name",
                 f"must be a string, e.g. `{example}`, got {value['name']!r}")
    kind = recipe.get("task", "classification")
    _require(isinstance(kind, str) and kind in TASKS, f"{where}: task",
             f"{kind!r} is not one of {tuple(TASKS)}")
    b0 = recipe["base_batch_size"]
    _require(_positive_int(b0), f"{where}: base_batch_size",
             f"must be a positive integer (the global batch the recipe was tuned at), got {b0!r}")
    epochs = recipe["epochs"]
    _require(_positive_number(epochs), f"{where}: epochs",
             f"must be a finite number > 0 (fractional allowed), got {epochs!r}")
    w0 = recipe["warmup_epochs"]
    _require(_number(w0) and w0 >= 0, f"{where}: warmup_epochs",
             f"must be a finite number >= 0 (warmup at base_batch_size, in epochs), got {w0!r}")
    opts = recipe["optimizers"]
    _require(isinstance(opts, dict) and opts, f"{where}: optimizers",
             f"must be a mapping of optimizer to hyper-parameters, e.g. `optimizers: {{adam: "
             f"{{lr: 0.002}}}}`, got {opts!r}")
    for opt, hp in opts.items():
        _require(opt in OPTIMIZERS, f"{where}: optimizers.{opt}",
                 f"not one of {OPTIMIZERS}{_did_you_mean(opt, OPTIMIZERS)}")
        _require(isinstance(hp, dict), f"{where}: optimizers.{opt}",
                 f"must be a mapping of hyper-parameters with at least lr, e.g. `optimizers: "
                 f"{{{opt}: {{lr: {hp if _positive_number(hp) else 0.002}}}}}`, got {hp!r}")
    default = recipe["optimizer"]
    _require(isinstance(default, str) and default in opts, f"{where}: optimizer",
             f"the default optimizer must be one of the recipe's optimizers "
             f"{sorted(map(str, opts))}, got {default!r}")
    target = recipe.get("target")
    if target is not None:
        _require(isinstance(target, dict), f"{where}: target",
                 f"must be a mapping, e.g. `target: {{metric: test_accuracy, value: 0.98}}`, "
                 f"got {target!r}")
        for key in target:
            _require(key in ("metric", "value", "mode"), f"{where}: target.{key}",
                     f"not a target field{_did_you_mean(key, ('metric', 'value', 'mode'))}; "
                     f"it takes metric, value and mode")
        _require(isinstance(target.get("metric", ""), str), f"{where}: target.metric",
                 f"must be a metric name such as test_accuracy, got {target.get('metric')!r}")
        _require("value" not in target or _number(target["value"]), f"{where}: target.value",
                 f"must be a finite number, got {target.get('value')!r}")
        _require(target.get("mode") in (None, "max", "min"), f"{where}: target.mode",
                 f"must be max or min, got {target.get('mode')!r}")
    tuning = recipe.get("tuning")
    _require(tuning is None or isinstance(tuning, str), f"{where}: tuning",
             f"must be text (how the B0 hyper-parameters were tuned), got {tuning!r}")
    per_gpu = recipe.get("per_gpu_batch")
    _require(per_gpu is None or _positive_int(per_gpu), f"{where}: per_gpu_batch",
             f"must be a positive integer (hpclb jobs render's default per-rank batch) or "
             f"absent, got {per_gpu!r}")


# Model arguments the task sets from the data (hpclb/tasks.py, Task.model_kwargs).
_TASK_MODEL_ARGS = {"language_model": ("vocab_size",), "seq2seq": ("src_vocab", "tgt_vocab")}


def _check_model_args(model: dict, kind: str, where: str) -> None:
    """The model's keys other than ``name`` must be arguments of its constructor that the task
    does not set itself."""
    cls = MODELS[model["name"]]
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    from_data = _TASK_MODEL_ARGS.get(kind, ())
    takes = [p for p in params if p != "self" and p not in from_data]
    for key in model:
        _require(key not in from_data, f"{where}: model.{key}",
                 f"set from the data by the {kind} task; remove it")
        _require(key == "name" or key in takes, f"{where}: model.{key}",
                 f"not an argument of model {model['name']}{_did_you_mean(key, takes)}; it "
                 f"takes {', '.join(takes)}")


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
    _check_types(recipe, where)
    _require(recipe["data"]["name"] in DATASETS, f"{where}: data.name",
             f"{recipe['data']['name']!r} is not one of {DATASETS}"
             f"{_did_you_mean(recipe['data']['name'], DATASETS)}")
    kind = recipe.get("task", "classification")
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
        _require(n is None or _positive_int(n), f"{where}: data.{key}",
                 f"must be a positive integer (a smoke-run subset) or absent, got {n!r}")
    if "augment" in recipe["data"]:
        aug = recipe["data"]["augment"]
        _require(isinstance(aug, bool), f"{where}: data.augment",
                 f"must be true or false (random-resized crop + horizontal flip of the imagenet "
                 f"training split; default true), got {aug!r}")
        _require(recipe["data"]["name"] == "imagenet", f"{where}: data.augment",
                 f"only the imagenet reader augments its training split; remove the field for "
                 f"data.name {recipe['data']['name']!r}")
    _require(recipe["model"]["name"] in MODELS, f"{where}: model.name",
             f"{recipe['model']['name']!r} is not one of {sorted(MODELS)}"
             f"{_did_you_mean(recipe['model']['name'], MODELS)}")
    _check_model_args(recipe["model"], kind, where)
    decay = dict(recipe["decay"])
    try:
        schedules.validate_decay(decay.pop("name"), decay)
    except ValueError as e:
        raise ConfigError(f"{where}: decay: {e}") from e
    for name, hp in recipe["optimizers"].items():
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
        """The LR schedule of this run on a training set of ``num_samples`` samples.

        Raises ConfigError when the global batch is larger than the training set or the
        warmup is not shorter than training, naming the command-line fixes."""
        b = self.global_batch_size
        if b > num_samples:
            unit = "bptt-token sequences" if self.recipe.get("task") == "language_model" else \
                "samples"
            raise ConfigError(
                f"--batch-size {b}: the global batch is larger than the training set "
                f"({num_samples} {unit} of {self.recipe['data']['name']}), so every step would "
                f"see the whole set while the LR and warmup were scaled for k = B / B0 = "
                f"{b / self.base_batch_size:g}; use --batch-size {num_samples} or less")
        decay = dict(self.recipe["decay"])
        try:
            return schedules.Schedule.from_recipe(
                base_lr=self.base_lr, base_batch_size=self.base_batch_size,
                base_warmup_epochs=float(self.recipe["warmup_epochs"]),
                global_batch_size=b, num_samples=num_samples,
                epochs=self.epochs, scheme=self.scaling, decay=decay.pop("name"),
                decay_params=decay)
        except schedules.WarmupTooLong as e:
            fixes = [f"train more epochs (--epochs, at least {e.min_epochs:g} for this batch)"]
            if schedules.SCHEMES[self.scaling][1] == "legw":
                fixes.append("use a smaller --batch-size (LEGW's warmup, warmup_epochs x k "
                             "epochs, grows with the batch)")
            fixes.append("shorten the recipe's warmup_epochs")
            raise ConfigError(
                f"schedule: {e.problem} at --batch-size {b} (--scaling {self.scaling}); "
                f"{', '.join(fixes[:-1])}, or {fixes[-1]}") from e
        except ValueError as e:
            raise ConfigError(f"schedule: {e}") from e

    def to_dict(self) -> dict:
        return asdict(self)


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
    if n is not None and not _positive_int(n):
        raise ConfigError(f"--expect-world-size {n}: must be an integer >= 1 (the number of "
                          f"ranks, as in `mpirun -n N`), or leave it out")
    return n


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
    _require(_positive_number(n_epochs), "--epochs",
             f"must be a finite number > 0, got {n_epochs}")
    _require(lr is None or _positive_number(lr), "--lr",
             f"must be a positive number, got {lr}")
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
