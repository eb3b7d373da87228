"""``import hpclb.horovod as hvd``: the part of Horovod's PyTorch API that its examples use, over
hpclb's own library (no Horovod needed; ``docs/library.md``, "Porting from Horovod").

Launch under ``mpirun`` / ``srun`` (or ``torchrun``) as hpclb scripts are; ``horovodrun`` is not
needed. What it covers: :func:`init`, :func:`size`, :func:`rank`, :func:`local_rank`,
:func:`local_size`, :func:`DistributedOptimizer` (``named_parameters=``, ``compression=``
(:class:`Compression` ``.none`` / ``.fp16``), ``backward_passes_per_step=``, ``op=``
(:data:`Average` / :data:`Sum`), ``gradient_predivide_factor=``), :func:`broadcast_parameters`,
:func:`broadcast_optimizer_state`, :func:`allreduce`, :func:`allgather`, :func:`broadcast`,
:func:`broadcast_`, :func:`broadcast_object`, :func:`join`, and the ops :data:`Average`,
:data:`Sum`, :data:`Min`, :data:`Max`. What it does not (Adasum, elastic training, process sets,
grouped allreduce) raises :class:`Unsupported`, naming hpclb's alternative.

Semantics are Horovod's where they differ from hpclb's own API: gradients of the
``backward_passes_per_step`` passes are summed (scale the loss by ``1 / passes`` as Horovod's
examples do), then averaged (``op=Average``) or summed (``op=Sum``) over ranks; ``allreduce``
averages by default. Every ``step()`` ends the window, as Horovod's does: ``step()`` after fewer
passes than ``backward_passes_per_step`` (an epoch's short last batch) reduces the passes given
(summed, averaged over ranks: scale each loss by ``1 / passes given``, as Horovod's ImageNet
example does) and makes one update; a pass more than ``backward_passes_per_step`` before
``step()`` raises RuntimeError, as Horovod does. Differences: the averaged gradient of a full
step is ready when its last backward returns (``synchronize()`` has nothing left to do; after a
short one ``synchronize()`` reduces it); averaging an integer tensor raises ValueError (Horovod
rounds it down); ``gradient_predivide_factor`` is checked and changes nothing (hpclb divides
once, before the fp16 cast under compression).
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch

import hpclb.api as _api
from hpclb.sync.agree import ReplicasDiffer
from hpclb.sync.optimizer import DistributedOptimizer as _DistributedOptimizer

__all__ = ["Average", "Compression", "Max", "Min", "Sum", "Unsupported", "Adasum",
           "DistributedOptimizer", "allgather", "allreduce", "broadcast", "broadcast_",
           "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "init",
           "gloo_built", "gloo_enabled", "is_initialized", "join", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
           "shutdown", "size"]


class Unsupported(NotImplementedError, AttributeError):
    """A Horovod feature :mod:`hpclb.horovod` does not provide; the message names the
    alternative. (Also an AttributeError, so ``hasattr(hvd, "elastic")`` is False.)"""


class _Op:
    def __init__(self, name: str, hpclb_op: str | None):
        self.name, self.hpclb_op = name, hpclb_op

    def __repr__(self) -> str:
        return f"hvd.{self.name}"


Average, Sum, Min, Max = _Op("Average", "mean"), _Op("Sum", "sum"), _Op("Min", "min"), \
    _Op("Max", "max")
Adasum = _Op("Adasum", None)
_ADASUM = ("hpclb.horovod has no Adasum: use op=hvd.Average (for large batches with a scaled "
           "learning rate, hpclb.LARS or hpclb.LAMB and hpclb.legw)")
_ELASTIC = ("hpclb.horovod has no elastic training: use hpclb.Checkpointer (preemption-safe "
            "checkpoints; resume the job, at another world size if need be)")


class _Compressor:
    def __init__(self, name: str, hpclb_name: str | None):
        self.name, self.hpclb_name = name, hpclb_name

    def __repr__(self) -> str:
        return f"hvd.Compression.{self.name}"


class Compression:
    """Horovod's gradient compression choices: ``none`` or ``fp16`` (buckets travel in
    float16; hpclb divides each rank's share before the cast)."""

    none = _Compressor("none", None)
    fp16 = _Compressor("fp16", "fp16")


def __getattr__(name: str):
    if name == "elastic":
        raise Unsupported(_ELASTIC)
    if name in ("ProcessSet", "add_process_set", "grouped_allreduce", "alltoall",
                "reducescatter", "sparse_allreduce_async"):
        raise Unsupported(f"hpclb.horovod has no {name}: every collective is over all ranks "
                          f"(hpclb.allreduce, hpclb.allgather, hpclb.broadcast)")
    raise AttributeError(f"module 'hpclb.horovod' has no attribute {name!r}")


# -- the world ------------------------------------------------------------------------------------

def init(comm: Any = None, process_sets: Any = None) -> None:
    """``hvd.init()``: :func:`hpclb.init` (the launcher's ranks; binds this rank's GPU).
    ``comm`` and ``process_sets`` other than None raise :class:`Unsupported`."""
    if comm is not None or process_sets is not None:
        raise Unsupported("hpclb.horovod.init() takes no comm or process_sets: it uses every "
                          "rank the launcher started")
    _api.init()


def is_initialized() -> bool:
    """True after :func:`init`."""
    from hpclb.comm.world import has_communicator

    return has_communicator()


def size() -> int:
    """The number of ranks."""
    return _api.communicator().world_size


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    return _api.communicator().rank


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    return _api.communicator().local_rank


def local_size() -> int:
    """The number of ranks on this node."""
    return _api.communicator().local_size


def shutdown() -> None:
    """``hvd.shutdown()``: nothing to stop (hpclb runs no background thread outside a
    DistributedOptimizer; ``close()`` that). The ranks stay initialised until the process
    exits, so a later :func:`init` keeps them."""


def mpi_built() -> bool:
    """True when mpi4py (hpclb's MPI backend) imports."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def gloo_built() -> bool:
    """True when torch.distributed has Gloo (hpclb's ``torch`` backend on the CPU)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> bool:
    """True when torch.distributed has NCCL (hpclb's ``torch`` backend on GPUs)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def mpi_enabled() -> bool:
    """True when the ranks talk over MPI (backend ``mpi``)."""
    return _api.communicator().backend == "mpi"


def gloo_enabled() -> bool:
    """True when the ranks talk over torch.distributed with Gloo."""
    import torch.distributed as dist

    return _api.communicator().backend == "torch" and dist.get_backend() == "gloo"


def mpi_threads_supported() -> bool:
    """True when MPI was initialised with ``MPI_THREAD_MULTIPLE`` (False without MPI)."""
    if not mpi_built():
        return False
    from hpclb.comm.mpi import import_mpi

    MPI = import_mpi()

    return MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE


# -- the optimizer --------------------------------------------------------------------------------

class _HorovodOptimizer(_DistributedOptimizer):
    """Horovod's loop over GradientSync's one accumulation contract: every ``synchronize()`` /
    ``step()`` ends the window, a short one (fewer passes than ``backward_passes_per_step``)
    reduced there with the passes given (:meth:`~hpclb.sync.gradients.GradientSync.end_window`:
    summed, then divided by the fixed divisor, as Horovod does)."""

    def synchronize(self) -> bool:
        if self.sync.window.reported is None:  # else super() refuses a second call
            self.sync.end_window()
        return super().synchronize()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: _Compressor | None = None,
                         backward_passes_per_step: int = 1, op: _Op = Average,
                         gradient_predivide_factor: float = 1.0, **unsupported):
    """``hvd.DistributedOptimizer``: a :class:`hpclb.DistributedOptimizer` (an instance of
    ``type(optimizer)``) whose gradients are summed over the backward passes of a step (at
    most ``backward_passes_per_step``; every ``step()`` reduces the passes given and updates
    once, as Horovod's does), then averaged (``op=Average``) or summed (``op=Sum``) over
    ranks. ``named_parameters``: the model's ``named_parameters()`` (default: the optimizer's
    parameters, unnamed). ``compression``: :class:`Compression` ``.none`` or ``.fp16``; left
    out, ``$HPCLB_COMPRESSION`` (else none), as in ``hpclb.DistributedOptimizer`` and
    ``hpclb train`` (an argument, like a flag, wins over the variable). Raises
    :class:`Unsupported` for Adasum and for ``num_groups``, ``groups``, ``sparse_as_dense``,
    ``process_set``; ValueError for a bad setting."""
    if unsupported:
        raise Unsupported(f"hpclb.horovod.DistributedOptimizer has no {sorted(unsupported)}: "
                          f"hpclb fuses gradients into buckets itself (fusion_threshold_bytes, "
                          f"$HPCLB_FUSION_THRESHOLD_BYTES) over all ranks")
    if op is Adasum:
        raise Unsupported(_ADASUM)
    if op not in (Average, Sum):
        raise ValueError(f"op={op!r}: the gradient op is hvd.Average or hvd.Sum")
    if compression is not None and not isinstance(compression, _Compressor):
        raise ValueError(f"compression={compression!r}: use hvd.Compression.none or "
                         f"hvd.Compression.fp16")
    if not (gradient_predivide_factor > 0 and math.isfinite(gradient_predivide_factor)):
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a "
                         f"positive number")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor != 1 needs op=hvd.Average (as in Horovod)")
    if named_parameters is None:
        named_parameters = [(f"allreduce.noname.{i}", p) for i, p in
                            enumerate(p for g in optimizer.param_groups for p in g["params"])]
    comm = _api.communicator()
    with warnings.catch_warnings():
        # Horovod's order is to wrap the optimizer, then hvd.broadcast_parameters: replicas
        # that differ here are made rank 0's now, without a warning the next line makes moot
        warnings.simplefilter("ignore", ReplicasDiffer)
        return _HorovodOptimizer(optimizer, list(named_parameters), comm=comm,
                                 accumulation_steps=backward_passes_per_step,
                                 compression=None if compression is None else
                                 compression.hpclb_name or "none",
                                 divisor=comm.world_size if op is Average else 1)


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with rank ``root_rank``'s, in place: ``params`` is a
    ``state_dict()``, ``named_parameters()`` or a list of ``(name, tensor)`` pairs (in the same
    order on every rank: a dict is sorted by name, as Horovod does)."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    comm = _api.communicator()
    if comm.world_size == 1:
        return
    with _api._watched(comm, f"broadcast_parameters of {len(items)} tensors from {root_rank}"):
        for _, t in items:
            comm.broadcast_(t.data, root=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Every rank gets rank ``root_rank``'s optimizer state (a plain torch optimizer or a
    DistributedOptimizer; :func:`hpclb.broadcast_optimizer_state`)."""
    _api.broadcast_optimizer_state(optimizer, root=root_rank)


# -- collectives ----------------------------------------------------------------------------------

def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: _Compressor = Compression.none, op: _Op | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """``hvd.allreduce``: a new tensor, ``tensor`` reduced over ranks with ``op`` (default
    Average; ``average=False`` means Sum), times ``prescale_factor`` before and
    ``postscale_factor`` after. ``name`` and ``compression`` are accepted and unused. Raises
    :class:`Unsupported` for Adasum, ValueError for the mean of an integer tensor."""
    if op is None:
        op = Sum if average is False else Average
    if op is Adasum:
        raise Unsupported(_ADASUM)
    if not isinstance(op, _Op):
        raise ValueError(f"op={op!r}: use hvd.Average, hvd.Sum, hvd.Min or hvd.Max")
    x = tensor * prescale_factor if prescale_factor != 1.0 else tensor
    out = _api.allreduce(x, op=op.hpclb_op)
    return out * postscale_factor if postscale_factor != 1.0 else out


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (:func:`hpclb.allgather`)."""
    return _api.allgather(tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root_rank``'s, in place; returns it."""
    return _api.broadcast(tensor, root=root_rank)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A new tensor holding rank ``root_rank``'s ``tensor`` (the input is left as it is)."""
    return _api.broadcast(tensor.detach().clone(), root=root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank."""
    return _api.broadcast_object(obj, root=root_rank)


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``; returns the rank that joined last. Unlike
    Horovod's, it does not stand in for the collectives of ranks that finished early: give
    every rank the same number of steps (:func:`hpclb.shard_loader` does)."""
    comm = _api.communicator()
    if comm.world_size == 1:
        return 0
    # labelled for the stall watchdog: a rank that joins while another still steps is reported
    # as in "hvd.join()" against that rank's gradient allreduce, naming the fix
    with _api._watched(comm, "hvd.join() (hpclb's join does not stand in for the gradient "
                             "allreduces of ranks still stepping: give every rank the same "
                             "number of steps, e.g. with hpclb.shard_loader)"):
        times = comm.allgather_object(time.time())
    return max(range(len(times)), key=times.__getitem__)
