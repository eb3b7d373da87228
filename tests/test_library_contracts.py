"""The contracts DistributedOptimizer keeps for torch.optim, DDP and Horovod users, at 1 process
and under ``mpirun -n 2 python -m pytest --only-mpi`` (docs/library.md, "The contract"):
p.grad between backward() and step(), replicas verified at construction, a parameter set that
changes, and the accumulation loop."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hpclb
from hpclb.comm.testing import assert_all
from hpclb.errors import ModelMismatchError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120, method="thread")]

OVERLAPS = ["thread", "nonblocking", "none"]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _global_batch(step: int, world_size: int, per_rank: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world_size * per_rank, 6, generator=g), \
        torch.randn(world_size * per_rank, 3, generator=g)


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_everywhere(comm, t: torch.Tensor, what: str) -> None:
    everyone = comm.allgather_object(t.tolist())
    assert_all(comm, all(e == everyone[0] for e in everyone), f"replicas differ: {what}")


def _ddp_reference(steps: int, world_size: int, clip: float | None):
    """What DDP (or one process on the global batch) does: global-mean gradient, clipped."""
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for s in range(steps):
        opt.zero_grad()
        _loss(ref, *_global_batch(s, world_size)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return ref


def _distributed(comm, **kw):
    model = _model()
    opt = hpclb.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01), model,
        comm=comm, **kw)
    return model, opt


def _shard(comm, step):
    x, y = _global_batch(step, comm.world_size)
    return x[comm.rank::comm.world_size], y[comm.rank::comm.world_size]


# -- p.grad between backward() and step() --------------------------------------------------------

@pytest.mark.parametrize("overlap", OVERLAPS)
def test_ddp_clip_idiom_is_ddps_update_in_every_overlap_mode(comm, overlap):
    """clip_grad_norm_(model.parameters(), c); opt.step() right after backward(): before, it
    passed at 1 process and raised GradientsTouchedError at 2 ranks (earlier still, replicas
    diverged or the clip saw the local gradient). Now p.grad is the global mean when backward
    returns (DDP's contract), so the clip is DDP's at every world size."""
    model, opt = _distributed(comm, overlap=overlap)
    try:
        for s in range(3):
            opt.zero_grad()
            _loss(model, *_shard(comm, s)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert opt.step() is True
    finally:
        opt.close()
    err = (_flat(model) - _flat(_ddp_reference(3, comm.world_size, 0.05))).abs().max().item()
    assert_all(comm, err < 1e-6, f"max |w - w_ddp| = {err}")
    _same_everywhere(comm, _flat(model), "after backward + clip")


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_synchronize_then_clip_gives_ddps_update_on_identical_replicas(comm, overlap):
    """Horovod's idiom: synchronize(); clip; with skip_synchronize(): step(). p.grad after
    synchronize() is the average over ranks, so the clip is DDP's."""
    model, opt = _distributed(comm, overlap=overlap)
    try:
        for s in range(3):
            opt.zero_grad()
            _loss(model, *_shard(comm, s)).backward()
            assert opt.synchronize() is True
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                assert opt.step() is True
        with pytest.raises(RuntimeError, match="call optimizer.synchronize"):
            with opt.skip_synchronize():
                pass
    finally:
        opt.close()
    ref = _ddp_reference(3, comm.world_size, 0.05)
    err = (_flat(model) - _flat(ref)).abs().max().item()
    assert_all(comm, err < 1e-6, f"max |w - w_ddp| = {err}")
    _same_everywhere(comm, _flat(model), "after synchronize + clip")


def test_grad_clip_norm_option_matches_ddp_clip(comm):
    model, opt = _distributed(comm, grad_clip_norm=0.05)
    try:
        for s in range(3):
            opt.zero_grad()
            _loss(model, *_shard(comm, s)).backward()
            assert opt.step() is True
    finally:
        opt.close()
    err = (_flat(model) - _flat(_ddp_reference(3, comm.world_size, 0.05))).abs().max().item()
    assert_all(comm, err < 1e-6, f"max |w - w_ddp| = {err}")


# -- replicas verified at construction ---------------------------------------------------------

def test_differing_replicas_are_broadcast_with_a_warning_naming_the_tensor(comm):
    """Before: per-rank seeds and no broadcast_parameters trained diverging replicas silently."""
    model = _model(seed=comm.rank)  # a different initialisation on every rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                         comm=comm)
    opt.close()
    msgs = [str(w.message) for w in caught if "replicas differ" in str(w.message)]
    if comm.world_size == 1:
        assert not msgs
        return
    assert_all(comm, len(msgs) == 1 and "first 0.weight" in msgs[0], repr(msgs))
    _same_everywhere(comm, _flat(model), "after the construction-time broadcast")
    assert_all(comm, torch.equal(_flat(model), _flat(_model(seed=0))), "not rank 0's values")


def test_differing_integer_buffer_is_caught_and_an_error_when_broadcast_is_off(comm):
    model = _model()
    model.register_buffer("seen", torch.tensor([7 + comm.rank], dtype=torch.int64))
    if comm.world_size == 1:
        hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                   comm=comm, broadcast_mismatch=False).close()
        return
    with pytest.raises(ModelMismatchError, match="first seen"):
        hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                   comm=comm, broadcast_mismatch=False)
    with pytest.warns(UserWarning, match="first seen"):
        hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                   comm=comm).close()
    assert_all(comm, int(model.seen) == 7, f"seen={int(model.seen)}")


# -- the parameter set may change ----------------------------------------------------------------

@pytest.mark.parametrize("make", ["sgd", "lars", "lamb"])
def test_a_net_frozen_after_construction_stays_put(comm, make):
    """The one-optimizer GAN pattern: before, the frozen net's zero-filled gradients still
    moved it through momentum/weight decay/moments (0.50 / 0.39 / 0.23 over 3 steps)."""
    model = _model()
    params = model.parameters()
    inner = {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
             "lars": lambda: hpclb.LARS(params, lr=0.1, weight_decay=0.01),
             "lamb": lambda: hpclb.LAMB(params, lr=0.01, weight_decay=0.01)}[make]()
    opt = hpclb.DistributedOptimizer(inner, model, comm=comm)
    try:
        for s in range(4):
            if s == 1:  # freeze the first layer after one full step (its momentum is set)
                model[0].requires_grad_(False)
                frozen = [p.detach().clone() for p in model[0].parameters()]
            opt.zero_grad()
            _loss(model, *_shard(comm, s)).backward()
            opt.step()
    finally:
        opt.close()
    moved = max((p - q).abs().max().item() for p, q in zip(model[0].parameters(), frozen))
    assert_all(comm, moved == 0.0, f"frozen layer moved by {moved}")
    _same_everywhere(comm, _flat(model), "frozen net")


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(6, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, use_a: bool, use_b: bool):
        h = self.trunk(x)
        return h + (self.a(h) if use_a else 0) + (self.b(h) if use_b else 0)


def test_parameters_without_a_gradient_on_every_rank_stay_put_with_find_unused(comm):
    """find_unused_parameters=True (DDP's): branch a, unused everywhere after step 0, is left
    by momentum and weight decay; branch b, used on rank 0 only, is averaged on every rank."""
    model = _Branches()
    opt = hpclb.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01), model,
        comm=comm, find_unused_parameters=True)
    try:
        for s in range(4):
            if s == 1:
                a_before = _flat(model.a).clone()
            opt.zero_grad()
            x, y = _shard(comm, s)
            _loss(lambda v: model(v, use_a=s == 0, use_b=comm.rank == 0), x, y).backward()
            assert opt.step() is True
    finally:
        opt.close()
    moved = (_flat(model.a) - a_before).abs().max().item()
    assert_all(comm, moved == 0.0, f"unused branch moved by {moved}")
    _same_everywhere(comm, _flat(model), "branches")


def test_unfrozen_or_added_parameters_are_refused_then_averaged_after_refresh(comm):
    """Before: a backbone unfrozen later, or a head added with add_param_group, stayed local
    (ranks 1e-2 apart after 2-3 steps)."""
    model = _model()
    model[0].requires_grad_(False)
    head = nn.Linear(3, 3)
    torch.manual_seed(5)
    nn.init.normal_(head.weight)
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                     comm=comm)
    try:
        model[0].requires_grad_(True)
        _loss(model, *_shard(comm, 0)).backward()
        with pytest.raises(RuntimeError, match=r"0\.weight .*refresh_parameters\(\)"):
            opt.step()
        opt.zero_grad()
        model[0].zero_grad()
        opt.refresh_parameters()
        opt.add_param_group({"params": head.parameters()})
        for s in range(1, 4):
            opt.zero_grad()
            x, y = _shard(comm, s)
            _loss(lambda v: head(model(v)), x, y).backward()
            assert opt.step() is True
    finally:
        opt.close()
    _same_everywhere(comm, torch.cat([_flat(model), _flat(head)]), "after unfreeze + new head")


# -- accumulation ----------------------------------------------------------------------------------

def test_the_readme_loop_with_accumulation_is_the_big_batch_step(comm):
    """zero_grad(); backward(); step(); sched.step() after every micro-batch with K=2. Before:
    only the last micro-batch's gradient (divided by K) survived, and the LR schedule ran K
    times too fast."""
    k, updates = 2, 3
    model = _model()
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                     comm=comm, accumulation_steps=k)
    sched = hpclb.legw(opt, base_batch_size=8, batch_size=8, num_samples=80, epochs=2,
                       base_warmup_epochs=0.5, decay="constant")
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = hpclb.legw(ref_opt, base_batch_size=8, batch_size=8, num_samples=80, epochs=2,
                           base_warmup_epochs=0.5, decay="constant")
    try:
        for u in range(updates):
            x, y = _global_batch(u, comm.world_size, per_rank=2 * k)
            for m in range(k):  # micro-batch m: every rank's m-th half of its share
                xs, ys = x[comm.rank::comm.world_size], y[comm.rank::comm.world_size]
                opt.zero_grad()
                _loss(model, xs[m::k], ys[m::k]).backward()
                opt.step()
                sched.step()
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            ref_opt.step()
            ref_sched.step()
    finally:
        opt.close()
    assert_all(comm, sched.last_epoch == updates, f"scheduler at step {sched.last_epoch}")
    assert_all(comm, sched.get_last_lr() == ref_sched.get_last_lr(), str(sched.get_last_lr()))
    err = (_flat(model) - _flat(ref)).abs().max().item()
    assert_all(comm, err < 1e-6, f"max |w - w_big_batch| = {err}")


def test_zero_grad_after_backward_zeroes_at_every_world_size(comm):
    """Before, at 2 ranks it raised ("gradients are in flight") where 1 process zeroed; the
    gradients are final when backward returns, so zero_grad() zeroes as in torch everywhere."""
    model, opt = _distributed(comm)
    try:
        _loss(model, *_shard(comm, 0)).backward()
        opt.zero_grad()
        assert_all(comm, all(not p.grad.any() for p in model.parameters()), "not zeroed")
        assert opt.step() is True
    finally:
        opt.close()


# -- one GradientSync per communicator, at every world size ----------------------------------------

def test_a_second_distributed_optimizer_is_refused_at_every_world_size(comm):
    """Two DistributedOptimizers on one communicator (the GAN mistake) are refused at 1 process
    too, with the message the 2-rank run gives, so a script that works on a laptop does not stop
    at 2 ranks; after close() a new one is accepted."""
    disc, gen = _model(), _model(1)
    d_opt = hpclb.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1), disc,
                                       comm=comm)
    try:
        with pytest.raises(ValueError, match="this communicator already carries .*with one "
                                             "GradientSync / hpclb.DistributedOptimizer"):
            hpclb.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), gen, comm=comm)
    finally:
        d_opt.close()
    g_opt = hpclb.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), gen, comm=comm)
    g_opt.close()


def test_a_closed_distributed_optimizer_refuses_to_step(comm):
    """step() after close() raised nothing at 1 process and hung at 2 ranks (the hooks were
    gone, the watchdog reported a mismatched collective every 60 s): now RuntimeError on every
    rank, before any collective."""
    model, opt = _distributed(comm)
    opt.close()
    _loss(model, *_shard(comm, 0)).backward()
    with pytest.raises(RuntimeError, match="was closed: its hooks are removed"):
        opt.step()
