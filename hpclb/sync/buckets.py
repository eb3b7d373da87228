"""Gradient buckets: how :class:`~hpclb.sync.gradients.GradientSync` packs gradients
(:func:`plan_buckets`), and one bucket's buffers and per-step state (:class:`Bucket`, built by
:func:`make_bucket` with every gradient view at an ``ALIGN_BYTES``-aligned offset)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from hpclb.comm.base import Handle
from hpclb.sync.options import DEFAULT_FIRST_BUCKET_BYTES, MiB

__all__ = ["ALIGN_BYTES", "Bucket", "bucket_zeros", "make_bucket", "plan_buckets"]

ALIGN_BYTES = 16  # every gradient view starts at a multiple of this many bytes in its bucket
HUGE_PAGE_MIN_BYTES = 4 * MiB  # numpy's threshold for asking for huge pages


def plan_buckets(nbytes: list[int], fusion_threshold_bytes: int,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 keys: list | None = None) -> list[list[int]]:
    """How :class:`GradientSync` packs tensors of ``nbytes`` (bytes each, registration order):
    lists of indices, in the order the buckets are reduced. Tensors are taken in reverse order
    (backward produces the last layers' gradients first); a bucket closes before a tensor that
    would take it past its cap (``first_bucket_bytes`` for the first, ``fusion_threshold_bytes``
    after) or whose key (dtype, device) differs; a tensor larger than the cap gets its own."""
    groups: list[list[int]] = []
    cap, cur, cur_bytes = first_bucket_bytes, [], 0
    for i in reversed(range(len(nbytes))):
        if cur and (cur_bytes + nbytes[i] > cap or
                    (keys is not None and keys[i] != keys[cur[0]])):
            groups.append(cur)
            cur, cur_bytes, cap = [], 0, fusion_threshold_bytes
        cur.append(i)
        cur_bytes += nbytes[i]
    if cur:
        groups.append(cur)
    return groups


@dataclass
class Bucket:
    """Gradients reduced together: ``buffer`` holds them back to back (the params' ``.grad``
    are views of it); ``comm_buffer`` is what travels (``buffer`` itself, or its fp16/bf16
    copy)."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    buffer: Tensor
    comm_buffer: Tensor
    predivide: bool = False
    views: list[Tensor] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)
    used: list[bool] = field(default_factory=list)
    pending: int = 0
    seq: int = 0
    handle: Handle | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    launched: bool = False
    local_sq: Tensor | None = None
    stream: dict = field(default_factory=dict)
    ready_event: Any = None      # CUDA event recorded by the hook once the bucket is complete
    reduced_event: Any = None    # CUDA event recorded after the collective (thread overlap)
    what: str = ""               # the bucket in a stall report (describe())

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def describe(self, n: int) -> None:
        """Set :attr:`what`, the bucket as a stall report names it (``n``: buckets in all),
        once at construction: a step's label is ``"step <s> " + what``."""
        self.what = (f"gradient bucket {self.index + 1}/{n} ({self.nbytes / MiB:.2f} MiB "
                     f"{str(self.comm_buffer.dtype).replace('torch.', '')}, {len(self.params)} "
                     f"tensors from {self.names[0]})")


def bucket_zeros(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero-filled 1-D bucket buffer of ``n`` elements (``dtype``, ``device``). On the CPU,
    from ``HUGE_PAGE_MIN_BYTES`` on, its memory comes from numpy, which asks the kernel for
    transparent huge pages (``madvise``; torch's allocator does not unless
    ``THP_MEM_ALLOC_ENABLE=1``): the MPI library copies every bucket through shared memory,
    and ``MPI_Allreduce`` of ResNet-50's six 25-MiB buckets took 23.0–23.9 ms on such buffers
    against 27.1–27.5 on ``torch.zeros`` ones (medians, 2 ranks, same job; docs/results.md)."""
    nbytes = n * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES:
        return torch.zeros(n, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype)


def make_bucket(index: int, params: list[nn.Parameter], names: list[str],
                compression: torch.dtype | None) -> Bucket:
    """Bucket ``index`` holding ``params`` (one dtype and device) back to back, each view at an
    ``ALIGN_BYTES``-aligned offset; every ``p.grad`` becomes its view (an existing gradient is
    copied in). ``compression``: the dtype floating-point buckets travel in, or None."""
    align = max(1, ALIGN_BYTES // params[0].element_size())
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() // align) * align
    buf = bucket_zeros(total, params[0].dtype, params[0].device)
    comm_dtype = compression if (compression is not None and
                                 params[0].dtype.is_floating_point) else None
    cbuf = buf if comm_dtype is None or comm_dtype == buf.dtype else \
        bucket_zeros(total, comm_dtype, buf.device)
    b = Bucket(index, params, names, offsets, buf, cbuf, predivide=comm_dtype is not None)
    for p, off in zip(params, offsets):
        view = buf[off:off + p.numel()].view_as(p)
        if p.grad is not None:
            view.copy_(p.grad)
        p.grad = view
        b.views.append(view)
    b.ready = [False] * len(params)
    b.used = [False] * len(params)
    b.pending = len(params)
    return b
