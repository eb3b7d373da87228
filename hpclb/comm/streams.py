"""The CUDA stream, event, pinned-memory and device operations that the backends' host staging
(:class:`hpclb.comm.mpi.HostStaging`) and the gradient-sync communication thread
(:class:`hpclb.sync.reduction.ThreadDriver`) need, for one device: one seam, so that tests on the
CPU pass a stand-in with the same methods that records every call."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TorchCudaAPI"]


class TorchCudaAPI:
    """The CUDA operations of one device through torch (tests pass a stand-in with the same
    methods)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def bind_thread(self) -> None:
        """Make this device current for the calling thread (a new thread starts on device 0,
        where its first CUDA call would open a context: on a multi-GPU node, every rank's)."""
        torch.cuda.set_device(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def new_event(self):
        return torch.cuda.Event()

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def pinned(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy(self, dst: Tensor, src: Tensor, stream) -> None:
        """``dst.copy_(src)`` enqueued on ``stream`` (asynchronous for pinned host memory)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: Tensor, stream) -> None:
        """Tell the caching allocator ``stream`` uses ``tensor`` (no early reuse of its
        memory)."""
        tensor.record_stream(stream)
