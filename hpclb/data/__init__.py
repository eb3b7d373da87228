"""Datasets: readers for standard formats, staging from packages, sharding by rank."""
import os
from pathlib import Path


class DataError(RuntimeError):
    """A data file is missing, truncated or not what its name says."""


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The data directory: ``explicit``, else ``$HPCLB_DATA``, else ``./data``."""
    return Path(explicit or os.environ.get("HPCLB_DATA") or "data")


def load_dataset(name: str, root: str | os.PathLike | None = None):
    """(train, test) splits of data set ``name``, read from ``root`` (see :func:`data_dir`).

    Each split has ``len()`` and ``batch(indices) -> (inputs, targets)``.
    Raises DataError for an unknown name or a missing/corrupt file.
    """
    if name == "mnist":
        from .mnist import load_mnist
        return load_mnist(root)
    raise DataError(f"unknown data set {name!r}")
