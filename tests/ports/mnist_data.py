"""The model and data of the ported MNIST scripts: the Net of Horovod's PyTorch MNIST example,
and MNIST from the staged IDX files (the first ``samples`` training and ``samples // 2`` test
images), normalised as the example's transforms do."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpclb.data.idx import read_idx


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def _split(root: Path, prefix: str, n: int | None):
    images = torch.from_numpy(read_idx(root / f"{prefix}-images-idx3-ubyte", ndim=3)[:n].copy())
    labels = torch.from_numpy(read_idx(root / f"{prefix}-labels-idx1-ubyte", ndim=1)[:n].copy())
    x = (images.float().unsqueeze(1) / 255 - 0.1307) / 0.3081
    return torch.utils.data.TensorDataset(x, labels.long())


def mnist(data_dir: str, samples: int | None):
    root = Path(data_dir)
    return _split(root, "train", samples), _split(root, "t10k", samples and samples // 2)
