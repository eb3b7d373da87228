"""Reading a recipe: the YAML file (duplicate keys rejected), then :func:`load_recipe`'s checks
(:mod:`hpclb.config.schema`) and :func:`parse_recipe`'s :class:`~hpclb.tasks.spec.Recipe`.

Validation is a pure function of the recipe file, so every rank raises the same error and none
is left waiting in a collective.
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hpclb import schedules
from hpclb._io import read_text_utf8
from hpclb.config.schema import (
    check_builtin_data,
    check_model,
    check_plugin_data,
    check_sample_counts,
    check_settings,
    check_types,
    require,
)
from hpclb.errors import ConfigError
from hpclb.plugins import add_search_path, is_plugin
from hpclb.tasks.spec import Recipe, task_name

__all__ = ["available_experiments", "load_recipe", "parse_recipe", "recipe_path"]


def available_experiments() -> list[str]:
    """Names of the packaged recipes (``hpclb/experiments/*.yaml``; ``_`` read as ``-``)."""
    files = resources.files("hpclb.experiments").iterdir()
    return sorted(f.name[:-5].replace("_", "-") for f in files if f.name.endswith(".yaml"))


def recipe_path(experiment: str) -> Path:
    """The YAML file of a recipe given by packaged name (``mnist-lstm``) or path; ConfigError
    when there is none (naming the choices)."""
    path = Path(experiment)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"experiment file {path} does not exist")
        return path
    packaged = resources.files("hpclb.experiments") / (experiment.replace("-", "_") + ".yaml")
    if packaged.is_file():
        return Path(str(packaged))
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        there = f" (in it: {', '.join(found)})" if found else ""
        raise ConfigError(f"{path} is a directory, not a recipe: a recipe is a .yaml file"
                          f"{there}, or a packaged name, one of {available_experiments()}")
    raise ConfigError(f"unknown experiment {experiment!r}; choose one of "
                      f"{available_experiments()} or give a path to a recipe .yaml")


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


# YAML 1.2 floats: PyYAML implements YAML 1.1, whose float needs a dot, so ``lr: 2e-2`` or
# ``1e3`` would be read as strings; YAML 1.2 (and every JSON reader) reads them as numbers.
_YAML12_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+[eE][-+]?[0-9]+)$""", re.X)
_RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT,
                                    list("-+0123456789."))


def _read_yaml(path: Path) -> Any:
    try:
        text = read_text_utf8(path, "recipes")
    except (OSError, ValueError) as e:
        raise ConfigError(str(e) if isinstance(e, ValueError) else f"{path}: cannot read it "
                          f"({e})") from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e


def _plugin_path(recipe: dict, path: Path, where: str) -> list[str]:
    """The recipe's directory and its ``plugin_path`` entries (relative to it), absolute."""
    extra = recipe.get("plugin_path", [])
    require(isinstance(extra, list) and all(isinstance(d, str) for d in extra),
            f"{where}: plugin_path", f"must be a list of directories (relative to the recipe "
            f"file), e.g. `plugin_path: [src]`, got {extra!r}")
    base = path.resolve().parent
    dirs = [str(base)] + [str((base / d).resolve()) for d in extra]
    for d in dirs[1:]:
        require(Path(d).is_dir(), f"{where}: plugin_path", f"{d} is not a directory")
    return list(dict.fromkeys(dirs))


def load_recipe(experiment: str, epochs: float | None = None) -> dict[str, Any]:
    """Read and validate a recipe by packaged name (``mnist-lstm``) or path to a YAML file.
    ``epochs``: the command line's ``--epochs`` (a number > 0), if any: the budget the warmup
    must be shorter than, instead of the recipe's own ``epochs``.

    Returns the recipe as a dict (:func:`parse_recipe`: as a :class:`Recipe`); a recipe with a
    plug-in ``model.name``/``data.name`` (``package.module:attribute``, :mod:`hpclb.plugins`)
    gets ``plugin_path``: the absolute directories its plug-ins are imported from (the recipe's
    own first), which are put on ``sys.path``. Raises ConfigError naming the offending field (a
    duplicate key with its line); warns (:class:`RecipeWarning`) for valid values outside their
    sensible range. A budget of more than :data:`~hpclb.schedules.MAX_TOTAL_STEPS` epochs is
    refused here, one of more steps at the run's batch when its schedule is made.
    """
    path = recipe_path(experiment)
    recipe = _read_yaml(path)
    require(isinstance(recipe, dict), str(path), "a recipe must be a YAML mapping")
    where = f"{path.name}"
    check_types(recipe, where)
    kind = task_name(recipe.get("task"))
    data, model = recipe["data"], recipe["model"]
    if "plugin_path" in recipe or is_plugin(data["name"]) or is_plugin(model["name"]) or \
            isinstance(recipe.get("task"), dict):  # the task's own loss and metrics
        recipe["plugin_path"] = _plugin_path(recipe, path, where)
        add_search_path(recipe["plugin_path"])
    if is_plugin(data["name"]):
        check_plugin_data(data, kind, where)
    else:
        check_builtin_data(data, kind, where)
    check_sample_counts(data, where)
    check_model(model, kind, where)
    decay = dict(recipe["decay"])
    try:
        schedules.validate_decay(decay.pop("name"), decay)
    except ValueError as e:
        raise ConfigError(f"{where}: decay: {e}") from e
    check_settings(recipe, where, epochs)
    _check_epochs_bound(recipe["epochs"], f"{where}: epochs")
    if epochs is not None:
        _check_epochs_bound(epochs, "--epochs")
    return recipe


def _check_epochs_bound(epochs: float, field: str) -> None:
    """ConfigError naming ``field`` when ``epochs`` alone (every epoch is one optimizer step or
    more) is over :data:`~hpclb.schedules.MAX_TOTAL_STEPS` steps: a slip that would train until
    killed. The steps at the run's batch are checked when its schedule is made."""
    require(epochs <= schedules.MAX_TOTAL_STEPS, field,
            f"{epochs:g} epochs is at least {epochs:.4g} optimizer steps (one or more per "
            f"epoch), more than the {schedules.MAX_TOTAL_STEPS:.0e} steps any run can mean; give "
            f"the training budget in epochs (e.g. 90)")


def parse_recipe(experiment: str) -> Recipe:
    """:func:`load_recipe`, parsed into a frozen :class:`~hpclb.tasks.spec.Recipe`."""
    return Recipe.from_dict(load_recipe(experiment))
