"""Start-up agreement across ranks: every rank checks its model and settings against rank 0's,
takes rank 0's parameters, averages its buffers, and agrees on the number of steps. Every check
raises the same :class:`~hpclb.errors.ModelMismatchError` on every rank, so no rank is left
waiting in a later collective."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from hpclb.comm.base import Communicator
from hpclb.errors import ModelMismatchError
from hpclb.plugins import source_digests
from hpclb.sync.options import SYNC_VARIABLES

__all__ = ["agree_num_steps", "average_buffers", "broadcast_parameters", "check_model_code",
           "check_model_consistency", "check_sync_agreement", "fingerprints", "verify_replicas",
           "ReplicasDiffer"]


def check_model_consistency(model: nn.Module, comm: Communicator) -> None:
    """Compare every rank's parameter names, shapes and dtypes with rank 0's, then the source of
    the modules that define the model's classes (:func:`check_model_code`), in one allgather.

    Every rank raises the same :class:`ModelMismatchError`, naming the first differing parameter
    or module and rank, so no rank is left waiting in a later collective.
    """
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    everyone = comm.allgather_object((mine, _model_code(model)))
    _compare_entries([e[0] for e in everyone], "a different model than rank 0",
                     "every rank must build the same model from the same config")
    _compare_code([e[1] for e in everyone])


def check_model_code(model: nn.Module, comm: Communicator) -> None:
    """Compare the SHA-256 of the source of each module that defines one of ``model``'s classes
    (the user's code: installed packages and hpclb left out; :func:`~hpclb.plugins.
    source_digests`) with rank 0's: ModelMismatchError on every rank naming the module and
    both digests. Collective (one allgather); a world of one returns at once."""
    if comm.world_size > 1:
        _compare_code(comm.allgather_object(_model_code(model)))


def _model_code(model: nn.Module) -> dict[str, str]:
    return source_digests({type(m).__module__ for m in model.modules()})


def _compare_code(everyone: list[dict[str, str]]) -> None:
    ref = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for name in sorted(ref.keys() | theirs.keys()):
            if ref.get(name) != theirs.get(name):
                raise ModelMismatchError(
                    f"rank {rank} builds the model from other code than rank 0: module {name} "
                    f"(it defines the model's classes) has SHA-256 "
                    f"{theirs.get(name, 'absent')} on rank {rank} but {ref.get(name, 'absent')} "
                    f"on rank 0; every rank must import the same source (a stale copy of the "
                    f"module on one node?)")


def _compare_entries(everyone: list[list[tuple]], what: str, fix: str) -> None:
    """Raise ModelMismatchError naming the first rank and entry (parameter) of ``everyone``
    (one list of entries per rank) that differs from rank 0's; ``what``/``fix`` word it."""
    ref = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == ref:
            continue
        for i in range(max(len(ref), len(theirs))):
            a = ref[i] if i < len(ref) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                raise ModelMismatchError(
                    f"rank {rank} holds {what}: parameter #{i} is {_describe(b)} on rank "
                    f"{rank} but {_describe(a)} on rank 0; {fix}")


def _describe(entry) -> str:
    if entry is None:
        return "missing"
    return " ".join(str(x) if not isinstance(x, tuple) else str(list(x)) for x in entry)


@torch.no_grad()
def broadcast_parameters(module: nn.Module, comm: Communicator, root: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``root``'s (one Bcast per tensor)."""
    if comm.world_size == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        comm.broadcast_(t.data, root=root)


@torch.no_grad()
def average_buffers(module: nn.Module, comm: Communicator) -> None:
    """Make every floating-point buffer (BatchNorm running mean/var) the mean over ranks, in one
    allreduce of a flat float32/float64 copy: each rank's statistics come from its own share, so
    without this the ranks (and the checkpoint vs. a later evaluation) disagree. Integer buffers
    (``num_batches_tracked``) are equal on every rank already. Collective."""
    if comm.world_size == 1:
        return
    bufs = [b for b in module.buffers() if b.is_floating_point()]
    if not bufs:
        return
    dtype = torch.float64 if any(b.dtype == torch.float64 for b in bufs) else torch.float32
    flat = torch.cat([b.detach().reshape(-1).to(dtype) for b in bufs])
    comm.allreduce_(flat)
    flat.div_(comm.world_size)
    offset = 0
    for b in bufs:
        b.copy_(flat[offset:offset + b.numel()].view_as(b))
        offset += b.numel()


def agree_num_steps(local_steps: int, comm: Communicator, how: str = "min") -> int:
    """The number of steps every rank runs this epoch when shards are uneven (one allreduce).

    ``how="min"``: every rank stops after the shortest shard's steps (the rest of the longer
    shards is dropped this epoch). ``how="max"``: every rank runs the longest shard's steps; a
    rank out of data calls ``optimizer.zero_grad()`` and ``sync.synchronize()`` without a
    backward, which contributes zeros (the mean still divides by ``world_size``). Raises
    ValueError for another ``how`` or a negative count.
    """
    if how not in ("min", "max"):
        raise ValueError(f"how={how!r}: use 'min' or 'max'")
    if local_steps < 0:
        raise ValueError(f"local_steps={local_steps} must be >= 0")
    t = torch.tensor([local_steps], dtype=torch.int64)
    return int(comm.allreduce_(t, op=how).item())


def check_sync_agreement(everyone: list[dict]) -> None:
    """GradientSync's start-up check: ``everyone`` is every rank's ``{"params": [...],
    "buckets": [...], "settings": {...}}`` (one allgather); raise ModelMismatchError on every
    rank where one differs from rank 0's."""
    _compare_entries([e["params"] for e in everyone], "different gradients than rank 0",
                     "every rank must build the same model and pass the same parameters")
    for rank, e in enumerate(everyone[1:], start=1):
        for key, ref in everyone[0]["settings"].items():
            if e["settings"].get(key) != ref:
                source = (f" (the argument, else ${SYNC_VARIABLES[key]})"
                          if key in SYNC_VARIABLES else "")
                raise ModelMismatchError(
                    f"GradientSync: rank {rank} has {key}{source}={e['settings'].get(key)!r} "
                    f"but rank 0 has {ref!r}; every rank must use the same settings (check "
                    f"$HPCLB_* environment variables on every node)")
        if e["buckets"] != everyone[0]["buckets"]:
            raise ModelMismatchError(
                f"GradientSync: rank {rank} packs gradients into buckets of "
                f"{e['buckets']} tensors, rank 0 into {everyone[0]['buckets']}")


def _state_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer of ``model`` (an ``nn.Module``), or of the
    parameters of ``(name, parameter)`` pairs."""
    if isinstance(model, nn.Module):
        return list(model.named_parameters()) + list(model.named_buffers())
    return list(model)


@torch.no_grad()
def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float64 ``[2 * n]`` on the CPU: each tensor's sum and sum of squares (integer and bool
    tensors as float64; NaN mapped to a fixed value so that NaN on every rank still agrees).
    One host copy of ``2 n`` numbers."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    parts = []
    for t in tensors:
        v = t.detach().to(torch.float64).reshape(-1)
        parts.append(torch.stack([v.sum(), v.square().sum()]))
    return torch.nan_to_num(torch.cat(parts).cpu(), nan=-1.2345e300)


class ReplicasDiffer(UserWarning):
    """:func:`verify_replicas` found replicas that differ and broadcast rank 0's values."""


def verify_replicas(model, comm: Communicator, broadcast: bool = True, root: int = 0) -> str | None:
    """Compare every rank's parameter and buffer *values* (integer buffers too) by fingerprint:
    per tensor the float64 sum and sum of squares, allreduced with min and max (two allreduces
    of ``2 n`` numbers). Returns None when all ranks agree, else the first differing tensor's
    name, after either broadcasting rank ``root``'s parameters and buffers to every rank with a
    UserWarning naming it (``broadcast=True``), or raising :class:`ModelMismatchError` on every
    rank (``broadcast=False``). Collective; a world of one returns None. Call after
    :func:`check_model_consistency` (same names and shapes). ``model`` an ``nn.Module``: its
    classes' source is compared first (:func:`check_model_code`)."""
    if comm.world_size == 1:
        return None
    if isinstance(model, nn.Module):
        check_model_code(model, comm)
    with torch.no_grad():  # not a decorator: it adds a frame, and stacklevel counts frames
        named = _state_tensors(model)
        fp = fingerprints([t for _, t in named])
        lo, hi = comm.allreduce_(fp.clone(), op="min"), comm.allreduce_(fp.clone(), op="max")
        differ = (lo != hi).nonzero()
        if not len(differ):
            return None
        name = named[int(differ[0]) // 2][0]
        n = len({int(i) // 2 for i in differ})
        if not broadcast:
            raise ModelMismatchError(
                f"the ranks' replicas differ in {n} tensors, first {name}: seed the model's "
                f"initialisation identically on every rank, or call "
                f"hpclb.broadcast_parameters(model) (or pass broadcast_parameters=True)")
        # stacklevel 3: the line that built the DistributedOptimizer (its __init__ calls this)
        warnings.warn(ReplicasDiffer(f"the ranks' replicas differ in {n} tensors, first "
                                     f"{name}; rank {root}'s parameters and buffers were "
                                     f"broadcast to every rank"), stacklevel=3)
        for _, t in named:
            comm.broadcast_(t.data, root=root)
        return name
