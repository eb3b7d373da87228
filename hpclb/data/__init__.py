"""Datasets: readers for standard formats, staging from packages, sharding by rank.

The data sets by name are in :mod:`hpclb.data.registry`; the data directory is
:func:`hpclb.data.paths.data_dir`. Neither imports torch.
"""
from __future__ import annotations

import os

from hpclb.data.paths import data_dir
from hpclb.data.registry import DATASETS, DataSet, dataset, register_dataset, subset_splits

__all__ = ["DATASETS", "DataSet", "data_dir", "dataset", "load_dataset", "register_dataset"]


def load_dataset(name: str, root: str | os.PathLike | None = None, *,
                 train_samples: int | None = None, test_samples: int | None = None,
                 augment: bool = True):
    """(train, test) splits of the classification data set ``name`` (:data:`DATASETS`), read
    from ``root`` (see :func:`data_dir`), optionally cut to their first ``train_samples`` /
    ``test_samples`` samples.

    ``augment``: whether ImageNet's training split draws the random-resized-crop + flip
    augmentation (:class:`hpclb.data.images.ImageFolder`); the other data sets have none.

    Each split has ``len()``, ``subset(n)`` and ``batch(indices) -> (inputs, targets)``.
    Raises DataError for an unknown name or a missing/corrupt file, ConfigError for more
    ``train_samples``/``test_samples`` than a split holds.
    """
    from hpclb.errors import DataError

    ds = DATASETS.get(name)
    if ds is None or "classification" not in ds.tasks:
        raise DataError(f"unknown data set {name!r}")
    train, test = ds.load(root, {"name": name, "augment": augment})
    return subset_splits(train, test, train_samples, test_samples, name, prefix="")
