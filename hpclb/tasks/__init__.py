"""Kinds of workload the training loop runs: what a batch is, the loss, and the eval metrics.

The interface is :class:`~hpclb.tasks.base.Task` (documented there); the kinds are in
:data:`~hpclb.tasks.registry.TASKS`: :mod:`~hpclb.tasks.classification`,
:mod:`~hpclb.tasks.language_model`, :mod:`~hpclb.tasks.seq2seq`,
:mod:`~hpclb.tasks.supervised` (the recipe's own loss and metrics); plug-in data sets in
:mod:`~hpclb.tasks.plugin`; :func:`~hpclb.tasks.build.build_task` builds a recipe's task; the
parsed recipe is :class:`~hpclb.tasks.spec.Recipe`.

The names below are imported on first use (PEP 562), so that the registries and the recipe
types load without torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EVAL_BATCH_SIZE": "base", "DatasetSplit": "base", "Task": "base", "to_device": "base",
    "ClassificationTask": "classification", "LanguageModelTask": "language_model",
    "Seq2seqTask": "seq2seq", "SupervisedTask": "supervised", "PLUGIN_DATA_RESERVED": "plugin",
    "load_plugin_data": "plugin", "build_task": "build", "TASKS": "registry",
    "TaskKind": "registry", "Recipe": "spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"hpclb.tasks.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpclb.tasks' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
