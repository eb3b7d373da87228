"""Datasets: readers for standard formats, staging from packages, sharding by rank."""
import os
from pathlib import Path

from hpclb.errors import DataError


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The data directory: ``explicit``, else ``$HPCLB_DATA``, else ``./data``."""
    return Path(explicit or os.environ.get("HPCLB_DATA") or "data")


def load_dataset(name: str, root: str | os.PathLike | None = None, *,
                 train_samples: int | None = None, test_samples: int | None = None,
                 augment: bool = True):
    """(train, test) splits of data set ``name``, read from ``root`` (see :func:`data_dir`),
    optionally cut to their first ``train_samples`` / ``test_samples`` samples.

    ``augment``: whether ImageNet's training split draws the random-resized-crop + flip
    augmentation (:class:`hpclb.data.images.ImageFolder`); the other data sets have none.

    Each split has ``len()``, ``subset(n)`` and ``batch(indices) -> (inputs, targets)``.
    Raises DataError for an unknown name or a missing/corrupt file.
    """
    if name == "mnist":
        from hpclb.data.mnist import load_mnist
        train, test = load_mnist(root)
    elif name == "fashion-mnist":
        from hpclb.data.images import load_fashion_mnist
        train, test = load_fashion_mnist(root)
    elif name == "imagenet":
        from hpclb.data.images import load_imagenet
        train, test = load_imagenet(root, augment=augment)
    elif name == "synthetic":  # throughput runs: ImageNet-sized random images
        from hpclb.data.images import SyntheticImages
        train, test = SyntheticImages(1_281_167, seed=0), SyntheticImages(50_000, seed=1)
    else:
        raise DataError(f"unknown data set {name!r}")
    return (train.subset(train_samples) if train_samples else train,
            test.subset(test_samples) if test_samples else test)
