"""Field checks of a recipe: types, ranges with units, and names checked against the registries
(:data:`hpclb.data.registry.DATASETS`, :data:`hpclb.models.MODELS`,
:data:`hpclb.optim.OPTIMIZERS`, :data:`hpclb.tasks.registry.TASKS`).

Every problem is a :class:`ConfigError` whose message names the field and the fix; a valid value
outside its sensible range is a :class:`RecipeWarning`.
"""
from __future__ import annotations

import difflib
import inspect
import math
import warnings
from typing import Any

from hpclb.config.fields import (
    DEVICES,
    PRECISIONS,
    SETTINGS,
    check_setting,
    check_sync_section,
    recipe_where,
)
from hpclb.data.registry import DATASETS
from hpclb.errors import ConfigError, RecipeWarning
from hpclb.models import MODELS
from hpclb.optim import OPTIMIZERS
from hpclb.tasks.registry import TASKS, datasets_of, task_metrics
from hpclb.tasks.spec import task_name

__all__ = ["DEVICES", "LR_WARN_ABOVE", "PRECISIONS", "RECIPE_KEYS",
           "check_builtin_data", "check_lr", "check_model", "check_plugin_data",
           "check_sample_counts", "check_settings", "check_target_metric",
           "check_task_functions", "check_types", "did_you_mean", "number", "optimizer_arguments",
           "positive_int", "positive_number", "require", "warn"]

# Every top-level recipe field the code reads; any other key is a typo and is rejected. The run
# settings (accumulation_steps, device, ...) are declared in hpclb/config/fields.py.
RECIPE_KEYS = (
    "name",                # the run's name (runs/<name>, results/sweeps/<name>.*)
    "task",                # classification (default), language_model, seq2seq, or
                           # {name: supervised, loss: mod:fn, metrics: {name: mod:fn}}
    "data",                # {name: <data set>, ...}: reader options (hpclb/data/registry.py)
    "model",               # {name: <model>, ...}: constructor arguments (hpclb/models)
    "base_batch_size",     # B0, the batch the recipe was tuned at
    "epochs",              # training budget (fractional allowed)
    "warmup_epochs",       # W0 at B0
    "decay",               # {name: <decay>, ...} (hpclb/schedules.py)
    "optimizer",           # the default optimizer, a key of optimizers
    "optimizers",          # {<optimizer>: {lr: ..., <hyper-parameter>: ...}, ...}
    "grad_clip_norm",      # null or > 0
    "target",              # {metric, value, mode}: time-to-target (train) and sweep metric
    "tuning",              # free text: how the B0 hyper-parameters were tuned
    "per_gpu_batch",       # hpclb jobs render's default per-rank batch
    "plugin_path",         # extra directories (relative to the recipe) to import plug-ins from
    "sync",                # {fusion_threshold_bytes, overlap, compression, stall_timeout_s,
                           #  stall_abort_s}: gradient sync (hpclb/sync/options.py)
    *SETTINGS,
)

LR_WARN_ABOVE = 1e3  # a B0 peak LR above this is almost surely a typo (diverges at once)


def did_you_mean(word: Any, choices) -> str:
    """A suffix for an error message naming the entry of ``choices`` closest to ``word`` (difflib):
    ``" (did you mean 'x'?)"``, or an empty string when none is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def require(cond: bool, field: str, problem: str) -> None:
    """Raises ConfigError ``"<field>: <problem>"`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{field}: {problem}")


def number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def positive_number(value: Any) -> bool:
    """A finite int or float > 0 (not a bool)."""
    return number(value) and value > 0


def positive_int(value: Any) -> bool:
    """An int > 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_types(recipe: dict, where: str) -> None:
    """Unknown top-level keys, and fields of the wrong type, before anything reads them."""
    _check_keys(recipe, where)
    _check_sections(recipe, where)
    _check_budget(recipe, where)
    _check_optimizer_sections(recipe, where)
    _check_target(recipe.get("target"), where)
    tuning = recipe.get("tuning")
    require(tuning is None or isinstance(tuning, str), f"{where}: tuning",
            f"must be text (how the B0 hyper-parameters were tuned), got {tuning!r}")
    per_gpu = recipe.get("per_gpu_batch")
    require(per_gpu is None or positive_int(per_gpu), f"{where}: per_gpu_batch",
            f"must be a positive integer (hpclb jobs render's default per-rank batch) or "
            f"absent, got {per_gpu!r}")


def _check_keys(recipe: dict, where: str) -> None:
    """Every key a recipe field, the required ones present, and a usable ``name``."""
    for key in recipe:
        require(key in RECIPE_KEYS, f"{where}: {key}",
                f"not a recipe field{did_you_mean(key, RECIPE_KEYS)}; the fields are "
                f"{', '.join(RECIPE_KEYS)} (see hpclb/experiments/mnist_lstm.yaml)")
    for key in ("name", "data", "model", "base_batch_size", "epochs", "warmup_epochs", "decay",
                "optimizer", "optimizers"):
        require(key in recipe, f"{where}: {key}", "missing; see hpclb/experiments/mnist_lstm.yaml")
    name = recipe["name"]
    require(isinstance(name, str) and name.strip() != "" and "/" not in name, f"{where}: name",
            f"must be a non-empty string without '/' (the run's name: runs/<name>), got {name!r}")


def _check_sections(recipe: dict, where: str) -> None:
    """``data``, ``model`` and ``decay`` are mappings with a string ``name``; ``task`` a kind."""
    for key, example in (("data", "data: {name: mnist}"),
                         ("model", "model: {name: mnist_lstm, hidden_size: 128}"),
                         ("decay", "decay: {name: poly, power: 2.0}")):
        value = recipe[key]
        require(isinstance(value, dict) and "name" in value, f"{where}: {key}",
                f"must be a mapping with a name, e.g. `{example}`, got {value!r}")
        require(isinstance(value["name"], str), f"{where}: {key}.name",
                f"must be a string, e.g. `{example}`, got {value['name']!r}")
    _check_task(recipe.get("task", "classification"), where)


_TASK_FIELDS = ("name", "loss", "metrics")


def _check_task(task: Any, where: str) -> None:
    """``task``: a kind, or ``{name: <kind>, loss: mod:fn, metrics: {name: mod:fn}}`` where the
    kind takes its loss from the recipe (``supervised``)."""
    if isinstance(task, dict):
        for key in task:
            require(key in _TASK_FIELDS, f"{where}: task.{key}",
                    f"not a task field{did_you_mean(key, _TASK_FIELDS)}; it takes "
                    f"{', '.join(_TASK_FIELDS)}")
    kind = task.get("name", "classification") if isinstance(task, dict) else task
    require(isinstance(kind, str) and kind in TASKS, f"{where}: task" +
            (".name" if isinstance(task, dict) else ""),
            f"{kind!r} is not one of {tuple(TASKS)}{did_you_mean(kind, TASKS)}")
    own = TASKS[kind].own_loss
    loss = task.get("loss") if isinstance(task, dict) else None
    metrics = task.get("metrics", {}) if isinstance(task, dict) else {}
    require(own or (loss is None and not metrics), f"{where}: task.loss",
            f"the {kind} task has its own loss and metrics; for your own, write `task: "
            f"{{name: supervised, loss: module:function, metrics: {{...}}}}`")
    require(not own or isinstance(loss, str), f"{where}: task.loss",
            f"required by task {kind}: your loss function as package.module:function, "
            f"fn(output, y) -> the batch's mean (a scalar tensor), e.g. `loss: my_loss:mse`")
    require(isinstance(metrics, dict) and all(
        isinstance(m, str) and m.isidentifier() and m != "loss" and isinstance(f, str)
        for m, f in metrics.items()), f"{where}: task.metrics",
        f"must map metric names (identifiers other than loss) to package.module:function, "
        f"e.g. `metrics: {{mae: my_loss:mae}}`, got {metrics!r}")


def check_task_functions(task: Any, where: str) -> None:
    """Import a task's ``loss`` and ``metrics`` functions (ConfigError naming the field)."""
    from hpclb.plugins import load_object

    if not isinstance(task, dict):
        return
    refs = {"task.loss": task.get("loss"),
            **{f"task.metrics.{m}": f for m, f in (task.get("metrics") or {}).items()}}
    for field, ref in refs.items():
        if ref is not None:
            try:
                load_object(ref, field)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from e


def check_target_metric(recipe: dict, where: str) -> None:
    """``target.metric`` must be a metric the recipe's task produces."""
    metric = (recipe.get("target") or {}).get("metric")
    task = recipe.get("task")
    own = (task.get("metrics") or {}) if isinstance(task, dict) else {}
    choices = task_metrics(task_name(task), own)
    require(metric is None or metric in choices, f"{where}: target.metric",
            f"{metric!r} is not a metric of the {task_name(task)} task"
            f"{did_you_mean(metric, choices)}; it reports {', '.join(choices)}")


def _check_budget(recipe: dict, where: str) -> None:
    """``base_batch_size``, ``epochs`` and ``warmup_epochs``."""
    b0 = recipe["base_batch_size"]
    require(positive_int(b0), f"{where}: base_batch_size",
            f"must be a positive integer (the global batch the recipe was tuned at), got {b0!r}")
    epochs = recipe["epochs"]
    require(positive_number(epochs), f"{where}: epochs",
            f"must be a finite number > 0 (fractional allowed), got {epochs!r}")
    w0 = recipe["warmup_epochs"]
    require(number(w0) and w0 >= 0, f"{where}: warmup_epochs",
            f"must be a finite number >= 0 (warmup at base_batch_size, in epochs), got {w0!r}")


def _check_optimizer_sections(recipe: dict, where: str) -> None:
    """``optimizers`` maps registered optimizers to mappings; ``optimizer`` is one of them."""
    opts = recipe["optimizers"]
    require(isinstance(opts, dict) and opts, f"{where}: optimizers",
            f"must be a mapping of optimizer to hyper-parameters, e.g. `optimizers: {{adam: "
            f"{{lr: 0.002}}}}`, got {opts!r}")
    known = tuple(OPTIMIZERS)
    for opt, hp in opts.items():
        require(opt in OPTIMIZERS, f"{where}: optimizers.{opt}",
                f"not one of {known}{did_you_mean(opt, known)}")
        require(isinstance(hp, dict), f"{where}: optimizers.{opt}",
                f"must be a mapping of hyper-parameters with at least lr, e.g. `optimizers: "
                f"{{{opt}: {{lr: {hp if positive_number(hp) else 0.002}}}}}`, got {hp!r}")
    default = recipe["optimizer"]
    require(isinstance(default, str) and default in opts, f"{where}: optimizer",
            f"the default optimizer must be one of the recipe's optimizers "
            f"{sorted(map(str, opts))}, got {default!r}")


def _check_target(target: Any, where: str) -> None:
    if target is None:
        return
    require(isinstance(target, dict), f"{where}: target",
            f"must be a mapping, e.g. `target: {{metric: test_accuracy, value: 0.98}}`, "
            f"got {target!r}")
    for key in target:
        require(key in ("metric", "value", "mode"), f"{where}: target.{key}",
                f"not a target field{did_you_mean(key, ('metric', 'value', 'mode'))}; "
                f"it takes metric, value and mode")
    require(isinstance(target.get("metric", ""), str), f"{where}: target.metric",
            f"must be a metric name such as test_accuracy, got {target.get('metric')!r}")
    require("value" not in target or number(target["value"]), f"{where}: target.value",
            f"must be a finite number, got {target.get('value')!r}")
    require(target.get("mode") in (None, "max", "min"), f"{where}: target.mode",
            f"must be max or min, got {target.get('mode')!r}")


def check_model(model: dict, kind: str, where: str) -> None:
    """A registered ``model.name`` (or a plug-in). The model's keys other than ``name`` must be
    arguments of its constructor (a built-in model or a plug-in class/factory) that the task does
    not set itself, and every argument without a default must be given. Imports a plug-in
    (ConfigError saying why it fails)."""
    from torch import nn

    from hpclb.models import model_factory
    from hpclb.plugins import check_kwargs, is_plugin

    name = model["name"]
    if not is_plugin(name):
        require(name in MODELS, f"{where}: model.name",
                f"{name!r} is not one of {sorted(MODELS)}{did_you_mean(name, MODELS)} and not a "
                f"plug-in package.module:attribute")
    factory = model_factory(name)
    if is_plugin(name) and inspect.isclass(factory) and not issubclass(factory, nn.Module):
        raise ConfigError(f"{where}: model.name: {name!r} is the class {factory.__name__}, not "
                          f"a torch.nn.Module subclass (or a function returning a model)")
    from_data = TASKS[kind].model_args  # set by the task (Task.model_kwargs)
    for key in model:
        require(key not in from_data, f"{where}: model.{key}",
                f"set from the data by the {kind} task; remove it")
    try:
        check_kwargs(factory, {k: v for k, v in model.items() if k != "name"},
                     what=f"model {name}", section="model", provided=from_data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def check_sample_counts(data: dict, where: str) -> None:
    """``data.train_samples`` / ``data.test_samples``: absent or positive integers."""
    for key in ("train_samples", "test_samples"):
        n = data.get(key)
        require(n is None or positive_int(n), f"{where}: data.{key}",
                f"must be a positive integer (the first N samples: a smoke-run subset) or "
                f"absent, got {n!r}")


def check_plugin_data(data: dict, kind: str, where: str) -> None:
    """A plug-in ``data.name``: a classification task, a function taking ``data_dir`` first
    and the data section's other keys as keyword arguments. Imports it (ConfigError why not)."""
    from hpclb.plugins import check_kwargs, load_object, signature_of
    from hpclb.tasks.plugin import PLUGIN_DATA_RESERVED, plugin_dataset

    name = data["name"]
    tasks = plugin_dataset(name).tasks
    require(kind in tasks, f"{where}: data.name",
            f"a plug-in data set ({name!r}) feeds a {' or '.join(tasks)} task, not {kind}")
    for key in data:
        near = did_you_mean(key, PLUGIN_DATA_RESERVED)
        require(key in PLUGIN_DATA_RESERVED or not near, f"{where}: data.{key}",
                f"not a data option{near}; hpclb's are {', '.join(PLUGIN_DATA_RESERVED)}, the "
                f"other keys go to the data function")
    try:
        fn = load_object(name, "data.name")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
    params, var_kw = signature_of(fn)
    require(bool(params) and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD,
            f"{where}: data.name", f"{name!r} must take the data directory (a str) as its "
            f"first argument: def {name.split(':')[1]}(data_dir, **kwargs) -> (train, test)")
    kwargs = {k: v for k, v in data.items() if k not in PLUGIN_DATA_RESERVED}
    try:
        check_kwargs(fn, kwargs, what=f"data function {name}", section="data",
                     provided=[params[0].name])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def check_builtin_data(data: dict, kind: str, where: str) -> None:
    """A registered ``data.name`` that a ``kind`` task reads, and the options its reader takes."""
    names = tuple(DATASETS)
    require(data["name"] in DATASETS, f"{where}: data.name",
            f"{data['name']!r} is not one of {names}{did_you_mean(data['name'], names)} "
            f"and not a plug-in package.module:function")
    require(data["name"] in datasets_of(kind), f"{where}: data.name",
            f"a {kind} task reads one of {datasets_of(kind)}, not {data['name']!r}")
    _KIND_DATA_CHECKS.get(kind, lambda data, where: None)(data, where)
    options = DATASETS[data["name"]].options
    if "augment" in data:
        aug = data["augment"]
        require(isinstance(aug, bool), f"{where}: data.augment",
                f"must be true or false (random-resized crop + horizontal flip of the imagenet "
                f"training split; default true), got {aug!r}")
        require("augment" in options, f"{where}: data.augment",
                f"only the {_readers_of('augment')} reader augments its training split; remove "
                f"the field for data.name {data['name']!r}")
    if "shards" in data:
        require(isinstance(data["shards"], bool), f"{where}: data.shards",
                f"must be true or false (read the tar shards <data dir>/imagenet/shards/train "
                f"and .../val, written by `hpclb data shards`; default false), got "
                f"{data['shards']!r}")
        require("shards" in options, f"{where}: data.shards",
                f"only the {_readers_of('shards')} reader reads tar shards; remove the field "
                f"for data.name {data['name']!r}")
    if "num_workers" in data:
        n = data["num_workers"]
        require(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
                f"{where}: data.num_workers",
                f"must be an integer >= 0 (DataLoader worker processes per rank that decode the "
                f"training images; 0: in the training thread; default min(16, CPUs per rank - "
                f"1)), got {n!r}")
        require("num_workers" in options, f"{where}: data.num_workers",
                f"only the {_readers_of('num_workers')} reader (image files) uses loader "
                f"workers; {data['name']!r} is read from memory: remove the field")
    valid = ("name", "train_samples", "test_samples", *options, *TASKS[kind].data_options)
    for key in data:
        require(key in valid, f"{where}: data.{key}",
                f"not an option of data set {data['name']!r}{did_you_mean(key, valid)}; it "
                f"takes {', '.join(valid)}")


def _readers_of(option: str) -> str:
    """The data sets whose reader takes ``option``, for messages (``imagenet``)."""
    return "/".join(n for n, ds in DATASETS.items() if option in ds.options)


def _check_lm_data(data: dict, where: str) -> None:
    for key in ("bptt", "eval_streams"):
        n = data.get(key, 10)
        unit = "tokens per BPTT window" if key == "bptt" else "evaluation token streams"
        require(positive_int(n), f"{where}: data.{key}",
                f"must be a positive integer ({unit}), got {n!r}")


def _check_seq2seq_data(data: dict, where: str) -> None:
    for key in ("source", "target"):
        require(data.get(key, "en" if key == "source" else "es") in ("en", "es"),
                f"{where}: data.{key}", "must be en or es")
    for key, unit in (("vocab_size", "SentencePiece pieces per language"),
                      ("max_length", "pieces per sentence"), ("eval_samples", "sentence pairs")):
        n = data.get(key, 10)
        require(positive_int(n), f"{where}: data.{key}",
                f"must be a positive integer ({unit}), got {n!r}")
    beam = data.get("beam_size", 1)
    require(positive_int(beam), f"{where}: data.beam_size", f"must be an integer >= 1 "
            f"(1: greedy decoding; GNMT decodes with 10), got {beam!r}")
    alpha = data.get("length_penalty", 0.6)
    require(number(alpha) and alpha >= 0, f"{where}: data.length_penalty",
            f"must be a number >= 0 (alpha of GNMT's ((5 + length) / 6) ** alpha; 0: none, "
            f"default 0.6), got {alpha!r}")


# task kind -> checks of the data-section options that kind reads
_KIND_DATA_CHECKS = {"language_model": _check_lm_data, "seq2seq": _check_seq2seq_data}


def warn(message: str) -> None:
    """A :class:`RecipeWarning` (a valid value outside its sensible range)."""
    warnings.warn(message, RecipeWarning, stacklevel=3)


def check_lr(lr: Any, field: str) -> None:
    """ConfigError naming ``field`` unless ``lr`` is a positive finite number; a RecipeWarning above
    ``LR_WARN_ABOVE``."""
    require(positive_number(lr), field, f"must be a positive learning rate (the peak LR at "
            f"base_batch_size, per optimizer step), got {lr!r}")
    if lr > LR_WARN_ABOVE:
        warn(f"{field}: learning rate {lr:g} is above {LR_WARN_ABOVE:g}; such a run diverges "
              f"at once with every optimizer here (LARS/LAMB scale it by the trust ratio, not "
              f"down to a sane step): is it a typo?")


# optimizer hyper-parameter -> (test, what a valid value is)
_HYPER_PARAMETERS = {
    "momentum": (lambda v: number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "weight_decay": (lambda v: number(v) and v >= 0, "a number >= 0 (L2 coefficient, per step "
                     "scaled by the LR)"),
    "eps": (lambda v: number(v) and v > 0, "a number > 0 (added to a denominator; 0 gives "
            "0/0 = NaN where a gradient entry is 0)"),
    "trust_coefficient": (lambda v: number(v) and v > 0, "a number > 0 (LARS's eta)"),
    "betas": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and
              all(number(b) and 0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. "
              "[0.9, 0.999]"),
}


# built-in optimizers whose builder takes **hyper-parameters: the torch class they go to
_TORCH_OPTIMIZERS = {"sgd": "SGD", "momentum": "SGD", "adam": "Adam"}


def _optimizer_parameters(name: str) -> tuple[list[inspect.Parameter], bool]:
    """The hyper-parameters of optimizer ``name`` (:data:`hpclb.optim.OPTIMIZERS`; the torch
    class of a builder taking ``**hyper-parameters``), its parameter list excluded, and whether
    it takes any keyword. Imports torch."""
    from hpclb.plugins import signature_of

    builder = OPTIMIZERS.load(name)
    params, var_kw = signature_of(builder)
    if var_kw and name in _TORCH_OPTIMIZERS:
        import torch

        params, var_kw = signature_of(getattr(torch.optim, _TORCH_OPTIMIZERS[name]))
    return params[1:], var_kw


def optimizer_arguments(name: str) -> list[str] | None:
    """The hyper-parameters optimizer ``name`` (:data:`hpclb.optim.OPTIMIZERS`) takes, its
    parameter list excluded; None when it takes any keyword. Imports torch."""
    params, var_kw = _optimizer_parameters(name)
    return None if var_kw else [p.name for p in params]


def _check_optimizer_arguments(name: str, hp: dict, where: str) -> None:
    from hpclb.plugins import check_no_bool_numbers

    params, var_kw = _optimizer_parameters(name)
    try:
        check_no_bool_numbers(params, hp, what=f"the {name} optimizer",
                              section=f"optimizers.{name}")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
    accepted = None if var_kw else [p.name for p in params]
    for key in hp if accepted is not None else ():
        require(key in accepted, f"{where}: optimizers.{name}.{key}",
                f"not a hyper-parameter of the {name} optimizer{did_you_mean(key, accepted)}; "
                f"it takes {', '.join(accepted)}")


def _check_optimizers(recipe: dict, where: str) -> None:
    for name, hp in recipe["optimizers"].items():
        check_lr(hp.get("lr"), f"{where}: optimizers.{name}.lr")
        _check_optimizer_arguments(name, hp, where)
        for key, (ok, valid) in _HYPER_PARAMETERS.items():
            require(key not in hp or ok(hp[key]), f"{where}: optimizers.{name}.{key}",
                    f"must be {valid}, got {hp.get(key)!r}")
        wd = hp.get("weight_decay", 0)
        if number(wd) and wd >= 1:
            warn(f"{where}: optimizers.{name}.weight_decay {wd:g} is >= 1: it shrinks the "
                  f"weights faster than the gradient moves them (typical: 1e-4 .. 0.1)")


def check_settings(recipe: dict, where: str, epochs: float | None = None) -> None:
    """Numeric training settings: ranges, with units in the messages. ``epochs``: the run's
    budget when the command line sets it (``--epochs``; checked by the caller), which the
    warmup is compared with instead of the recipe's ``epochs``."""
    w0, given = recipe["warmup_epochs"], epochs is not None
    require(not given or positive_number(epochs), "--epochs",
            f"must be a finite number > 0, got {epochs}")
    budget = epochs if given else recipe["epochs"]
    require(w0 < budget, f"--epochs {epochs:g}" if given else f"{where}: warmup_epochs",
            f"the recipe's warmup ({where}: warmup_epochs {w0:g}, at base_batch_size) must be "
            f"shorter than training ({budget:g} epochs); train more than {w0:g} epochs (more at a "
            f"larger batch with --scaling legw: its warmup is {w0:g} x k epochs) or shorten "
            f"warmup_epochs" if given else f"{w0:g} epochs of warmup (at base_batch_size) is not "
            f"shorter than training (epochs: {budget:g}); shorten warmup_epochs or train more")
    _check_optimizers(recipe, where)
    clip = recipe.get("grad_clip_norm")
    require(clip is None or positive_number(clip), f"{where}: grad_clip_norm",
            f"must be null or > 0 (the largest global L2 norm of the averaged gradient), got "
            f"{clip!r}")
    check_task_functions(recipe.get("task"), where)
    check_target_metric(recipe, where)
    target = recipe.get("target") or {}
    if "accuracy" in str(target.get("metric", "")) and "value" in target:
        require(0 <= target["value"] <= 1, f"{where}: target.value",
                f"{target['value']!r}: an accuracy is a fraction in [0, 1] (0.98 for 98%)")
    for key in SETTINGS:
        if key in recipe:
            check_setting(key, recipe[key], recipe_where(key, where))
    if recipe.get("sync") is not None:
        check_sync_section(recipe["sync"], where)
