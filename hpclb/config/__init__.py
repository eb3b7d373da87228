"""Experiment recipes (YAML) and run settings, validated before any rank starts work.

Every problem is a :class:`ConfigError` whose message names the field and the fix. Validation
is a pure function of the command line and the recipe file, so every rank raises the same error
and none is left waiting in a collective.
"""
from __future__ import annotations

import difflib
import inspect
import math
import warnings
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hpclb import schedules
from hpclb.errors import ConfigError, RecipeWarning
from hpclb.models import MODELS

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
    "plugin_path",         # extra directories (relative to the recipe) to import plug-ins from
    "device",              # auto (default), cpu, cuda
    "precision",           # fp32 (default), bf16, fp16
    "log_every",           # steps between progress lines (default 50; 0: off)
    "noise_scale",         # measure the gradient noise scale (default false)
    "max_nonfinite_steps",  # consecutive skipped non-finite steps before the run stops (3)
    "keep_checkpoints",    # checkpoint generations kept (default 2)
)

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_WARN_ABOVE = 1e3  # a B0 peak LR above this is almost surely a typo (diverges at once)


def _int_at_least(low: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


# Run settings a recipe may set and the command line may override: recipe field -> (default,
# command-line flag, test, what a valid value is, with its unit).
RUN_SETTINGS = {
    "device": ("auto", "--device", lambda v: v in DEVICES,
               f"one of {', '.join(DEVICES)} (auto: cuda when a GPU is visible, else cpu)"),
    "precision": ("fp32", "--precision", lambda v: v in PRECISIONS,
                  f"one of {', '.join(PRECISIONS)} (the compute dtype of the forward and "
                  f"backward passes; bf16/fp16 need a GPU that has them)"),
    "log_every": (50, "--log-every", _int_at_least(0),
                  "an integer >= 0 (optimizer steps between progress lines; 0: off)"),
    "noise_scale": (False, "--noise-scale", lambda v: isinstance(v, bool),
                    "true or false (measure the gradient noise scale B_simple)"),
    "max_nonfinite_steps": (3, "--max-nonfinite-steps", _int_at_least(1),
                            "an integer >= 1 (consecutive optimizer steps with a non-finite "
                            "loss or gradient, each skipped, before the run stops)"),
    "keep_checkpoints": (2, "--keep-checkpoints", _int_at_least(1),
                         "an integer >= 1 (checkpoint generations kept in the run directory; "
                         "the newest is used on --resume, older ones if it is damaged)"),
}
# Above these a value is accepted with a RecipeWarning: (limit, why it is odd).
_RUN_SETTING_WARN = {
    "max_nonfinite_steps": (100, "a run with that many non-finite steps in a row has diverged"),
    "keep_checkpoints": (100, "each generation is a full model + optimizer copy on disk"),
}


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
    """The model's keys other than ``name`` must be arguments of its constructor (a built-in
    model or a plug-in class/factory) that the task does not set itself, and every argument
    without a default must be given. Imports a plug-in (ConfigError saying why it fails)."""
    from torch import nn

    from hpclb.models import model_factory
    from hpclb.plugins import check_kwargs, is_plugin

    name = model["name"]
    factory = model_factory(name)
    if is_plugin(name) and inspect.isclass(factory) and not issubclass(factory, nn.Module):
        raise ConfigError(f"{where}: model.name: {name!r} is the class {factory.__name__}, not "
                          f"a torch.nn.Module subclass (or a function returning a model)")
    from_data = _TASK_MODEL_ARGS.get(kind, ())
    for key in model:
        _require(key not in from_data, f"{where}: model.{key}",
                 f"set from the data by the {kind} task; remove it")
    try:
        check_kwargs(factory, [k for k in model if k != "name"], what=f"model {name}",
                     section="model", provided=from_data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


class _DuplicateKey(yaml.YAMLError):
    pass


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key written twice in one mapping (PyYAML keeps the
    last value silently). Merge keys (``<<``) may still be overridden."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # unhashable: SafeLoader reports it
                continue
            if first != key_node.start_mark.line + 1:
                raise _DuplicateKey(f"line {key_node.start_mark.line + 1}: key {key!r} is "
                                    f"written twice in one mapping (first at line {first}); "
                                    f"YAML would keep only the last value: remove one")
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e


def _plugin_path(recipe: dict, path: Path, where: str) -> list[str]:
    """The recipe's directory and its ``plugin_path`` entries (relative to it), absolute."""
    extra = recipe.get("plugin_path", [])
    _require(isinstance(extra, list) and all(isinstance(d, str) for d in extra),
             f"{where}: plugin_path", f"must be a list of directories (relative to the recipe "
             f"file), e.g. `plugin_path: [src]`, got {extra!r}")
    base = path.resolve().parent
    dirs = [str(base)] + [str((base / d).resolve()) for d in extra]
    for d in dirs[1:]:
        _require(Path(d).is_dir(), f"{where}: plugin_path", f"{d} is not a directory")
    return list(dict.fromkeys(dirs))


def _check_plugin_data(data: dict, kind: str, where: str) -> None:
    """A plug-in ``data.name``: a classification task, a function taking ``data_dir`` first
    and the data section's other keys as keyword arguments. Imports it (ConfigError why not)."""
    from hpclb.plugins import check_kwargs, load_object, signature_of
    from hpclb.tasks import PLUGIN_DATA_RESERVED

    name = data["name"]
    _require(kind == "classification", f"{where}: data.name",
             f"a plug-in data set ({name!r}) feeds a classification task; remove `task: {kind}`")
    try:
        fn = load_object(name, "data.name")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
    params, var_kw = signature_of(fn)
    _require(bool(params) and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD,
             f"{where}: data.name", f"{name!r} must take the data directory (a str) as its "
             f"first argument: def {name.split(':')[1]}(data_dir, **kwargs) -> (train, test)")
    kwargs = [k for k in data if k not in PLUGIN_DATA_RESERVED]
    try:
        check_kwargs(fn, kwargs, what=f"data function {name}", section="data",
                     provided=[params[0].name])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def _check_builtin_data(data: dict, kind: str, where: str) -> None:
    """A built-in ``data.name`` and the options its reader takes."""
    _require(data["name"] in DATASETS, f"{where}: data.name",
             f"{data['name']!r} is not one of {DATASETS}{_did_you_mean(data['name'], DATASETS)} "
             f"and not a plug-in package.module:function")
    _require(data["name"] in TASKS[kind], f"{where}: data.name",
             f"a {kind} task reads one of {TASKS[kind]}, not {data['name']!r}")
    if kind == "seq2seq":
        _check_seq2seq_data(data, where)
    if kind == "language_model":
        for key in ("bptt", "eval_streams"):
            n = data.get(key, 10)
            unit = "tokens per BPTT window" if key == "bptt" else "evaluation token streams"
            _require(_positive_int(n), f"{where}: data.{key}",
                     f"must be a positive integer ({unit}), got {n!r}")
    if "augment" in data:
        aug = data["augment"]
        _require(isinstance(aug, bool), f"{where}: data.augment",
                 f"must be true or false (random-resized crop + horizontal flip of the imagenet "
                 f"training split; default true), got {aug!r}")
        _require(data["name"] == "imagenet", f"{where}: data.augment",
                 f"only the imagenet reader augments its training split; remove the field for "
                 f"data.name {data['name']!r}")
    if "num_workers" in data:
        n = data["num_workers"]
        _require(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
                 f"{where}: data.num_workers",
                 f"must be an integer >= 0 (DataLoader worker processes per rank that decode the "
                 f"training images; 0: in the training thread; default min(4, CPUs per rank)), "
                 f"got {n!r}")
        _require(data["name"] == "imagenet", f"{where}: data.num_workers",
                 f"only the imagenet reader (image files) uses loader workers; "
                 f"{data['name']!r} is read from memory: remove the field")


def _check_seq2seq_data(data: dict, where: str) -> None:
    for key in ("source", "target"):
        _require(data.get(key, "en" if key == "source" else "es") in ("en", "es"),
                 f"{where}: data.{key}", "must be en or es")
    for key, unit in (("vocab_size", "SentencePiece pieces per language"),
                      ("max_length", "pieces per sentence"), ("eval_samples", "sentence pairs")):
        n = data.get(key, 10)
        _require(_positive_int(n), f"{where}: data.{key}",
                 f"must be a positive integer ({unit}), got {n!r}")
    beam = data.get("beam_size", 1)
    _require(_positive_int(beam), f"{where}: data.beam_size", f"must be an integer >= 1 "
             f"(1: greedy decoding; GNMT decodes with 10), got {beam!r}")
    alpha = data.get("length_penalty", 0.6)
    _require(_number(alpha) and alpha >= 0, f"{where}: data.length_penalty",
             f"must be a number >= 0 (alpha of GNMT's ((5 + length) / 6) ** alpha; 0: none, "
             f"default 0.6), got {alpha!r}")


def _warn(message: str) -> None:
    warnings.warn(message, RecipeWarning, stacklevel=3)


def _check_lr(lr: Any, field: str) -> None:
    _require(_positive_number(lr), field, f"must be a positive learning rate (the peak LR at "
             f"base_batch_size, per optimizer step), got {lr!r}")
    if lr > LR_WARN_ABOVE:
        _warn(f"{field}: learning rate {lr:g} is above {LR_WARN_ABOVE:g}; such a run diverges "
              f"at once with every optimizer here (LARS/LAMB scale it by the trust ratio, not "
              f"down to a sane step): is it a typo?")


# optimizer hyper-parameter -> (test, what a valid value is)
_HYPER_PARAMETERS = {
    "momentum": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "weight_decay": (lambda v: _number(v) and v >= 0, "a number >= 0 (L2 coefficient, per step "
                     "scaled by the LR)"),
    "eps": (lambda v: _number(v) and v > 0, "a number > 0 (added to a denominator; 0 gives "
            "0/0 = NaN where a gradient entry is 0)"),
    "trust_coefficient": (lambda v: _number(v) and v > 0, "a number > 0 (LARS's eta)"),
    "betas": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and
              all(_number(b) and 0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. "
              "[0.9, 0.999]"),
}


def _check_optimizers(recipe: dict, where: str) -> None:
    for name, hp in recipe["optimizers"].items():
        _check_lr(hp.get("lr"), f"{where}: optimizers.{name}.lr")
        for key, (ok, valid) in _HYPER_PARAMETERS.items():
            _require(key not in hp or ok(hp[key]), f"{where}: optimizers.{name}.{key}",
                     f"must be {valid}, got {hp.get(key)!r}")
        wd = hp.get("weight_decay", 0)
        if _number(wd) and wd >= 1:
            _warn(f"{where}: optimizers.{name}.weight_decay {wd:g} is >= 1: it shrinks the "
                  f"weights faster than the gradient moves them (typical: 1e-4 .. 0.1)")


def _check_run_setting(key: str, value: Any, where: str) -> Any:
    """``value`` of run setting ``key`` (:data:`RUN_SETTINGS`), ``where`` naming its source."""
    _default, _flag, ok, valid = RUN_SETTINGS[key]
    _require(ok(value), where, f"must be {valid}, got {value!r}")
    if key in _RUN_SETTING_WARN and value > _RUN_SETTING_WARN[key][0]:
        _warn(f"{where}: {value} is above {_RUN_SETTING_WARN[key][0]}: "
              f"{_RUN_SETTING_WARN[key][1]}")
    return value


def _check_settings(recipe: dict, where: str) -> None:
    """Numeric training settings: ranges, with units in the messages."""
    w0, epochs = recipe["warmup_epochs"], recipe["epochs"]
    _require(w0 < epochs, f"{where}: warmup_epochs",
             f"{w0:g} epochs of warmup (at base_batch_size) is not shorter than training "
             f"(epochs: {epochs:g}); shorten warmup_epochs or train more epochs")
    _check_optimizers(recipe, where)
    clip = recipe.get("grad_clip_norm")
    _require(clip is None or _positive_number(clip), f"{where}: grad_clip_norm",
             f"must be null or > 0 (the largest global L2 norm of the averaged gradient), got "
             f"{clip!r}")
    acc = recipe.get("accumulation_steps", 1)
    _require(_positive_int(acc), f"{where}: accumulation_steps", f"must be an integer >= 1 "
             f"(micro-batches per optimizer step; 1: no accumulation), got {acc!r}")
    target = recipe.get("target") or {}
    if "accuracy" in str(target.get("metric", "")) and "value" in target:
        _require(0 <= target["value"] <= 1, f"{where}: target.value",
                 f"{target['value']!r}: an accuracy is a fraction in [0, 1] (0.98 for 98%)")
    for key in RUN_SETTINGS:
        if key in recipe:
            _check_run_setting(key, recipe[key], f"{where}: {key} (or {RUN_SETTINGS[key][1]})")


def load_recipe(experiment: str) -> dict[str, Any]:
    """Read and validate a recipe by packaged name (``mnist-lstm``) or path to a YAML file.

    Returns the recipe as a dict; a recipe with a plug-in ``model.name``/``data.name``
    (``package.module:attribute``, :mod:`hpclb.plugins`) gets ``plugin_path``: the absolute
    directories its plug-ins are imported from (the recipe's own first), which are put on
    ``sys.path``. Raises ConfigError naming the offending field (a duplicate key with its line);
    warns (:class:`RecipeWarning`) for valid values outside their sensible range.
    """
    from hpclb.plugins import add_search_path, is_plugin

    path = _recipe_path(experiment)
    recipe = _read_yaml(path)
    _require(isinstance(recipe, dict), str(path), "a recipe must be a YAML mapping")
    where = f"{path.name}"
    _check_types(recipe, where)
    kind = recipe.get("task", "classification")
    if "plugin_path" in recipe or is_plugin(recipe["data"]["name"]) or \
            is_plugin(recipe["model"]["name"]):
        recipe["plugin_path"] = _plugin_path(recipe, path, where)
        add_search_path(recipe["plugin_path"])
    if is_plugin(recipe["data"]["name"]):
        _check_plugin_data(recipe["data"], kind, where)
    else:
        _check_builtin_data(recipe["data"], kind, where)
    for key in ("train_samples", "test_samples"):
        n = recipe["data"].get(key)
        _require(n is None or _positive_int(n), f"{where}: data.{key}",
                 f"must be a positive integer (the first N samples: a smoke-run subset) or "
                 f"absent, got {n!r}")
    if not is_plugin(recipe["model"]["name"]):
        _require(recipe["model"]["name"] in MODELS, f"{where}: model.name",
                 f"{recipe['model']['name']!r} is not one of {sorted(MODELS)}"
                 f"{_did_you_mean(recipe['model']['name'], MODELS)} and not a plug-in "
                 f"package.module:attribute")
    _check_model_args(recipe["model"], kind, where)
    decay = dict(recipe["decay"])
    try:
        schedules.validate_decay(decay.pop("name"), decay)
    except ValueError as e:
        raise ConfigError(f"{where}: decay: {e}") from e
    _check_settings(recipe, where)
    return recipe


@dataclass(frozen=True)
class RunConfig:
    """One run, fully resolved: the recipe plus command-line choices, transferred to the global
    batch by ``scaling``. All batch sizes in samples; ``epochs`` may be fractional.

    ``device`` (auto|cpu|cuda), ``precision`` (fp32|bf16|fp16), ``log_every`` (optimizer
    steps between progress lines; 0: off), ``noise_scale`` (measure the gradient noise scale),
    ``max_nonfinite_steps`` (consecutive skipped non-finite steps before the run stops) and
    ``keep_checkpoints`` (checkpoint generations kept): command line, else recipe, else the
    defaults of :data:`RUN_SETTINGS`."""

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
    device: str = "auto"
    precision: str = "fp32"
    log_every: int = 50
    noise_scale: bool = False
    max_nonfinite_steps: int = 3
    keep_checkpoints: int = 2

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
            lr: float | None = None, accumulation_steps: int | None = None,
            device: str | None = None, precision: str | None = None,
            log_every: int | None = None, noise_scale: bool | None = None,
            max_nonfinite_steps: int | None = None,
            keep_checkpoints: int | None = None) -> RunConfig:
    """Build a :class:`RunConfig` from a recipe and command-line overrides (None = recipe's).

    ``lr`` overrides the recipe's B0 peak LR (for tuning at B0). ``accumulation_steps``
    overrides the recipe's ``accumulation_steps`` (default 1): micro-batches per optimizer step;
    the global batch (the unit of the scaling rules) does not change. ``device``,
    ``precision``, ``log_every``, ``noise_scale``, ``max_nonfinite_steps`` and
    ``keep_checkpoints`` override the recipe fields of the same name (defaults in
    :data:`RUN_SETTINGS`). Raises ConfigError naming the bad field and its command-line flag;
    warns (:class:`RecipeWarning`) for valid values outside their sensible range.
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
    if lr is not None:
        _check_lr(lr, "--lr")
    _require(isinstance(seed, int) and seed >= 0, "--seed", f"must be >= 0, got {seed}")
    acc = recipe.get("accumulation_steps", 1) if accumulation_steps is None else accumulation_steps
    _require(isinstance(acc, int) and not isinstance(acc, bool) and acc >= 1,
             "--accumulation-steps", f"must be an integer >= 1 (micro-batches per optimizer "
             f"step; 1: no accumulation), got {acc!r}")
    given = {"device": device, "precision": precision, "log_every": log_every,
             "noise_scale": noise_scale, "max_nonfinite_steps": max_nonfinite_steps,
             "keep_checkpoints": keep_checkpoints}
    settings = {key: _check_run_setting(key, value, f"{RUN_SETTINGS[key][1]} (recipe field "
                                                    f"{key})")
                if value is not None else recipe.get(key, RUN_SETTINGS[key][0])
                for key, value in given.items()}
    return RunConfig(experiment=recipe["name"], recipe=recipe, global_batch_size=batch,
                     scaling=scaling, optimizer=opt, optimizer_params=dict(recipe["optimizers"][opt]),
                     epochs=float(n_epochs), seed=seed, data_dir=data_dir,
                     out=out or f"runs/{recipe['name']}", resume=resume, lr=lr,
                     accumulation_steps=acc, **settings)
