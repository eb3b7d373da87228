"""A recipe parsed once into frozen dataclasses: what the code reads instead of ``recipe["..."]``.

:func:`hpclb.config.load_recipe` validates the YAML (every message names the field);
:meth:`Recipe.from_dict` then turns the validated mapping into a :class:`Recipe`. Parsing is
lenient (absent fields get their defaults) so that a partial mapping, such as
``{"data": {"name": "imagenet"}}``, still builds a task. :meth:`Recipe.to_dict` gives back the
mapping as read, key order included, for what is written to disk (``config.json``, checkpoints).
No torch here.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

__all__ = ["DataSpec", "ModelSpec", "OptimizerSpec", "Recipe", "ScheduleSpec", "TargetSpec",
           "TaskSpec", "as_recipe", "LOWER_IS_BETTER", "metric_mode", "primary_metric",
           "show_metric", "task_name"]

def _section(value: Any) -> tuple[str, Mapping[str, Any]]:
    """``(name, the other keys)`` of a ``{name: ..., ...}`` section (a copy)."""
    value = dict(value or {})
    return value.pop("name", ""), value


@dataclass(frozen=True)
class DataSpec:
    """The ``data`` section: ``name`` (a registered data set or a plug-in
    ``package.module:function``) and the reader's ``options`` (every other key)."""

    name: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping | None) -> DataSpec:
        return cls(*_section(data))

    def get(self, key: str, default: Any = None) -> Any:
        """Option ``key`` (``name`` too), else ``default``; as ``dict.get`` on the section."""
        return self.name if key == "name" else self.options.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key == "name" or key in self.options

    @property
    def train_samples(self) -> int | None:
        """The first N training samples only (a smoke-run subset); None: all."""
        return self.options.get("train_samples")

    @property
    def test_samples(self) -> int | None:
        return self.options.get("test_samples")


@dataclass(frozen=True)
class ModelSpec:
    """The ``model`` section: ``name`` and its constructor's keyword arguments ``kwargs``."""

    name: str = ""
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, model: Mapping | None) -> ModelSpec:
        return cls(*_section(model))


@dataclass(frozen=True)
class ScheduleSpec:
    """The ``decay`` section: the LR decay ``name`` and its ``params`` (hpclb/schedules.py)."""

    name: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, decay: Mapping | None) -> ScheduleSpec:
        return cls(*_section(decay))


@dataclass(frozen=True)
class OptimizerSpec:
    """One entry of ``optimizers``: the optimizer ``name`` and its hyper-parameters at B0."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


def task_name(task: Any) -> str:
    """The kind a recipe's ``task`` field names: the string itself, a mapping's ``name``, or
    ``classification`` when absent (also for a mapping without a name)."""
    if isinstance(task, Mapping):
        task = task.get("name")
    return task if isinstance(task, str) else "classification"


@dataclass(frozen=True)
class TaskSpec:
    """The ``task`` section: ``name`` (the kind, e.g. ``supervised``), and for a task that
    takes them, the ``loss`` function (``package.module:function``) and the ``metrics``
    (metric name -> ``package.module:function``), each ``fn(output, y) -> scalar tensor``, the
    batch mean. ``task: classification`` (a string) is ``TaskSpec("classification")``."""

    name: str = "classification"
    loss: str | None = None
    metrics: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_value(cls, task: Any) -> TaskSpec:
        if not isinstance(task, Mapping):
            return cls(task_name(task))
        return cls(task_name(task), task.get("loss"), dict(task.get("metrics") or {}))


@dataclass(frozen=True)
class TargetSpec:
    """The ``target`` section: time-to-target metric, value and mode (None: not given)."""

    metric: str | None = None
    value: float | None = None
    mode: str | None = None

    @classmethod
    def from_dict(cls, target: Mapping | None) -> TargetSpec | None:
        if target is None:
            return None
        return cls(**{k: v for k, v in dict(target).items() if k in ("metric", "value", "mode")})


#: words in a metric's name that make lower better; any other metric (accuracy, BLEU) is maximised
LOWER_IS_BETTER = ("loss", "perplexity", "error", "mse", "mae")


def _target_of(recipe: Any) -> Mapping:
    if recipe is None:
        return {}
    if isinstance(recipe, Recipe):
        t = recipe.target
        return {"metric": t.metric, "mode": t.mode} if t else {}
    return dict(recipe.get("target") or {})


def metric_mode(metric: str, recipe: Recipe | Mapping | None = None) -> str:
    """``"max"`` or ``"min"``: which way ``metric`` improves. The one place that decides it: the
    ``target.mode`` of ``recipe`` (a :class:`Recipe` or a recipe mapping) when its
    ``target.metric`` is ``metric``; else ``"min"`` for a name holding one of
    :data:`LOWER_IS_BETTER` (losses, perplexities, error rates, mse/mae), else ``"max"``
    (accuracy, top-1, BLEU)."""
    target = _target_of(recipe)
    if target.get("mode") and target.get("metric") == metric:
        return target["mode"]
    return "min" if any(w in metric for w in LOWER_IS_BETTER) else "max"


def show_metric(metric: str, value: float) -> str:
    """``value`` of ``metric`` as the console shows it: accuracies in percent (2 decimals, e.g.
    `` 61.72%``), perplexity and BLEU with 2 decimals, anything else with 4."""
    if "accuracy" in metric:
        return f"{100 * value:6.2f}%"
    return f"{value:.2f}" if "perplexity" in metric or "bleu" in metric else f"{value:.4f}"


def primary_metric(recipe: Recipe | Mapping) -> str:
    """The metric a recipe is judged by (sweeps, plots): its ``target.metric``; else, for a task
    with its own ``metrics``, ``test_<the first>``; else ``test_loss`` for such a task and
    ``test_accuracy`` for the others."""
    target = _target_of(recipe)
    if target.get("metric"):
        return target["metric"]
    task = as_recipe(recipe).task_spec
    if task.loss is not None:
        return f"test_{next(iter(task.metrics))}" if task.metrics else "test_loss"
    return "test_accuracy"


@dataclass(frozen=True)
class Recipe:
    """A recipe (hpclb/experiments/*.yaml). Its run settings (``accumulation_steps``,
    ``device``, ...: :data:`hpclb.config.fields.SETTINGS`) are resolved from ``raw``, the
    mapping as read, into :class:`hpclb.config.RunConfig`, not parsed here. Frozen:
    treat the mappings inside as read-only too (they are copies of the recipe's)."""

    name: str = ""
    task: str = "classification"
    task_spec: TaskSpec = TaskSpec()
    data: DataSpec = DataSpec()
    model: ModelSpec = ModelSpec()
    base_batch_size: int | None = None
    epochs: float | None = None
    warmup_epochs: float | None = None
    decay: ScheduleSpec = ScheduleSpec()
    optimizer: str | None = None
    optimizers: Mapping[str, OptimizerSpec] = field(default_factory=dict)
    grad_clip_norm: float | None = None
    target: TargetSpec | None = None
    tuning: str | None = None
    per_gpu_batch: int | None = None
    plugin_path: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, recipe: Mapping) -> Recipe:
        """Parse a (validated, or partial) recipe mapping; ``raw`` keeps a deep copy of it."""
        r = dict(recipe)
        task = r.pop("task", None)
        sections = {"task": task_name(task), "task_spec": TaskSpec.from_value(task),
                    "data": DataSpec.from_dict(r.pop("data", None)),
                    "model": ModelSpec.from_dict(r.pop("model", None)),
                    "decay": ScheduleSpec.from_dict(r.pop("decay", None)),
                    "target": TargetSpec.from_dict(r.pop("target", None)),
                    "plugin_path": tuple(r.pop("plugin_path", None) or ()),
                    "optimizers": {k: OptimizerSpec(k, dict(v)) for k, v in
                                   (r.pop("optimizers", None) or {}).items()}}
        known = {f.name for f in fields(cls)} - set(sections) - {"raw"}
        r = {k: v for k, v in r.items() if k in known}
        return cls(**r, **sections, raw=copy.deepcopy(dict(recipe)))

    def to_dict(self) -> dict[str, Any]:
        """The recipe mapping as read (a deep copy: the caller may change it)."""
        return copy.deepcopy(dict(self.raw))

    def optimizer_spec(self, name: str | None = None) -> OptimizerSpec:
        """The hyper-parameters of optimizer ``name`` (default: the recipe's ``optimizer``)."""
        return self.optimizers[name or self.optimizer]


def as_recipe(recipe: Recipe | Mapping) -> Recipe:
    """``recipe`` as a :class:`Recipe` (a mapping, e.g. a run's config.json, is parsed)."""
    return recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe)
