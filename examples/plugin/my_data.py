"""A user's own data for examples/plugin/recipe.yaml (data.name: my_data:mnist_digits).

A data function takes the data directory (``hpclb train --data-dir``, else $HPCLB_DATA, else
./data) and the recipe's other ``data`` keys, and returns (train, test) torch Datasets of
``(x, y)`` pairs with ``y`` an integer class label. This one reads the MNIST IDX files that
`hpclb data fetch mnist` stages, with numpy only, and keeps the digits asked for.
"""
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (big-endian header: 0, 0, dtype 0x08 = uint8, ndim; then the sizes)."""
    raw = path.read_bytes()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class Digits(Dataset):
    """MNIST images, standardised (float32 ``[28, 28]``, mean 0 and std 1 over the training
    set), and their labels (int)."""

    MEAN, STD = 0.1307, 0.3081  # of the training pixels on [0, 1]

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images = torch.from_numpy(images.copy())  # uint8 [n, 28, 28]
        self.labels = labels.astype(np.int64).tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i].to(torch.float32).div_(255.0)
        return (x - self.MEAN) / self.STD, self.labels[i]


def mnist_digits(data_dir: str, digits=tuple(range(10))):
    """(train, test) :class:`Digits` of the ``digits`` classes (labels kept as 0..9)."""
    root = Path(data_dir) / "mnist"
    splits = []
    for prefix in ("train", "t10k"):
        x = read_idx(root / f"{prefix}-images-idx3-ubyte")
        y = read_idx(root / f"{prefix}-labels-idx1-ubyte")
        keep = np.isin(y, list(digits))
        splits.append(Digits(x[keep], y[keep]))
    return splits[0], splits[1]
