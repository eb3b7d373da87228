"""MNIST (LeCun et al.): 60,000 train / 10,000 test 28x28 grey images in IDX files, raw or
gzip (``<name>.gz``, as LeCun's site and the GPU check's bundle hold them)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hpclb.data.idx import read_idx
from hpclb.data.paths import data_dir
from hpclb.errors import DataError

__all__ = ["FILES", "Split", "load_mnist"]

FILES = {
    "train-images": ("train-images-idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb"),
    "train-labels": ("train-labels-idx1-ubyte", "a25bea736e30d166cdddb491f175f624"),
    "test-images": ("t10k-images-idx3-ubyte", "2646ac647ad5339dbf082846283269ea"),
    "test-labels": ("t10k-labels-idx1-ubyte", "27ae3e4e09519cfbb04c329615203637"),
}
MEAN, STD = 0.1307, 0.3081  # pixel statistics of the training set, on [0, 1]


@dataclass
class Split:
    """One split held in memory: ``images`` uint8 ``[N, 28, 28]``, ``labels`` int64 ``[N]``."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, n: int) -> "Split":
        """The first ``n`` samples (for short smoke runs)."""
        return Split(self.images[:n], self.labels[:n])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised float32 images ``[b, 28, 28]`` and int64 labels ``[b]`` at ``indices``."""
        x = self.images[indices].to(torch.float32).div_(255.0).sub_(MEAN).div_(STD)
        return x, self.labels[indices]


def _file(root: Path, key: str) -> Path:
    """The raw IDX file of ``key`` in ``root``, else its ``.gz`` when only that is there (the
    raw name otherwise, so that a missing file is named as ``hpclb data fetch`` stages it)."""
    raw = root / FILES[key][0]
    gz = raw.with_name(raw.name + ".gz")
    return gz if not raw.is_file() and gz.is_file() else raw


def _load_split(root: Path, images: str, labels: str) -> Split:
    x = read_idx(_file(root, images), ndim=3, dataset="mnist")
    y = read_idx(_file(root, labels), ndim=1, dataset="mnist")
    if len(x) != len(y):
        raise DataError(f"{root}: {len(x)} images but {len(y)} labels in the {images} split")
    if y.size and int(y.max()) > 9:
        raise DataError(f"{_file(root, labels)}: label {int(y.max())} outside 0..9")
    return Split(torch.from_numpy(x.copy()), torch.from_numpy(y.astype("int64")))


def load_mnist(root: str | Path | None = None) -> tuple[Split, Split]:
    """(train, test) from the four IDX files in ``root`` (default ``$HPCLB_DATA/mnist``), each
    raw or gzip (``train-images-idx3-ubyte`` or ``train-images-idx3-ubyte.gz``; raw first).

    ``root`` may also be a directory that directly holds the files. Raises DataError naming a
    missing, corrupt or inconsistent file.
    """
    base = data_dir(root)
    root = base / "mnist" if (base / "mnist").is_dir() else base
    return (_load_split(root, "train-images", "train-labels"),
            _load_split(root, "test-images", "test-labels"))
