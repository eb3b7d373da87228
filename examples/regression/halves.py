"""A regression plug-in for examples/regression/recipe.yaml: complete the lower half of an MNIST
digit from its upper half (image completion, a real-valued target of 392 pixels per sample).

Everything a recipe names lives here and none of it imports hpclb:

- ``mnist_halves(data_dir)``: the data function, (train, test) torch Datasets of ``(x, y)``:
  ``x`` the upper 14 rows, ``y`` the lower 14 rows (float32 ``[14, 28]`` each, pixels
  standardised with the training set's mean and standard deviation);
- ``Completer``: the model, ``[b, 14, 28] -> [b, 14, 28]``;
- ``mse`` / ``mae``: the loss and the metrics, ``fn(output, y) -> the batch's mean`` (a scalar
  tensor). Predicting the mean image gives a test MSE of about 1 (the standardised variance).
"""
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

MEAN, STD = 0.1307, 0.3081  # of MNIST's training pixels on [0, 1]


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (big-endian header: 0, 0, dtype 0x08 = uint8, ndim; then the sizes)."""
    raw = path.read_bytes()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _split(images: np.ndarray) -> TensorDataset:
    x = (torch.from_numpy(images.astype(np.float32) / 255.0) - MEAN) / STD
    return TensorDataset(x[:, :14].contiguous(), x[:, 14:].contiguous())


def mnist_halves(data_dir: str):
    """(train, test): 60,000 and 10,000 digits of ``data_dir/mnist`` (`hpclb data fetch mnist`)
    as (upper half, lower half) pairs."""
    root = Path(data_dir) / "mnist"
    return (_split(_read_idx(root / "train-images-idx3-ubyte")),
            _split(_read_idx(root / "t10k-images-idx3-ubyte")))


class Completer(nn.Module):
    """Upper half ``[b, 14, 28]`` -> lower half ``[b, 14, 28]`` (float32): a two-layer
    perceptron on the 392 pixels."""

    def __init__(self, hidden_size: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(392, hidden_size), nn.ReLU(),
                                 nn.Linear(hidden_size, 392), nn.Unflatten(1, (14, 28)))

    def forward(self, x):
        return self.net(x)


def mse(output, y):
    """Mean squared error per pixel over the batch (float32 scalar)."""
    return torch.mean((output.float() - y) ** 2)


def mae(output, y):
    """Mean absolute error per pixel over the batch (float32 scalar)."""
    return torch.mean(torch.abs(output.float() - y))
