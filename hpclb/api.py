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

import math
import warnings
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hpclb.comm.base import Communicator
from hpclb.comm.watchdog import install_abort_on_exception, watchdog_for
from hpclb.comm.world import current_communicator, get_communicator, has_communicator
from hpclb.optim.lr_scheduler import ScheduleLR
from hpclb.schedules import Schedule
from hpclb.sync.options import (
    LIBRARY_STALL_ABORT_S,
    SyncOptions,
    check_environment,
)

__all__ = ["init", "communicator", "broadcast_parameters", "broadcast_optimizer_state", "legw",
           "linear_scaling", "sqrt_scaling", "no_scaling", "shard_loader", "share_weight",
           "mean_over_ranks", "allreduce", "allgather", "broadcast", "broadcast_object",
           "barrier", "evaluate"]


def init(backend: str = "auto", device: str = "auto", *, share_gpu: bool = False,
         abort_on_exception: bool = True,
         stall_abort_s: float | None = LIBRARY_STALL_ABORT_S,
         torch_process_group: bool = False) -> Communicator:
    """Start (or return) this process's communicator and bind its device.

    ``backend``: ``auto`` (MPI under mpirun/srun, torch.distributed under torchrun, one process
    otherwise), ``mpi``, ``torch``, ``horovod`` or ``self``. ``device``: ``auto`` (this rank's
    GPU, ``cuda:<local_rank % visible GPUs>``, when CUDA is available, else the CPU), ``cpu`` or
    ``cuda``; ``share_gpu`` allows more ranks than GPUs on a node. Returns the
    :class:`~hpclb.comm.base.Communicator` (``rank``, ``world_size``, ``local_rank``, ``device``);
    calling it again returns the same one. Raises ConfigError (a ValueError) when the launcher
    and backend do not fit, or the device cannot be had, and ValueError naming the variable for
    a bad ``HPCLB_*`` setting (:func:`hpclb.sync.options.check_environment`).

    No rank waits forever (world size > 1): ``abort_on_exception`` installs ``sys.excepthook``
    and ``threading.excepthook`` so that an uncaught exception on one rank prints the rank and
    the exception on stderr and ends every rank (``MPI_Abort``, exit status 1); opt out with
    ``False`` or ``$HPCLB_ABORT_ON_EXCEPTION=0``. ``stall_abort_s`` (seconds, default 300; None:
    never) ends the job when a gradient allreduce has waited that long (a rank that left the
    loop or skipped a step); ``$HPCLB_STALL_ABORT_S`` and a ``DistributedOptimizer``'s own
    ``stall_abort_s=`` take precedence.

    ``torch_process_group=True``: also set up torch.distributed's default process group over
    Gloo with this communicator's ranks (under ``mpirun`` too), for code that calls
    ``torch.distributed`` itself (``DistributedSampler(ds)`` without arguments,
    ``dist.all_reduce`` of a metric); :func:`hpclb.comm.torch_dist.init_default_group`.
    """
    check_environment()  # a bad HPCLB_* variable named here, not at the first optimizer
    if stall_abort_s is not None and not (isinstance(stall_abort_s, (int, float)) and
                                          0 < stall_abort_s < math.inf):
        raise ValueError(f"stall_abort_s={stall_abort_s!r} must be None or a positive number "
                         f"of seconds")
    if not has_communicator():
        get_communicator(backend, device=device, share_gpu=share_gpu)
    comm = current_communicator()
    comm.stall_abort_s = None if stall_abort_s is None else float(stall_abort_s)
    if comm.world_size > 1:
        watchdog_for(comm)  # made by every rank together: the collectives below are watched
    if torch_process_group:
        from hpclb.comm.torch_dist import init_default_group

        init_default_group(comm)
    if abort_on_exception:
        install_abort_on_exception(comm)
    return comm


@contextmanager
def _watched(comm: Communicator, label: str):
    """Number this collective for the stall watchdog (as gradient buckets are) and watch the
    wait, so that one called on some ranks only is reported as MISMATCHED, naming what the
    others are in. Every rank calls the same collectives in the same order."""
    if comm.world_size == 1:
        yield
        return
    opts = SyncOptions.resolve(default_abort_s=comm.stall_abort_s)
    wd = watchdog_for(comm)
    wd.register_timeout(opts.stall_timeout_s)
    with wd.waiting(wd.entered(label), label, opts.stall_timeout_s, None, opts.stall_abort_s):
        yield


def communicator() -> Communicator:
    """The communicator :func:`init` made (the one :func:`hpclb.comm.world.get_communicator` holds).
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


def _base_lr_of(inner: torch.optim.Optimizer) -> float:
    """eta0 from the groups' ``initial_lr`` (set by a scheduler), else their ``lr``; warns when
    it has to guess from the ``lr`` of an optimizer that has state (a loaded or stepped one,
    whose ``lr`` may be a scheduled value, not eta0)."""
    lrs = {g.get("initial_lr", g["lr"]) for g in inner.param_groups}
    if len(lrs) != 1:
        raise ValueError(f"the optimizer's parameter groups have different LRs {sorted(lrs)}; "
                         f"pass base_lr= and set per-group 'lr_scale' factors instead")
    if len(inner.state) and any("initial_lr" not in g for g in inner.param_groups):
        warnings.warn(f"taking the base LR eta0 = {next(iter(lrs)):g} from the optimizer's "
                      f"current 'lr', but the optimizer has state (loaded or stepped): that lr "
                      f"may be a scheduled value. Pass base_lr=, or load the scheduler's "
                      f"state_dict (it keeps the peak LR)", UserWarning, stacklevel=3)
    return lrs.pop()


def _scheduler_factory(scheme: str):
    def make(optimizer, *, base_batch_size: int, batch_size: int, num_samples: int,
             epochs: float, base_warmup_epochs: float, decay: str = "poly",
             decay_params: dict | None = None, base_lr: float | None = None) -> ScheduleLR:
        inner = getattr(optimizer, "optimizer", optimizer)
        if base_lr is None:
            base_lr = _base_lr_of(inner)
        sched = Schedule.from_recipe(base_lr=base_lr, base_batch_size=base_batch_size,
                                     base_warmup_epochs=base_warmup_epochs,
                                     global_batch_size=batch_size, num_samples=num_samples,
                                     epochs=epochs, scheme=scheme, decay=decay,
                                     decay_params=decay_params)
        updates = (lambda: optimizer.steps) if inner is not optimizer else None
        return ScheduleLR(inner, sched, updates=updates, keep_peak_lr=True)
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
        with _watched(comm, "mean_over_ranks (allreduce of 2 float64)"):
            comm.allreduce_(t)
    if t[1].item() == 0:
        raise ValueError("mean_over_ranks: every rank passed weight 0")
    return (t[0] / t[1]).item()


# -- collectives (every rank calls each one, in the same order) -----------------------------------

def allreduce(tensor: torch.Tensor, op: str = "mean", comm: Communicator | None = None
              ) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over ranks with ``op`` (``mean`` (default, as Horovod's
    ``hvd.allreduce``), ``sum``, ``max``, ``min``); same shape, dtype and device on every rank.
    ``tensor`` is left as it is. Raises ValueError for another ``op``, and for ``mean`` of an
    integer or bool tensor (3 and 4 would average to 3; Horovod rounds the same way): reduce
    ``op="sum"`` and divide, or pass a float tensor. Both before communicating."""
    if op not in ("mean", "sum", "max", "min"):
        raise ValueError(f"allreduce op={op!r}: use 'mean', 'sum', 'max' or 'min'")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"allreduce op='mean' of a {tensor.dtype} tensor would round the mean "
                         f"down (3 and 4 average to 3): use op='sum' and divide, or pass "
                         f"tensor.float()")
    comm = comm or communicator()
    out = tensor.detach().clone()
    if comm.world_size > 1:
        with _watched(comm, f"allreduce {op} of {list(out.shape)} {out.dtype}"):
            comm.allreduce_(out, op="sum" if op == "mean" else op)
    if op == "mean":
        out = out / comm.world_size
    return out


def allgather(tensor: torch.Tensor, comm: Communicator | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (``[sum of dim-0 sizes,
    ...]``; the other dims must agree), on this rank's device. Travels as a pickled CPU copy:
    for metrics and small tensors, not for gradients."""
    comm = comm or communicator()
    with _watched(comm, f"allgather of {tensor.dtype}"):
        parts = comm.allgather_object(tensor.detach().cpu())
    return torch.cat([p.reshape(-1, *tensor.shape[1:]) for p in parts]).to(tensor.device)


def broadcast(tensor: torch.Tensor, root: int = 0, comm: Communicator | None = None
              ) -> torch.Tensor:
    """Overwrite ``tensor`` in place with rank ``root``'s (same shape and dtype on every rank);
    returns it."""
    comm = comm or communicator()
    if comm.world_size > 1:
        with _watched(comm, f"broadcast of {list(tensor.shape)} {tensor.dtype} from {root}"):
            comm.broadcast_(tensor.data, root=root)
    return tensor


def broadcast_object(obj: Any, root: int = 0, comm: Communicator | None = None) -> Any:
    """Rank ``root``'s picklable ``obj`` on every rank (e.g. a decision made on rank 0)."""
    comm = comm or communicator()
    if comm.world_size == 1:
        return obj
    with _watched(comm, f"broadcast_object from {root}"):
        return comm.broadcast_object(obj, root)


def barrier(comm: Communicator | None = None) -> None:
    """Return when every rank has entered."""
    comm = comm or communicator()
    if comm.world_size > 1:
        with _watched(comm, "barrier"):
            comm.barrier()


@torch.no_grad()
def evaluate(model: nn.Module, dataset, metrics, *, batch_size: int = 256,
             comm: Communicator | None = None, **loader_kwargs: Any) -> dict[str, float]:
    """Means of per-sample metrics over a whole data set split across ranks: every sample
    exactly once (rank ``r`` takes samples ``r, r + world_size, ...``; no padding, unlike
    ``DistributedSampler``), the same dict on every rank.

    ``metrics(outputs, targets) -> {name: tensor [n]}``: per-sample values of a batch (e.g.
    ``(outputs.argmax(1) == targets).float()`` or ``F.cross_entropy(outputs, targets,
    reduction="none")``); ``dataset`` yields ``(input, target)``; inputs go to ``comm.device``.
    The model runs in eval mode under ``no_grad`` (its mode is restored). One allreduce of
    float64 sums. Raises ValueError when the data set is empty.
    """
    comm = comm or communicator()
    shard = torch.utils.data.Subset(dataset, range(comm.rank, len(dataset), comm.world_size))
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, **loader_kwargs)
    was_training = model.training
    model.eval()
    names, sums = None, None
    try:
        for x, y in loader:
            values = metrics(model(x.to(comm.device)), y.to(comm.device))
            names = names or sorted(values)
            batch = torch.stack([values[k].detach().double().sum().cpu() for k in names])
            sums = batch if sums is None else sums + batch
    finally:
        model.train(was_training)
    return _reduce_sums(names, sums, len(shard), comm)


def _reduce_sums(names, sums, count: int, comm: Communicator) -> dict[str, float]:
    """Metric means over every rank's ``count`` samples (a rank with an empty shard has
    ``names`` None and learns them from the others)."""
    everyone = comm.allgather_object(names) if comm.world_size > 1 else [names]
    names = next((n for n in everyone if n), None)
    if names is None:
        raise ValueError("evaluate: the data set is empty on every rank")
    t = torch.zeros(len(names) + 1, dtype=torch.float64)
    if sums is not None:
        t[:-1] = sums
    t[-1] = count
    if comm.world_size > 1:
        with _watched(comm, f"evaluate (allreduce of {len(t)} float64)"):
            comm.allreduce_(t)
    return {k: (t[i] / t[-1]).item() for i, k in enumerate(names)}
