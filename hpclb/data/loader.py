"""A training split read by ``torch.utils.data.DataLoader`` worker processes, step by step.

Decoding JPEGs one by one in the training thread leaves a GPU idle, so a split that reads its
samples from files (:class:`~hpclb.data.images.ImageFolder`) is read by ``num_workers``
processes that prefetch the next steps' batches while the current one trains. The batches are
exactly the single-thread path's: :class:`StepBatchSampler` yields, for each step ``i`` of the
epoch and each micro-batch ``part`` of ``parts``, the indices the task's ``_part_indices(i,
part, parts)`` gives (this rank's share of the :class:`~hpclb.data.sampler.GlobalBatchSampler`
batch, cut into contiguous parts), skipping empty parts as the training loop does; each sample
travels with the epoch (``(epoch, index)`` keys), because a persistent worker's copy of the
split never sees ``set_epoch``, and its augmentation is seeded by ``(seed, epoch, index)``
(:func:`~hpclb.data.images.sample_seed`). So the loader changes where samples are decoded,
never which samples or pixels a step sees; tests/test_loader.py checks bit equality.

Settings: ``pin_memory`` when the run's device is CUDA (the host-to-device copy then runs
``non_blocking``); persistent workers (started once per run, not per epoch); ``prefetch_factor``
batches per worker in flight. Under MPI the workers are started with ``forkserver`` (Open MPI
does not support ``fork()`` after ``MPI_Init`` with some transports), else the platform default;
the fork server starts with USR2 blocked, so the job templates' preemption signal reaches the
rank alone, and each worker ends with its rank.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hpclb.comm.env import local_size
from hpclb.comm.launcher import process_alive

__all__ = ["MAX_DEFAULT_WORKERS", "EpochKeyed", "StepBatchSampler", "StepLoader",
           "check_shard_loader_args", "default_num_workers", "pin_batch"]

# A worker decodes a few hundred ImageNet-sized JPEGs per second (make bench-loader,
# docs/recipes.md); 16 per rank feed a GPU, and each worker holds a copy of the split's file list.
MAX_DEFAULT_WORKERS = 16


def pin_batch(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (CPU) in page-locked memory, contiguous, for a ``non_blocking`` copy to a GPU.

    A strided view is made contiguous first: ``pin_memory()`` pins a view's whole storage span
    (a PTB window ``x[rows, s]``, ``[b, bptt]`` of streams ``T`` tokens long, would pin about
    ``b * T`` tokens, the rank's whole share) and the copy to the GPU of a non-contiguous tensor
    goes through a pageable contiguous copy, which is synchronous. Needs a CUDA build of torch.
    """
    return tensor.contiguous().pin_memory()


# DataLoader arguments that decide which samples a step reads: shard_loader sets them itself
_OWNED = {"shuffle": "every epoch is already a seeded permutation (seed=, then "
                     "loader.batch_sampler.set_epoch(e) each epoch)",
          "sampler": "the global-batch sampler is shard_loader's own",
          "batch_sampler": "the global-batch sampler is shard_loader's own"}


def check_shard_loader_args(batch_size, world_size: int, loader_kwargs: dict) -> None:
    """Raise ValueError naming the argument for what ``hpclb.shard_loader`` cannot take:
    ``batch_size`` not an int >= ``world_size`` (it is the global batch), or a DataLoader
    argument it sets itself (``shuffle``, ``sampler``, ``batch_sampler``), with the reason."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"shard_loader: batch_size must be a positive int (the global batch, "
                         f"samples per step over all ranks), got {batch_size!r}")
    if batch_size < world_size:
        raise ValueError(f"shard_loader: batch_size={batch_size} (the global batch) must be >= "
                         f"the world size {world_size}")
    for name in sorted(_OWNED.keys() & loader_kwargs.keys()):
        raise ValueError(f"shard_loader: {name}= is not accepted: {_OWNED[name]}; remove "
                         f"{name}={loader_kwargs[name]!r}")


def default_num_workers() -> int:
    """Loader workers per rank by default: the rank's CPUs minus one (its training thread), at
    most :data:`MAX_DEFAULT_WORKERS`. The rank's CPUs are those this process may run on
    (``os.sched_getaffinity``), divided by the ranks on the node (the launcher's local size)
    unless the launcher already bound each rank to its own CPUs (affinity smaller than the
    machine). 0 (read in the training thread) on a one-CPU share."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    if cpus >= (os.cpu_count() or cpus):  # not bound per rank: share the node's CPUs
        cpus //= local_size()
    return min(MAX_DEFAULT_WORKERS, cpus - 1) if cpus > 1 else 0


class EpochKeyed(Dataset):
    """``split`` as a map-style Dataset keyed by ``(epoch, index)``: item ``(e, i)`` is
    ``split.sample(i, e)``, an ``(x, y)`` pair (x a tensor: uint8 images of an ImageFolder,
    y an int class id)."""

    def __init__(self, split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        return self.split.sample(index, epoch)


class StepBatchSampler(Sampler):
    """The batch sampler of one epoch from ``first_step``: for step ``i`` in ``[first_step,
    steps)`` and ``part`` in ``[0, parts)``, the keys ``(epoch, index)`` of
    ``part_indices(i, part, parts)``; empty parts are skipped (the loop reads none).

    Mutable: :meth:`start` sets the epoch, first step, step count and parts before the loader
    is iterated (a persistent DataLoader keeps its batch sampler)."""

    def __init__(self, part_indices: Callable[[int, int, int], torch.Tensor]):
        self.part_indices = part_indices
        self.epoch, self.first_step, self.steps, self.parts = 0, 0, 0, 1

    def start(self, epoch: int, first_step: int, steps: int, parts: int) -> None:
        self.epoch, self.first_step, self.steps, self.parts = epoch, first_step, steps, parts

    def keys(self) -> Iterator[tuple[int, int]]:
        """``(step, part)`` of each batch this sampler yields, in order."""
        for i in range(self.first_step, self.steps):
            for part in range(self.parts):
                if len(self.part_indices(i, part, self.parts)):
                    yield i, part

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for i, part in self.keys():
            yield [(self.epoch, int(j)) for j in self.part_indices(i, part, self.parts)]

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())


def _mp_context() -> str | None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        return None  # the platform's fork: workers inherit the rank's flag-only handlers
    _start_forkserver_shielded()
    return "forkserver"


def _start_forkserver_shielded() -> None:
    """Start multiprocessing's fork server (and its resource tracker) with USR2 blocked.

    The job templates pass the scheduler's preemption signal on with ``scancel --signal=USR2``,
    which SLURM delivers to every process of the job's steps, not only the ranks; with the
    default action it ended the loader workers, the fork server and the resource tracker while
    the rank's handler asked for a checkpoint, and the rank's next batch failed (exit 1) instead
    of exiting 75. The blocked mask passes through exec to the fork server and through fork to
    every worker it starts, so only the rank handles USR2. TERM is left alone: the rank's
    ``terminate()`` of its workers needs it. A fork server already running is left as it is."""
    from multiprocessing import forkserver

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_init(owner: int, _worker_id: int) -> None:
    """``worker_init_fn`` of a StepLoader created by process ``owner`` (the rank): a worker whose
    parent is not its rank (the fork server's) ends within a second of the rank's death. torch's
    watchdog ends a worker when its parent dies, but the fork server lives as long as its
    workers do (each holds the server's keep-alive pipe), so a rank killed outright (SIGKILL, the
    OOM killer) left both behind for good."""
    if os.getppid() != owner:
        threading.Thread(target=_exit_when_gone, args=(owner,), name="hpclb-rank-watch",
                         daemon=True).start()


def _exit_when_gone(owner: int) -> None:
    while process_alive(owner):
        time.sleep(1.0)
    os._exit(0)


class StepLoader:
    """Batches of a split in the training loop's order, read ahead by DataLoader workers.

    Args:
        split: has ``len()`` and ``sample(index, epoch) -> (x, y)`` (an ImageFolder).
        part_indices: the task's ``(i, part, parts) -> int64 indices``.
        steps_per_epoch: steps of a whole epoch (the sampler reads ahead up to its end).
        num_workers: worker processes (>= 1; use the split's ``batch`` directly for 0).
        pin_memory: pin batches in page-locked memory (for a CUDA device).
        prefetch_factor: batches in flight per worker (>= 1).

    :meth:`batch` ``(epoch, i, part, parts)`` returns ``(x, y)`` as ``split.batch`` would (x
    ``[n, ...]``, uint8 images for an ImageFolder, y int64 ``[n]``); asked for anything but the
    next batch in order (a resumed epoch, another ``parts``) it restarts the workers' queue at
    that step.
    """

    def __init__(self, split, part_indices, *, steps_per_epoch: int, num_workers: int,
                 pin_memory: bool = False, prefetch_factor: int = 2):
        if num_workers < 1 or prefetch_factor < 1:
            raise ValueError(f"StepLoader: num_workers {num_workers} and prefetch_factor "
                             f"{prefetch_factor} must be >= 1 (num_workers 0: call "
                             f"split.batch in the training thread)")
        self.steps_per_epoch = steps_per_epoch
        self.sampler = StepBatchSampler(part_indices)
        self.loader = DataLoader(EpochKeyed(split), batch_sampler=self.sampler,
                                 num_workers=num_workers, pin_memory=pin_memory,
                                 persistent_workers=True, prefetch_factor=prefetch_factor,
                                 multiprocessing_context=_mp_context(),
                                 worker_init_fn=functools.partial(_worker_init, os.getpid()))
        self._it: Iterator | None = None
        self._next: Iterator | None = None   # the (epoch, step, part, parts) expected next
        self._expected: tuple | None = None

    def _restart(self, epoch: int, i: int, parts: int) -> None:
        self.sampler.start(epoch, i, self.steps_per_epoch, parts)
        self._next = ((epoch, s, p, parts) for s, p in self.sampler.keys())
        self._expected = next(self._next, None)
        self._it = iter(self.loader)

    def batch(self, epoch: int, i: int, part: int, parts: int):
        if self._it is None or self._expected != (epoch, i, part, parts):
            self._restart(epoch, i, parts)
            while self._expected is not None and self._expected[1:3] < (i, part):
                self._expected = next(self._next, None)  # empty parts before the one asked
                next(self._it)
        if self._expected != (epoch, i, part, parts):
            raise IndexError(f"StepLoader: no batch for step {i} part {part} of {parts} in "
                             f"epoch {epoch} (an empty share or a step outside the epoch)")
        x, y = next(self._it)
        self._expected = next(self._next, None)
        return x, y

    def close(self) -> None:
        """Stop the worker processes now (else they stop when the loader is collected)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
