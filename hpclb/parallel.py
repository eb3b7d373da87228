"""Gradient synchronisation across ranks, and the start-up checks that make ranks agree.

Today one flat buffer and one Allreduce per step (bucketing overlapped with backward plugs in
behind :class:`GradientSync`). Averaging divides by ``world_size`` exactly once.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .comm import Communicator


class ModelMismatchError(RuntimeError):
    """Ranks hold different models (names, shapes or dtypes)."""


def check_model_consistency(model: nn.Module, comm: Communicator) -> None:
    """Compare every rank's parameter names, shapes and dtypes with rank 0's.

    Every rank raises the same :class:`ModelMismatchError`, naming the first differing parameter
    and rank, so no rank is left waiting in a later collective.
    """
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    everyone = comm.allgather_object(mine)
    ref = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == ref:
            continue
        for i in range(max(len(ref), len(theirs))):
            a = ref[i] if i < len(ref) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                raise ModelMismatchError(
                    f"rank {rank} holds a different model than rank 0: parameter #{i} is "
                    f"{_describe(b)} on rank {rank} but {_describe(a)} on rank 0; every rank must "
                    f"build the same model from the same config")


def _describe(entry) -> str:
    return "missing" if entry is None else f"{entry[0]} {list(entry[1])} {entry[2]}"


@torch.no_grad()
def broadcast_parameters(module: nn.Module, comm: Communicator, root: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``root``'s (one Bcast per tensor)."""
    if comm.world_size == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        comm.broadcast_(t.data, root=root)


class GradientSync:
    """Average gradients across ranks: flatten into one buffer, one Allreduce, divide once.

    Args: ``params`` (the model's parameters, same order on every rank), ``comm``.
    A parameter without a gradient this step contributes zeros (and gets a zero gradient), so
    every rank reduces the same number of bytes. Buffer: fp32, ``sum(numel)`` elements.
    """

    def __init__(self, params: Iterable[nn.Parameter], comm: Communicator):
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.numels = [p.numel() for p in self.params]
        self.buffer = torch.zeros(sum(self.numels), dtype=torch.float32,
                                  device=self.params[0].device if self.params else "cpu")

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @torch.no_grad()
    def synchronize(self) -> None:
        """After backward: every rank's ``p.grad`` becomes the mean over ranks."""
        if self.comm.world_size == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.cat([p.grad.reshape(-1).float() for p in self.params], out=self.buffer)
        self.comm.allreduce_(self.buffer)
        self.buffer.div_(self.comm.world_size)
        for p, flat in zip(self.params, self.buffer.split(self.numels)):
            p.grad.copy_(flat.view_as(p.grad))
