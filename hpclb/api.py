"""The library surface: a one-process training script becomes a multi-rank LEGW script.

Five calls, as in Horovod's torch API::

    comm = hpclb.init()                                          # rank, world_size, device
    hpclb.broadcast_parameters(model)                            # same start on every rank
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    sched = hpclb.legw(opt, base_batch_size=128, batch_size=1024, num_samples=len(train),
                       epochs=10, base_warmup_epochs=0.25)       # peak LR 0.1*sqrt(8), ...
    loader = hpclb.shard_loader(train, batch_size=1024)          # this rank's part of the batch

Launch the script under ``mpirun``, ``srun`` or ``torchrun`` (``backend="auto"`` picks MPI or
torch.distributed from the launcher); with plain ``python`` it runs as one rank.
Source of the schedules: You et al., *Large-Batch Training for LSTM and Beyond*, SC '19.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpclb.dist.base import Communicator
from hpclb.dist.world import current_communicator, get_communicator, has_communicator
from hpclb.optim.lr_scheduler import ScheduleLR
from hpclb.schedules import Schedule

__all__ = ["init", "communicator", "broadcast_parameters", "broadcast_optimizer_state", "legw",
           "linear_scaling", "sqrt_scaling", "no_scaling", "shard_loader", "share_weight",
           "mean_over_ranks"]


def init(backend: str = "auto", device: str = "auto", *, share_gpu: bool = False) -> Communicator:
    """Start (or return) this process's communicator and bind its device.

    ``backend``: ``auto`` (MPI under mpirun/srun, torch.distributed under torchrun, one process
    otherwise), ``mpi``, ``torch``, ``horovod`` or ``self``. ``device``: ``auto`` (this rank's
    GPU, ``cuda:<local_rank % visible GPUs>``, when CUDA is available, else the CPU), ``cpu`` or
    ``cuda``; ``share_gpu`` allows more ranks than GPUs on a node. Returns the
    :class:`~hpclb.dist.base.Communicator` (``rank``, ``world_size``, ``local_rank``, ``device``);
    calling it again returns the same one. Raises ConfigError (a ValueError) when the launcher
    and backend do not fit, or the device cannot be had.
    """
    if not has_communicator():
        get_communicator(backend, device=device, share_gpu=share_gpu)
    return current_communicator()


def communicator() -> Communicator:
    """The communicator :func:`init` made (the one :func:`hpclb.dist.world.get_communicator` holds).
    Raises RuntimeError naming the fix before init."""
    return current_communicator()


def broadcast_parameters(model: nn.Module, comm: Communicator | None = None, root: int = 0) -> None:
    """Make every rank's parameters and buffers rank ``root``'s (one broadcast per tensor), after
    checking that every rank built the same model (names, shapes, dtypes: ModelMismatchError on
    every rank otherwise, naming the first difference)."""
    from hpclb.sync.agree import broadcast_parameters as _bcast
    from hpclb.sync.agree import check_model_consistency

    comm = comm or communicator()
    check_model_consistency(model, comm)
    _bcast(model, comm, root=root)


def broadcast_optimizer_state(optimizer, comm: Communicator | None = None, root: int = 0) -> None:
    """Give every rank rank ``root``'s optimizer state (momentum, Adam moments, step counts), e.g.
    after only rank 0 loaded a checkpoint. ``optimizer``: a torch optimizer or a
    :class:`~hpclb.sync.optimizer.DistributedOptimizer`. One object broadcast of the state dict."""
    comm = comm or communicator()
    if comm.world_size == 1:
        return
    state = comm.broadcast_object(optimizer.state_dict() if comm.rank == root else None, root)
    if comm.rank != root:
        optimizer.load_state_dict(state)


def _schedule(optimizer, scheme: str, *, base_batch_size: int, batch_size: int, num_samples: int,
              epochs: float, base_warmup_epochs: float, decay: str, decay_params: dict | None,
              base_lr: float | None) -> ScheduleLR:
    inner = getattr(optimizer, "optimizer", optimizer)
    lrs = {g.get("initial_lr", g["lr"]) for g in inner.param_groups}
    if base_lr is None:
        if len(lrs) != 1:
            raise ValueError(f"the optimizer's parameter groups have different LRs {sorted(lrs)}; "
                             f"pass base_lr= and set per-group 'lr_scale' factors instead")
        base_lr = lrs.pop()
    sched = Schedule.from_recipe(base_lr=base_lr, base_batch_size=base_batch_size,
                                 base_warmup_epochs=base_warmup_epochs,
                                 global_batch_size=batch_size, num_samples=num_samples,
                                 epochs=epochs, scheme=scheme, decay=decay,
                                 decay_params=decay_params)
    return ScheduleLR(inner, sched)


def _scheduler_factory(scheme: str):
    def make(optimizer, *, base_batch_size: int, batch_size: int, num_samples: int,
             epochs: float, base_warmup_epochs: float, decay: str = "poly",
             decay_params: dict | None = None, base_lr: float | None = None) -> ScheduleLR:
        return _schedule(optimizer, scheme, base_batch_size=base_batch_size,
                         batch_size=batch_size, num_samples=num_samples, epochs=epochs,
                         base_warmup_epochs=base_warmup_epochs, decay=decay,
                         decay_params=decay_params, base_lr=base_lr)
    return make


_DOC = """{title}

Returns a ``torch.optim.lr_scheduler.LRScheduler``; call its ``step()`` once per optimizer step.
The base LR ``eta0`` (tuned at ``base_batch_size`` B0, in samples) is taken from the optimizer
(``base_lr=`` overrides). With ``k = batch_size / base_batch_size`` (global batch, samples):
peak LR = {lr}; warmup = {warmup} (a linear per-step ramp from 0);
``steps_per_epoch = ceil(num_samples / batch_size)``; after warmup the ``decay`` (``poly``
(default, ``decay_params={{"power": 1, "end_lr": 0}}``), ``cosine``, ``exponential``,
``multistep``, ``constant``) runs with its boundaries in epochs, unchanged by k; ``epochs`` may be
fractional. Raises ValueError (warmup not shorter than training, a bad decay or LR).
Source: You et al., SC '19 ({source}).
"""
legw = _scheduler_factory("legw")
legw.__name__ = "legw"
legw.__doc__ = _DOC.format(title="LEGW: sqrt LR scaling with linear-epoch gradual warmup.",
                           lr="``eta0 * sqrt(k)``",
                           warmup="``base_warmup_epochs * k`` epochs (the same number of steps "
                                  "at every k)", source="LEGW")
linear_scaling = _scheduler_factory("linear")
linear_scaling.__name__ = "linear_scaling"
linear_scaling.__doc__ = _DOC.format(title="Linear scaling with a fixed-epoch warmup (Goyal et "
                                     "al. 2017), the baseline LEGW beats.", lr="``eta0 * k``",
                                     warmup="``base_warmup_epochs`` epochs", source="baseline")
sqrt_scaling = _scheduler_factory("sqrt")
sqrt_scaling.__name__ = "sqrt_scaling"
sqrt_scaling.__doc__ = _DOC.format(title="Sqrt LR scaling with a fixed-epoch warmup.",
                                   lr="``eta0 * sqrt(k)``", warmup="``base_warmup_epochs`` epochs",
                                   source="baseline")
no_scaling = _scheduler_factory("none")
no_scaling.__name__ = "no_scaling"
no_scaling.__doc__ = _DOC.format(title="The B0 recipe unchanged at any batch.", lr="``eta0``",
                                 warmup="``base_warmup_epochs`` epochs", source="baseline")


class _RankBatches(torch.utils.data.Sampler):
    """A ``batch_sampler``: this rank's share of each global batch (:class:`GlobalBatchSampler`).
    Every rank yields the same number of batches (a collective-safe loop)."""

    def __init__(self, sampler, drop_last: bool):
        self.sampler = sampler
        n, b, w = sampler.num_samples, sampler.global_batch, sampler.world_size
        last = n - (sampler.steps_per_epoch - 1) * b
        short = last < b and (drop_last or last < w)  # a share would be empty: drop the step
        self.steps = sampler.steps_per_epoch - (1 if short else 0)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i in range(self.steps):
            yield self.sampler.share(i).tolist()


def shard_loader(dataset, batch_size: int, *, comm: Communicator | None = None, seed: int = 0,
                 drop_last: bool = False, **loader_kwargs: Any) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` of this rank's part of every global batch of ``batch_size`` samples.

    Step ``i``'s global batch is samples ``perm[i*B:(i+1)*B]`` of the epoch's permutation (seeded
    by ``seed + epoch``; call ``loader.batch_sampler.set_epoch(e)`` each epoch), the same at
    every world size; rank ``r`` takes every ``world_size``-th of them from ``r``. No padding:
    every sample once per epoch; the last step may be short, shares then differ by one sample
    (weight each rank's mean loss by :func:`share_weight` for the exact global mean). A last
    global batch with fewer samples than ranks (or any short one with ``drop_last``) is dropped,
    so every rank runs the same number of steps. ``loader_kwargs`` go to ``DataLoader``
    (num_workers, pin_memory, ...). Raises ValueError for ``batch_size`` < world size or a
    ``shuffle``/``sampler``/``batch_sampler`` argument (shard_loader sets the order itself).
    """
    from hpclb.data.loader import check_shard_loader_args
    from hpclb.data.sampler import GlobalBatchSampler

    comm = comm or communicator()
    check_shard_loader_args(batch_size, comm.world_size, loader_kwargs)
    sampler = GlobalBatchSampler(len(dataset), batch_size, comm.rank, comm.world_size, seed)
    return torch.utils.data.DataLoader(dataset, batch_sampler=_RankBatches(sampler, drop_last),
                                       **loader_kwargs)


def share_weight(share_size: int, global_size: int, comm: Communicator | None = None) -> float:
    """``world_size * share_size / global_size``: the factor on a rank's mean loss that makes the
    averaged gradient the mean over the global batch when shares are uneven (1.0 when even)."""
    comm = comm or communicator()
    return comm.world_size * share_size / global_size if global_size else 0.0


def mean_over_ranks(value, comm: Communicator | None = None, weight: float = 1.0) -> float:
    """The weighted mean of a Python number or 0-d tensor over ranks (one allreduce of two
    float64 numbers): ``sum(value * weight) / sum(weight)``; ``weight`` is e.g. this rank's
    sample count. Every rank gets the same float. Raises ValueError when all weights are 0."""
    comm = comm or communicator()
    v = value.detach().double().cpu().reshape(()) if torch.is_tensor(value) else \
        torch.tensor(float(value), dtype=torch.float64)
    t = torch.stack([v * weight, torch.tensor(float(weight), dtype=torch.float64)])
    if comm.world_size > 1:
        comm.allreduce_(t)
    if t[1].item() == 0:
        raise ValueError("mean_over_ranks: every rank passed weight 0")
    return (t[0] / t[1]).item()
