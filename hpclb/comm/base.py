"""The Communicator facade: one object answers rank/size questions and runs the collectives.

Every backend (``mpi``, ``self``; later ``horovod``, ``torch``) implements this interface, so
training code never imports a communication library. Tensors are reduced in place; every rank
must enter every collective in the same order with the same sizes.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor


class Communicator(ABC):
    """Rank/size facts and collectives for one process of a job.

    Attributes: ``backend`` (name), ``rank`` and ``world_size`` (in the job), ``local_rank`` and
    ``local_size`` (on this node).
    """

    backend: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """Reduce ``tensor`` (contiguous; any shape; fp32/fp64/int) across ranks, in place.

        ``op``: ``"sum"``, ``"max"`` or ``"min"``. Returns ``tensor``.
        """

    @abstractmethod
    def broadcast_(self, tensor: Tensor, root: int = 0) -> Tensor:
        """Overwrite ``tensor`` on every rank with ``root``'s, in place. Returns ``tensor``."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank."""

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s picklable ``obj`` on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has entered."""

    @abstractmethod
    def abort(self, code: int = 1) -> None:
        """End every rank of the job now with exit status ``code`` (does not return)."""


def launcher_world_size() -> int | None:
    """The number of ranks the launcher says it started (Open MPI, MPICH/Hydra, SLURM srun), or
    None when this process was not started by a launcher."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS_WORLD"):
        if os.environ.get(var):
            return int(os.environ[var])
    if os.environ.get("SLURM_STEP_ID") is not None and os.environ.get("SLURM_STEP_NUM_TASKS"):
        return int(os.environ["SLURM_STEP_NUM_TASKS"])
    return None
