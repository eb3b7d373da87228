"""The run settings a recipe may set and ``hpclb train`` may override, each declared once.

A setting is one field of :class:`RunSettings` made by :func:`setting`: its name (the recipe
field and the :class:`~hpclb.config.settings.RunConfig` attribute), type, default, flag, check,
what a valid value is (with its unit: the error message and the docs) and the ``--help`` text.
From that one declaration come the command-line flag (:func:`add_setting_flags`), the recipe key
(:data:`SETTINGS` is part of :data:`hpclb.config.schema.RECIPE_KEYS`), the check with its one
message (:func:`check_setting`, for the recipe and the flag alike), the value a run uses
(:func:`setting_value`: the command line, else the recipe, else the default) and the table of
docs/cli.md (:func:`settings_table`, compared with the page by ``tests/test_docs.py``).

Adding a setting is one :func:`setting` field here plus the code that reads
``cfg.<name>``. The options only the command line sets (``--batch-size``, ``--seed``, ...) are
:class:`~hpclb.config.settings.RunConfig` fields made by :func:`option` alike. The gradient-sync
settings (the recipe's ``sync:``) are declared, parsed and checked with the library's, in
:mod:`hpclb.sync.options`; their flags and table are made here. Torch-free: ``hpclb train
--help`` builds its flags from here.
"""
from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NamedTuple

from hpclb.errors import ConfigError, RecipeWarning
from hpclb.sync.options import SYNC_SETTINGS, SyncSetting, parse_sync, resolve_sync

__all__ = ["DEVICES", "PRECISIONS", "SETTINGS", "SYNC_SETTINGS", "Option", "RunSettings",
           "Setting", "SyncSetting", "add_option_flags", "add_setting_flags", "check_setting",
           "check_sync_section", "option", "recipe_where", "resolve_options",
           "resolve_sync", "setting", "setting_value", "settings_table", "sync_settings_table"]

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")


class Setting(NamedTuple):
    """One declared run setting (see :func:`setting`); ``default`` and ``flag`` come first so
    that ``SETTINGS[name][0]`` / ``[1]`` read as they always did."""

    default: Any
    flag: str
    check: Callable[[Any], bool]
    valid: str
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    warn_above: tuple[int, str] | None = None


def setting(default: Any, flag: str, check: Callable[[Any], bool], valid: str, help: str, *,
            metavar: str | None = None, choices: tuple[str, ...] | None = None,
            warn_above: tuple[int, str] | None = None):
    """A :class:`RunSettings` field: ``default``; ``flag`` (``--log-every``); ``check(value)``
    -> bool; ``valid``: what a valid value is, with its unit (``"an integer >= 1 (...)"``);
    ``help``: the flag's ``--help`` text (its default is added); ``metavar``; ``choices`` (the
    flag's); ``warn_above``: ``(limit, why)``, a value above ``limit`` warns
    (:class:`~hpclb.errors.RecipeWarning`)."""
    return field(default=default, metadata={"setting": Setting(
        default, flag, check, valid, help, metavar, choices, warn_above)})


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The settings a recipe sets and the command line overrides (``--flag`` wins), with their
    defaults; :class:`~hpclb.config.settings.RunConfig` holds them resolved."""

    accumulation_steps: int = setting(
        1, "--accumulation-steps", _int_at_least(1),
        "an integer >= 1 (micro-batches per optimizer step; 1: no accumulation)",
        "gradient accumulation: each rank runs K micro-batches of B / (ranks x K) samples per "
        "optimizer step, one allreduce per step; the global batch B (and so LR/warmup "
        "scaling) is unchanged", metavar="K")
    device: str = setting(
        "auto", "--device", lambda v: v in DEVICES,
        f"one of {', '.join(DEVICES)} (auto: cuda when a GPU is visible, else cpu)",
        "where each rank trains (auto: its local rank's GPU when CUDA is available, else the "
        "CPU)", choices=DEVICES)
    precision: str = setting(
        "fp32", "--precision", lambda v: v in PRECISIONS,
        f"one of {', '.join(PRECISIONS)} (the compute dtype of the forward and backward "
        f"passes; bf16/fp16 need a GPU that has them)",
        "compute precision (autocast; fp16 with a loss scaler; parameters stay fp32)",
        choices=PRECISIONS)
    log_every: int = setting(
        50, "--log-every", _int_at_least(0),
        "an integer >= 0 (optimizer steps between progress lines; 0: off)",
        "a metrics.jsonl step line every STEPS optimizer steps (0: off)", metavar="STEPS")
    noise_scale: bool = setting(
        False, "--noise-scale", lambda v: isinstance(v, bool),
        "true or false (measure the gradient noise scale B_simple)",
        "measure the gradient noise scale B_simple (needs >= 2 ranks; `hpclb advise` reads it)")
    max_nonfinite_steps: int = setting(
        3, "--max-nonfinite-steps", _int_at_least(1),
        "an integer >= 1 (consecutive optimizer steps with a non-finite loss or gradient, each "
        "skipped, before the run stops)",
        "stop (exit 3) after N non-finite steps in a row, each skipped", metavar="N",
        warn_above=(100, "a run with that many non-finite steps in a row has diverged"))
    keep_checkpoints: int = setting(
        2, "--keep-checkpoints", _int_at_least(1),
        "an integer >= 1 (checkpoint generations kept in the run directory; the newest is used "
        "on --resume, older ones if it is damaged)",
        "checkpoint generations kept, each verified by SHA-256", metavar="K",
        warn_above=(100, "each generation is a full model + optimizer copy on disk"))


#: recipe field -> its declaration, in declaration order
SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(RunSettings)}


def check_setting(name: str, value: Any, where: str) -> Any:
    """``value`` of setting ``name``, checked: ConfigError ``"<where>: must be <valid>, got
    <value>"`` (``where`` names its source: the recipe field or the flag); a RecipeWarning above
    its ``warn_above`` limit."""
    s = SETTINGS[name]
    if not s.check(value):
        raise ConfigError(f"{where}: must be {s.valid}, got {value!r}")
    if s.warn_above is not None and value > s.warn_above[0]:
        warnings.warn(f"{where}: {value} is above {s.warn_above[0]}: {s.warn_above[1]}",
                      RecipeWarning, stacklevel=3)
    return value


def recipe_where(name: str, where: str) -> str:
    """How an error names setting ``name`` read from recipe ``where``."""
    return f"{where}: {name} (or {SETTINGS[name].flag})"


def setting_value(name: str, given: Any, recipe: dict) -> Any:
    """The value a run uses: the command line's ``given`` (checked), else the recipe's (checked
    when the recipe was loaded), else the default."""
    if given is not None:
        return check_setting(name, given, f"{SETTINGS[name].flag} (recipe field {name})")
    value = recipe.get(name)
    return SETTINGS[name].default if value is None else value


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (default None: the recipe's value, else the declared default), and
    one per gradient-sync setting (:data:`SYNC_SETTINGS`; default None: ``$HPCLB_*``, else the
    recipe's ``sync:`` section, else the declared default)."""
    for name, sync in SYNC_SETTINGS.items():
        parser.add_argument(sync.flag, dest=name, default=None, metavar=sync.metavar,
                            help=f"{sync.help} (default: ${sync.env}, else the recipe's "
                                 f"sync.{name}, else {sync.shown})")
    for name, s in SETTINGS.items():
        shown = str(s.default).lower() if isinstance(s.default, bool) else s.default
        kwargs: dict[str, Any] = {"dest": name, "default": None,
                                  "help": f"{s.help} (default: the recipe's {name}, else "
                                  f"{shown})"}
        if isinstance(s.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif s.choices is not None:
            kwargs["choices"] = s.choices
        else:
            kwargs.update(type=type(s.default), metavar=s.metavar)
        parser.add_argument(s.flag, **kwargs)


def settings_table() -> str:
    """The Markdown table of docs/cli.md: recipe field, flag, default, valid values."""
    rows = ["| recipe field | flag | default | valid values |", "|---|---|---|---|"]
    for name, s in SETTINGS.items():
        default = str(s.default).lower() if isinstance(s.default, bool) else s.default
        flag = f"{s.flag}/--no-{s.flag[2:]}" if isinstance(s.default, bool) else s.flag
        rows.append(f"| `{name}` | `{flag}` | `{default}` | {s.valid} |")
    return "\n".join(rows) + "\n"


class Option(NamedTuple):
    """One declared option of a run that the command line sets, not the recipe (:func:`option`)."""

    default: Any
    flag: str
    check: Callable[[Any], bool] | None
    problem: Callable[[Any], str] | None
    help: str | None
    keyword: str | None
    from_recipe: Callable[[Any], Any] | None
    column: str | None
    flag_args: dict


def option(default: Any, flag: str, help: str | None = None, *,
           check: Callable[[Any], bool] | None = None, problem: Callable[[Any], str] | None = None,
           keyword: str | None = None, from_recipe: Callable[[Any], Any] | None = None,
           column: str | None = None, **flag_args):
    """A :class:`~hpclb.config.settings.RunConfig` field set by flag ``flag`` (``help``;
    ``flag_args``: argparse's ``type``, ``choices``, ``nargs``, ...), else ``default`` (None:
    ``from_recipe(recipe)``); ``check(value)`` -> bool, else ConfigError ``"<flag>:
    <problem(value)>"``; ``keyword``: the flag's ``dest`` and ``resolve()``'s keyword;
    ``column``: the ``hpclb compare`` column that shows it (config.json records every field)."""
    return field(default=default, metadata={"option": Option(
        default, flag, check, problem, help, keyword, from_recipe, column, flag_args)})


def add_option_flags(parser: argparse.ArgumentParser, options: dict[str, Option]) -> None:
    """One flag per :func:`option` (its ``dest``: the keyword, else the field's name)."""
    for name, o in options.items():
        parser.add_argument(o.flag, dest=o.keyword or name, default=o.default, help=o.help,
                            **o.flag_args)


def resolve_options(options: dict[str, Option], given: dict[str, Any], recipe: Any) -> dict:
    """Each of ``options``' value (field -> value), given (by keyword) or default, checked."""
    values = {}
    for name, o in options.items():
        value = given.get(o.keyword or name, o.default)
        if value is None and o.from_recipe is not None:
            value = o.from_recipe(recipe)
        if o.check is not None and not o.check(value):
            raise ConfigError(f"{o.flag}: {o.problem(value)}")
        values[name] = value
    return values


def check_sync_section(section: Any, where: str) -> None:
    """The recipe's ``sync:`` section: a mapping of :data:`SYNC_SETTINGS` names to valid
    values; ConfigError naming the field and what is valid."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: sync: must be a mapping of {', '.join(SYNC_SETTINGS)}, "
                          f"e.g. `sync: {{compression: bf16}}`, got {section!r}")
    for name, value in section.items():
        if name not in SYNC_SETTINGS:
            raise ConfigError(f"{where}: sync.{name}: not a gradient-sync setting; they are "
                              f"{', '.join(SYNC_SETTINGS)}")
        parse_sync(name, value, f"{where}: sync.{name}")


def sync_settings_table() -> str:
    """The Markdown table of docs/cli.md's gradient-sync settings: recipe field, flag,
    variable, default, valid values."""
    rows = ["| recipe field | flag | variable | default | valid values |", "|---|---|---|---|---|"]
    for name, s in SYNC_SETTINGS.items():
        rows.append(f"| `sync.{name}` | `{s.flag}` | `{s.env}` | `{s.shown}` | {s.valid} |")
    return "\n".join(rows) + "\n"
