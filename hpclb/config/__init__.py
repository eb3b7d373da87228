"""Experiment recipes (YAML) and run settings, validated before any rank starts work.

Every problem is a :class:`ConfigError` whose message names the field and the fix. Validation
is a pure function of the command line and the recipe file, so every rank raises the same error
and none is left waiting in a collective.

- :mod:`hpclb.config.recipe`: reading a recipe (:func:`load_recipe`, :func:`parse_recipe`);
- :mod:`hpclb.config.schema`: the field checks, against the registries of data sets, models,
  optimizers and task kinds;
- :mod:`hpclb.config.fields`: the run settings, each declared once (flag, recipe key, check,
  default, help, docs row);
- :mod:`hpclb.config.settings`: :class:`RunConfig` and :func:`resolve` (recipe + command line).

``DATASETS``, ``OPTIMIZERS`` (tuples of names) and ``TASKS`` (task kind -> the data sets it
reads) are computed from the registries when read, so that registered additions show.
"""
from __future__ import annotations

from hpclb.config.fields import (
    SETTINGS,
    SYNC_SETTINGS,
    RunSettings,
    settings_table,
    sync_settings_table,
)
from hpclb.config.recipe import available_experiments, load_recipe, parse_recipe
from hpclb.config.schema import (
    DEVICES,
    LR_WARN_ABOVE,
    PRECISIONS,
    RECIPE_KEYS,
)
from hpclb.config.settings import (
    COMPILE_MODES,
    OPTIONS,
    RunConfig,
    check_checkpoint_interval,
    check_expect_world_size,
    resolve,
)
from hpclb.errors import ConfigError, RecipeWarning
from hpclb.tasks.spec import (
    DataSpec,
    ModelSpec,
    OptimizerSpec,
    Recipe,
    ScheduleSpec,
    TargetSpec,
)

__all__ = ["COMPILE_MODES", "DATASETS", "DEVICES", "LR_WARN_ABOVE", "OPTIMIZERS", "OPTIONS",
           "PRECISIONS", "RECIPE_KEYS", "SETTINGS", "SYNC_SETTINGS", "TASKS",
           "ConfigError", "DataSpec", "ModelSpec", "OptimizerSpec", "Recipe", "RecipeWarning",
           "RunConfig", "RunSettings", "ScheduleSpec", "TargetSpec", "available_experiments",
           "check_checkpoint_interval", "check_expect_world_size", "load_recipe", "parse_recipe",
           "resolve", "settings_table", "sync_settings_table"]


def __getattr__(name: str):
    if name == "DATASETS":
        from hpclb.data.registry import DATASETS

        return tuple(DATASETS)
    if name == "OPTIMIZERS":
        from hpclb.optim import OPTIMIZERS

        return tuple(OPTIMIZERS)
    if name == "TASKS":
        from hpclb.tasks.registry import TASKS, datasets_of

        return {kind: datasets_of(kind) for kind in TASKS}
    raise AttributeError(f"module 'hpclb.config' has no attribute {name!r}")
