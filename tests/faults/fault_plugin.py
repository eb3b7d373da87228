"""A plug-in model and data set that fail on purpose, for the fault matrix (tests/faults).

The tests copy this file beside a recipe in a temporary folder (``model.name:
fault_plugin:FaultyMLP``, ``data.name: fault_plugin:blobs``). The fault is chosen by environment
variables, read at the first training forward, so a resumed run without them trains normally:

- ``FAULT_MODE``: ``raise`` (RuntimeError), ``kill`` (SIGKILL this rank), ``nan`` (NaN logits
  from then on), ``signal`` (send ``FAULT_SIGNAL`` to this process, then carry on);
- ``FAULT_RANK``: the rank that fails (``OMPI_COMM_WORLD_RANK``; 0 for 1 process);
- ``FAULT_STEP``: the training forward (1-based, = the global step with accumulation 1) at
  which it happens, counted in this process.

``FAULT_RECORD_DIR``: every training batch's sample indices are appended, one line per batch, to
``<dir>/rank<r>.txt`` (to check that each sample is drawn exactly once per epoch).
"""
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


def _rank() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


class Blobs(Dataset):
    """``n`` points of ``dim`` float32 features in 4 Gaussian classes (fixed seed: the same on
    every rank); ``record``: log the indices each batch draws."""

    def __init__(self, n: int, dim: int, seed: int, record: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        centres = torch.randn(4, dim, generator=torch.Generator().manual_seed(99)) * 2
        self.x = centres[self.y] + torch.randn(n, dim, generator=g)
        self.record = record and os.environ.get("FAULT_RECORD_DIR")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

    def __getitems__(self, indices):
        if self.record:
            with open(Path(self.record) / f"rank{_rank()}.txt", "a") as f:
                f.write(" ".join(str(int(i)) for i in indices) + "\n")
        return [(self.x[i], int(self.y[i])) for i in indices]


def blobs(data_dir: str, n_train: int = 1024, n_test: int = 256, dim: int = 16):
    """(train, test) :class:`Blobs`; ``data_dir`` is unused (the data is generated)."""
    return Blobs(n_train, dim, seed=1, record=True), Blobs(n_test, dim, seed=2)


class FaultyMLP(nn.Module):
    """``[b, dim]`` float32 -> logits ``[b, 4]``, failing as the FAULT_* variables say."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 4))
        self.forwards = 0

    def forward(self, x):
        out = self.net(x)
        if not self.training:
            return out
        self.forwards += 1
        mode, rank = os.environ.get("FAULT_MODE"), int(os.environ.get("FAULT_RANK", "0"))
        if mode and _rank() == rank and self.forwards >= int(os.environ["FAULT_STEP"]):
            first = self.forwards == int(os.environ["FAULT_STEP"])
            if mode == "raise":
                raise RuntimeError(f"fault_plugin: injected failure at forward {self.forwards}")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "nan":
                return out * float("nan")
            if mode == "signal" and first:
                os.kill(os.getpid(), getattr(signal, os.environ["FAULT_SIGNAL"]))
        return out
