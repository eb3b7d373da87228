"""A plug-in model and data set with one non-finite training step, for tests/test_skipped_steps.py.

The test copies this file beside a recipe (``model.name: nonfinite_plugin:SpikyMLP``,
``data.name: nonfinite_plugin:blobs``). ``NONFINITE_MODE`` chooses the fault, at training forward
``NONFINITE_STEP`` (1-based, counted in this process) on rank ``NONFINITE_RANK``
(``OMPI_COMM_WORLD_RANK``; 0 for one process; ``all``: every rank), once:

- ``overflow``: the logits times 1e5 in fp16, which overflows to inf (the loss and the gradient
  are not finite), as an fp16 forward overflows;
- ``nan_sample``: the first sample's logits are NaN (one bad sample on one rank);
- ``nan_from``: all logits NaN from that forward on (a divergence);
- ``nan_test``: one feature of the first test sample is NaN (bad evaluation data; training is
  untouched).
"""
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset


def blobs(data_dir: str, n_train: int = 1024, n_test: int = 256, dim: int = 16):
    """(train, test): ``dim`` float32 features in 4 Gaussian classes (fixed seeds);
    ``data_dir`` is unused (the data is generated)."""
    centres = torch.randn(4, dim, generator=torch.Generator().manual_seed(99)) * 2

    def split(n, seed):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 4, (n,), generator=g)
        return TensorDataset(centres[y] + torch.randn(n, dim, generator=g), y)

    train, test = split(n_train, 1), split(n_test, 2)
    if os.environ.get("NONFINITE_MODE") == "nan_test":
        test.tensors[0][0, 0] = float("nan")
    return train, test


class SpikyMLP(nn.Module):
    """``[b, dim]`` float32 -> logits ``[b, 4]``; one training forward non-finite as the
    NONFINITE_* variables say."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 4))
        self.forwards = 0

    def forward(self, x):
        out = self.net(x)
        if not self.training:
            return out
        self.forwards += 1
        mode = os.environ.get("NONFINITE_MODE")
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        at = int(os.environ.get("NONFINITE_STEP", "0"))
        if mode == "nan_from" and os.environ.get("NONFINITE_RANK", "0") in (rank, "all") \
                and self.forwards >= at:
            return out * float("nan")
        if (mode and os.environ.get("NONFINITE_RANK", "0") in (rank, "all")
                and self.forwards == at):
            if mode == "overflow":
                return (out.to(torch.float16) * 1e5).to(out.dtype)
            if mode == "nan_sample":
                return torch.cat([out[:1] * float("nan"), out[1:]])
        return out
