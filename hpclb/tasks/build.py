"""The task of a recipe: its kind (:data:`~hpclb.tasks.registry.TASKS`) over its data set
(:data:`~hpclb.data.registry.DATASETS`, or a plug-in data function)."""
from __future__ import annotations

from typing import Mapping

from hpclb.data.registry import dataset
from hpclb.plugins import add_search_path, is_plugin
from hpclb.tasks.base import Task
from hpclb.tasks.plugin import plugin_dataset
from hpclb.tasks.registry import TASKS
from hpclb.tasks.spec import Recipe, as_recipe

__all__ = ["build_task"]


def build_task(recipe: Recipe | Mapping, data_root, *, train_samples=None,
               test_samples=None) -> Task:
    """The task of ``recipe`` (a :class:`~hpclb.tasks.spec.Recipe` or a recipe mapping; ``task``
    default ``classification``) with its data loaded from ``data_root``; a plug-in
    ``data.name`` (``package.module:function``) is read through
    :func:`~hpclb.tasks.plugin.load_plugin_data`. Raises DataError for an unknown data set or
    missing/corrupt data, ValueError for an unknown kind, ConfigError for a plug-in that does
    not load or returns the wrong thing.
    """
    spec = as_recipe(recipe)
    if spec.plugin_path:
        add_search_path(spec.plugin_path)
    if spec.task not in TASKS:
        raise ValueError(f"unknown task kind {spec.task!r}")
    name = spec.data.name
    ds = plugin_dataset(name, spec.task) if is_plugin(name) else dataset(name)
    if spec.task not in ds.tasks:
        raise ValueError(f"data set {name!r} does not feed a {spec.task} task (it feeds "
                         f"{', '.join(ds.tasks)})")
    return TASKS[spec.task].task_class().from_recipe(
        ds.load(data_root, spec.data), spec, train_samples=train_samples,
        test_samples=test_samples)
