"""Plug-in data sets (``data.name: package.module:function``) as classification splits, or as
splits of ``(x, y)`` with any ``y`` for a task with its own loss (``task: supervised``)."""
from __future__ import annotations

import torch

from hpclb.data.paths import data_dir
from hpclb.data.registry import DataSet
from hpclb.errors import ConfigError
from hpclb.plugins import load_object
from hpclb.tasks.base import DatasetSplit
from hpclb.tasks.registry import PLUGIN_DATA_TASKS

__all__ = ["PLUGIN_DATA_RESERVED", "load_plugin_data", "plugin_dataset"]

# data-section keys hpclb reads itself; the others are a plug-in data function's arguments
PLUGIN_DATA_RESERVED = ("name", "train_samples", "test_samples")


def _check_split(split, which: str, spec: str, class_labels: bool = True) -> DatasetSplit:
    """``split`` must be a non-empty sized dataset whose sample 0 is ``(x, y)``, y an integer
    when ``class_labels``."""
    field = f"data.name {spec!r}"
    if not (hasattr(split, "__len__") and hasattr(split, "__getitem__")):
        raise ConfigError(f"{field}: its {which} split is a {type(split).__name__}, not a torch "
                          f"Dataset with __len__ and __getitem__ (e.g. a TensorDataset)")
    if len(split) == 0:
        raise ConfigError(f"{field}: its {which} split is empty")
    sample = split[0]
    ok = isinstance(sample, (tuple, list)) and len(sample) == 2
    if ok and not class_labels:
        return DatasetSplit(split, where=field, class_labels=False)
    y = sample[1] if ok else None
    if ok and isinstance(y, torch.Tensor):
        ok = y.numel() == 1 and not y.is_floating_point() and not y.is_complex()
    elif ok:
        ok = hasattr(y, "__index__") and not isinstance(y, bool)
    if not ok:
        y_rule = " with y an integer class label (int or integer tensor)" if class_labels else ""
        raise ConfigError(f"{field}: sample 0 of its {which} split is {type(sample).__name__} "
                          f"{str(sample)[:80]!r}, not an (x, y) pair{y_rule}")
    return DatasetSplit(split, where=field)


def load_plugin_data(data, data_root, *,
                     class_labels: bool = True) -> tuple[DatasetSplit, DatasetSplit]:
    """(train, test) of a plug-in data set: ``data["name"]`` is ``package.module:function``,
    called as ``function(str(data_dir(data_root)), **kwargs)`` with the data section's keys
    other than :data:`PLUGIN_DATA_RESERVED` (``data``: the data section, a dict or a
    :class:`~hpclb.tasks.spec.DataSpec`); it must return two torch Datasets of ``(x, y)``
    (``y`` an integer class label when ``class_labels``).

    Raises ConfigError (naming data.name) when it does not import or returns the wrong thing."""
    spec = data.get("name")
    fn = load_object(spec, "data.name")
    kwargs = {k: v for k, v in _options(data).items() if k not in PLUGIN_DATA_RESERVED}
    out = fn(str(data_dir(data_root)), **kwargs)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ConfigError(f"data.name {spec!r} returned {type(out).__name__} {str(out)[:80]!r}; "
                          f"a data function returns a pair (train_dataset, test_dataset)")
    return (_check_split(out[0], "train", spec, class_labels),
            _check_split(out[1], "test", spec, class_labels))


def _options(data) -> dict:
    """The data section's keys and values (a dict, or a DataSpec's name and options)."""
    return {"name": data.name, **data.options} if hasattr(data, "options") else dict(data)


def _read(root, data):
    return load_plugin_data(data, root)


def _read_any_y(root, data):
    return load_plugin_data(data, root, class_labels=False)


def plugin_dataset(name: str, kind: str = "classification") -> DataSet:
    """The plug-in data function ``name`` (``package.module:function``) as a data set that a
    ``kind`` task reads (:mod:`hpclb.data.registry`'s interface): integer class labels for
    classification, any ``y`` for a task with its own loss. Its ``tasks`` are
    :data:`~hpclb.tasks.registry.PLUGIN_DATA_TASKS`."""
    return DataSet(name, _read if kind == "classification" else _read_any_y, PLUGIN_DATA_TASKS)
