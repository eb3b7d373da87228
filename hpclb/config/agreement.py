"""The ranks agree on the whole run configuration before the first collective of training.

:func:`run_settings` lists every setting of a :class:`~hpclb.config.RunConfig` that can change a
number (the recipe's content field by field, every command-line choice, the ``HPCLB_*``
gradient-sync variables in force); :func:`agree_run_settings` compares one digest of them across
the ranks (one allgather) and, where any rank's differs, raises the same ConfigError on every
rank naming each setting that differs with rank 0's value and the other ranks'.

Not compared, because they may differ between ranks without changing a number: where a rank
finds or writes files (:data:`LOCATIONS`: ``--out``, of which rank 0's is the run directory,
``--data-dir`` and the recipe's resolved ``plugin_path``, e.g. node-local copies), and what the
launcher gives each rank (its rank, local rank, host, device index). What is found there is
compared by content: :func:`run_fingerprint` (the plug-in modules' source, the data files) and
:func:`agree_fingerprint`, once the plug-ins are imported and the data read.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hpclb.comm.base import Communicator
from hpclb.config.fields import SYNC_SETTINGS
from hpclb.config.settings import OPTIONS
from hpclb.data.registry import dataset
from hpclb.errors import ConfigError
from hpclb.plugins import is_plugin, source_digests
from hpclb.sync.options import AGREED_ENVIRONMENT, in_force

__all__ = ["AGREED_ENVIRONMENT", "FINGERPRINT_PARTS", "LOCATIONS", "agree_fingerprint",
           "agree_run_settings", "config_settings", "run_fingerprint", "run_settings"]

#: RunConfig fields and recipe fields that are locations: each rank may have its own
LOCATIONS = ("out", "data_dir", "recipe.plugin_path")
# the command-line flag of a RunConfig field, where it is not --<field with dashes>
_FLAGS = {"experiment": "EXPERIMENT", **{name: o.flag for name, o in OPTIONS.items()}}
_SHOWN = 8  # differing settings named in the message; the rest are counted
_SETTINGS_FIX = ("every rank must run the same configuration: launch every rank with the same "
                 "command line, the same recipe file content and the same HPCLB_* environment "
                 "variables (--out and --data-dir may differ)")
#: a fingerprint's parts (:func:`run_fingerprint`) and what one entry of each is called
FINGERPRINT_PARTS = {"code": "plug-in module", "data": "data file"}


def run_settings(cfg, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every setting of ``cfg`` (a :class:`~hpclb.config.RunConfig`) the ranks must share, by
    the name the message shows: ``"epochs (--epochs)"``, ``"recipe field model.hidden_size"``,
    ``"$HPCLB_OVERLAP"`` (the value in force: its default when unset), then ``extra`` (the
    command line's other options, named by their flags). Never raises."""
    settings = config_settings(cfg)
    for name in AGREED_ENVIRONMENT:
        settings[f"${name}"] = in_force(name)
    settings.update(extra or {})
    return settings


def config_settings(cfg, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of ``cfg`` (a :class:`~hpclb.config.RunConfig`) but :data:`LOCATIONS` and
    ``skip``, named as :func:`run_settings` names them: each RunConfig field (``epochs``), each
    gradient-sync setting (``sync.compression``), each leaf of the recipe (``recipe.model`` skips
    the whole section, ``recipe.model.hidden_size`` one field). Never raises."""
    settings: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in LOCATIONS or f.name in skip:
            continue
        if f.name == "recipe":
            settings.update(_recipe_fields(value, "recipe", skip))
        elif f.name == "sync":  # each gradient-sync setting by its flag (None: never)
            settings.update({f"sync.{k} ({SYNC_SETTINGS[k].flag})": "never" if v is None else v
                             for k, v in value.items() if f"sync.{k}" not in skip})
        elif f.name == "optimizer_params":  # where they come from: the optimizer's section
            settings[f"{f.name} (the recipe's optimizers.{cfg.optimizer})"] = value
        else:
            settings[f"{f.name} ({_FLAGS.get(f.name, '--' + f.name.replace('_', '-'))})"] = value
    return settings


def _recipe_fields(value, path: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The leaves of the recipe mapping ``value`` under ``path``, as ``recipe field a.b``."""
    if path in LOCATIONS or path in skip:
        return {}
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_recipe_fields(sub, f"{path}.{key}", skip))
        return out
    return {f"recipe field {path.split('.', 1)[1]}": value}


def _canonical(settings: dict[str, Any]) -> dict[str, str]:
    """``settings``' values as JSON text (sorted keys), which compare and print alike."""
    return {k: json.dumps(v, sort_keys=True, default=repr) for k, v in settings.items()}


def agree_run_settings(comm: Communicator, settings: dict[str, Any], *,
                       what: str = "setting(s) of the run", fix: str = _SETTINGS_FIX) -> None:
    """Compare ``settings`` (:func:`run_settings`) across the ranks: one allgather of a SHA-256
    digest (a second, of the settings, only when the digests differ). Collective; a world of
    one returns at once. Raises ConfigError on every rank alike naming each setting that
    differs, rank 0's value and the other ranks', and the fix (``what`` the settings are,
    ``fix``: the message's words)."""
    if comm.world_size == 1:
        return
    mine = _canonical(settings)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    if len(set(comm.allgather_object(digest))) == 1:
        return
    raise ConfigError(_mismatch_message(comm.allgather_object(mine), what, fix))


def run_fingerprint(cfg) -> dict[str, dict[str, str]]:
    """What ``cfg`` trains with, by content: ``{"code": {module: SHA-256 of its source},
    "data": {file: size and digest}}``. Code: the modules the recipe's plug-ins name (model,
    data, task loss and metrics) and every module imported from its ``plugin_path``
    directories (:func:`~hpclb.plugins.source_digests`; call it once they are imported). Data:
    the files the data set's registry entry names (:meth:`~hpclb.data.registry.DataSet.
    fingerprint`; the run directory ``cfg.out`` left out). Raises OSError where a file cannot
    be read."""
    spec = cfg.spec
    refs = (spec.model.name, spec.data.name, spec.task_spec.loss,
            *spec.task_spec.metrics.values())
    modules = [ref.partition(":")[0] for ref in refs if is_plugin(ref)]
    return {"code": source_digests(modules, spec.plugin_path),
            "data": dataset(spec.data.name).fingerprint(cfg.data_dir, spec.data, (cfg.out,))}


def agree_fingerprint(comm: Communicator, fingerprint: dict[str, dict[str, str]]) -> None:
    """Compare :func:`run_fingerprint` across the ranks as :func:`agree_run_settings` does:
    ConfigError on every rank naming each module and file whose content differs, with rank 0's
    digest and the other ranks'. Collective."""
    agree_run_settings(
        comm, {f"{FINGERPRINT_PARTS[part]} {name}": entry
               for part, entries in fingerprint.items() for name, entry in entries.items()},
        what="plug-in module(s) or data file(s) by content",
        fix="every rank must train the same code on the same data: give every node the same "
            "copy of the recipe's plug-in modules and of the data files (a stale node-local "
            "copy?); their paths may differ, their content may not")


def _mismatch_message(everyone: list[dict[str, str]], what: str = "setting(s) of the run",
                      fix: str = _SETTINGS_FIX) -> str:
    """The message for ``everyone`` (each rank's canonical settings, by rank) when they differ:
    each differing setting with its value on rank 0 and on the ranks whose value differs."""
    names = list(everyone[0]) + sorted({k for s in everyone[1:] for k in s} - set(everyone[0]))
    differ = []
    for name in names:
        values = [s.get(name) for s in everyone]
        if len(set(values)) > 1:
            by_value: dict[str | None, list[int]] = {}
            for rank, v in enumerate(values):
                by_value.setdefault(v, []).append(rank)
            first, *others = [f"{_show(v)} on rank{'s' if len(r) > 1 else ''} "
                              f"{', '.join(map(str, r))}" for v, r in by_value.items()]
            differ.append(f"{name} is {first} but {', '.join(others)}")
    more = f" (and {len(differ) - _SHOWN} more)" if len(differ) > _SHOWN else ""
    return f"the ranks disagree on {len(differ)} {what}: {'; '.join(differ[:_SHOWN])}{more}; {fix}"


def _show(canonical: str | None) -> str:
    if canonical is None:
        return "absent"
    if canonical == "null":
        return "unset"
    return canonical if len(canonical) <= 60 else canonical[:57] + "..."
