"""Timing shared by the benchmarks: per-iteration times agreed across ranks, variants
interleaved round by round (shuffled, or rotated: :func:`round_order`), the statistics kept
(fastest and median round, median and range), ring-allreduce bus bandwidth, and the conditions
a measurement was taken under."""
from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from typing import Callable

import torch

__all__ = ["Timer", "best", "busbw", "conditions", "interleaved", "iterations", "med",
           "median_range", "round_order"]

MiB = 2 ** 20


def busbw(nbytes: int, seconds: float, p: int) -> float:
    """Ring allreduce bus bandwidth in bytes/s (0 for one rank: nothing moves)."""
    return 0.0 if p == 1 or seconds <= 0 else 2 * (p - 1) / p * nbytes / seconds


class Timer:
    """Per-iteration wall time agreed across ranks: the slowest rank's, so that one number
    describes the collective. ``comm`` is any Communicator."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, fn: Callable[[], None]) -> float:
        self.comm.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        return float(self.comm.allreduce_(dt, op="max").item())


def iterations(nbytes: int, quick: bool) -> int:
    """Timed rounds for an allreduce of ``nbytes`` bytes: 3 from 64 MiB, 5 from 4 MiB, 20 below;
    with ``quick`` half of that, at least 2."""
    base = 3 if nbytes >= 64 * MiB else 5 if nbytes >= 4 * MiB else 20
    return max(2, base // 2) if quick else base


def interleaved(variants: dict[str, Callable[[], None]], timer: Timer, rounds: int,
                warmup: int = 1, seed: int = 0) -> dict[str, list[float]]:
    """Run every variant once per round, in an order shuffled each round (the same on every
    rank: a seeded generator), so no variant always follows the same neighbour; returns the
    times per variant."""
    import random
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    order, rng = list(variants), random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            times[k].append(timer(variants[k]))
    return times


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order of the variants ``names``: rotated left by ``r`` (ABC, BCA, CAB, ABC,
    ...; two alternate, AB, BA), so that load drifting between rounds hits all of them alike."""
    k = r % len(names)
    return names[k:] + names[:k]


def median_range(key: str, xs: list[float], range_key: str | None = None) -> dict:
    """The summary of rounds ``xs``: ``{key: median, range_key: [min, max]}`` (``range_key``
    default ``key + "_range"``)."""
    return {key: statistics.median(xs), range_key or f"{key}_range": [min(xs), max(xs)]}


#: the median of the round times (seconds); StatisticsError when there are none
med = statistics.median
#: the fastest round: other processes on a shared machine only ever add time, so the minimum is
#: the closest estimate of a variant's own cost (ratios use it; medians are kept beside them)
best = min


def conditions(comm) -> dict:
    """What a measurement ran under, for its JSON: host, CPU count, ranks, torch version and
    threads, the MPI library (first line of its version string), Python version, the 1/5/15-minute
    load averages at the start and the local date and time."""
    from mpi4py import MPI
    return {"host": socket.gethostname(), "cpus": os.cpu_count(),
            "ranks": comm.world_size, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
