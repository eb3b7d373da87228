"""hpclb's gradient-sync schedule for one step of a projected workload: which buckets, in which
order, released when (shared by the closed form and the SimGrid replay).

Buckets are :func:`hpclb.sync.buckets.plan_buckets` of the workload's gradient tensors (first
bucket ``DEFAULT_FIRST_BUCKET_BYTES``, then the fusion threshold), in the order GradientSync
reduces them. A step is forward for ``(1 - backward_share) * compute_s`` seconds, then backward
for ``backward_share * compute_s``; a tensor is ready at ``forward + fraction * backward`` with
its fraction from the measured backward profile (:mod:`hpclb.bench.backward_profile`), and a
bucket at the moment its last tensor is ready. Buckets are reduced one after another (hpclb's
communication thread, like NCCL's stream, runs one collective at a time).
"""
from __future__ import annotations

from typing import Callable

__all__ = ["bucket_schedule", "pipeline_end"]


def bucket_schedule(tensor_bytes: list[int], ready_fraction: list[float], compute_s: float,
                    backward_share: float, fusion_bytes: int,
                    wire_bytes_per_byte: float = 1.0,
                    first_bucket_bytes: int | None = None) -> list[list[float]]:
    """``[[bytes on the wire, ready_s], ...]`` per bucket in reduction order: ``tensor_bytes``
    (bytes per gradient tensor, registration order) packed at ``fusion_bytes``, ready moments
    from ``ready_fraction`` (one per tensor, in [0, 1] of the backward) scaled to a backward of
    ``backward_share * compute_s`` seconds that ends at ``compute_s``; ``wire_bytes_per_byte``:
    0.5 for fp16 compression; ``first_bucket_bytes``: hpclb's small first bucket unless given
    (Horovod has none: pass ``fusion_bytes``). Raises ValueError when the two lists differ in
    length."""
    from hpclb.sync.buckets import plan_buckets
    from hpclb.sync.options import DEFAULT_FIRST_BUCKET_BYTES
    if len(tensor_bytes) != len(ready_fraction):
        raise ValueError(f"backward profile has {len(ready_fraction)} tensors, the workload "
                         f"{len(tensor_bytes)}: measure it again (python -m "
                         f"hpclb.bench.backward_profile)")
    backward_start = (1 - backward_share) * compute_s
    backward_s = backward_share * compute_s
    return [[wire_bytes_per_byte * sum(tensor_bytes[i] for i in group),
             backward_start + backward_s * max(ready_fraction[i] for i in group)]
            for group in plan_buckets(tensor_bytes, fusion_bytes,
                                      first_bucket_bytes or DEFAULT_FIRST_BUCKET_BYTES)]


def pipeline_end(buckets: list[list[float]], allreduce_s: Callable[[float], float]) -> float:
    """When the last bucket's allreduce ends (s from the step's start): each bucket starts once it
    is ready and the previous one has finished, and takes ``allreduce_s(bytes)`` seconds."""
    end = 0.0
    for nbytes, ready in buckets:
        end = max(end, ready) + allreduce_s(nbytes)
    return end
