"""Scripts written for DDP and Horovod port without surprises (issue 27), at 1 process and under
``mpirun -n 2 python -m pytest --only-mpi``: DDP's gradient contract (``p.grad`` is the global
mean when backward returns), Horovod's accumulation loop, ``no_sync()``, torch's LR schedulers,
``torch.save``/``copy.deepcopy`` of a model, and a plain optimizer loading ``opt.state_dict()``."""
from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from torch import nn

import hpclb
from hpclb.comm.testing import assert_all

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120, method="thread")]

OVERLAPS = ["thread", "nonblocking", "none"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _global_batch(step: int, world_size: int, per_rank: int = 4):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(world_size * per_rank, 6, generator=g), \
        torch.randn(world_size * per_rank, 3, generator=g)


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _mean_grad(x, y, k: int) -> torch.Tensor:
    """The global-batch mean gradient of the initial model (K micro-batch means, averaged)."""
    ref = _model()
    for m in range(k):
        (_loss(ref, x[m::k], y[m::k]) / k).backward()
    return _grads(ref)


def _opt(comm, model, **kw):
    return hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                      comm=comm, **kw)


def _rank_part(comm, x):
    return x[comm.rank::comm.world_size]


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("k", [1, 3])
def test_grad_is_the_global_mean_when_the_windows_last_backward_returns(comm, overlap, k):
    """DDP's contract. Before: p.grad after backward was the local gradient, or the undivided
    sum under overlap=thread, at 2 ranks; at 1 process with K > 1 the undivided sum."""
    model = _model()
    opt = _opt(comm, model, overlap=overlap, accumulation_steps=k)
    x, y = _global_batch(0, comm.world_size, per_rank=2 * k)
    xs, ys = _rank_part(comm, x), _rank_part(comm, y)
    try:
        opt.zero_grad()
        for m in range(k):  # Horovod's loop: K backward passes, then one step()
            _loss(model, xs[m::k], ys[m::k]).backward()
        got = _grads(model).clone()
        assert opt.synchronize() is True  # Horovod's idiom still works: nothing left to do
        assert torch.equal(_grads(model), got)
        with opt.skip_synchronize():
            assert opt.step() is True
    finally:
        opt.close()
    # the reference: one process on the global batch, in the same micro-batch split per rank
    want = torch.stack([_mean_grad(_rank_part_of(x, r, comm.world_size),
                                   _rank_part_of(y, r, comm.world_size), k)
                        for r in range(comm.world_size)]).mean(0)
    err = (got - want).abs().max().item()
    assert_all(comm, err < 1e-6, f"max |grad - global mean| = {err}")


def _rank_part_of(x, r, world_size):
    return x[r::world_size]


@pytest.mark.parametrize("loop", ["horovod", "readme", "no_sync"])
def test_accumulation_loops_give_the_big_batch_step_at_every_world_size(comm, loop):
    """Horovod's loop (zero_grad, K backward, one step with accumulation_steps=K): before,
    every other iteration did nothing and the others applied twice the step at 1 process, and
    2 ranks raised "arrived after its bucket was sent ... use accumulation_steps". DDP's
    no_sync() loop (K-1 backward inside, the last outside) gives the same update."""
    k, updates = 2, 3
    model = _model()
    opt = _opt(comm, model, accumulation_steps=1 if loop == "no_sync" else k)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for u in range(updates):
            x, y = _global_batch(u, comm.world_size, per_rank=2 * k)
            xs, ys = _rank_part(comm, x), _rank_part(comm, y)
            if loop == "readme":
                for m in range(k):
                    opt.zero_grad()
                    _loss(model, xs[m::k], ys[m::k]).backward()
                    assert opt.step() is (m == k - 1)
            else:
                opt.zero_grad()
                for m in range(k - 1):
                    if loop == "no_sync":
                        with opt.no_sync():
                            (_loss(model, xs[m::k], ys[m::k]) / k).backward()
                    else:
                        _loss(model, xs[m::k], ys[m::k]).backward()
                last = _loss(model, xs[k - 1::k], ys[k - 1::k])
                (last / k if loop == "no_sync" else last).backward()
                assert opt.step() is True
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            ref_opt.step()
    finally:
        opt.close()
    assert_all(comm, opt.steps == updates, f"{opt.steps} updates, want {updates}")
    err = (_flat(model) - _flat(ref)).abs().max().item()
    assert_all(comm, err < 1e-6, f"max |w - w_big_batch| = {err}")


def test_step_after_a_no_sync_backward_alone_is_refused(comm):
    model = _model()
    opt = _opt(comm, model)
    try:
        with opt.no_sync():
            _loss(model, *_global_batch(0, 1)).backward()
        with pytest.raises(RuntimeError, match="under no_sync.*outside"):
            opt.step()
        _loss(model, *_global_batch(1, 1)).backward()  # the window's last: reduced
        assert opt.step() is True
    finally:
        opt.close()


def test_model_survives_torch_save_and_deepcopy_with_an_optimizer(comm):
    """Before: TypeError: cannot pickle 'weakref.ReferenceType' object (an attribute set on
    every parameter), so a PTB LM script died at its first epoch end."""
    model = _model()
    opt = _opt(comm, model)
    try:
        for s in range(2):
            opt.zero_grad()
            _loss(model, *_global_batch(s, 1)).backward()
            opt.step()
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        twin = copy.deepcopy(model)
        assert torch.equal(_flat(loaded), _flat(model)) and torch.equal(_flat(twin), _flat(model))
        _loss(twin, *_global_batch(5, 1)).backward()  # the copy trains on its own
        assert all(p.grad is not None for p in twin.parameters())
        opt.zero_grad()
        _loss(model, *_global_batch(2, 1)).backward()
        assert opt.step() is True  # and the original still synchronises
    finally:
        opt.close()


@pytest.mark.parametrize("make", ["step", "onecycle", "lambda"])
def test_torch_lr_schedulers_take_a_distributed_optimizer(comm, make):
    """Before: TypeError: DistributedOptimizer is not an Optimizer."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hpclb.DistributedOptimizer(inner, model, comm=comm)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sched_of = {"step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
                "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2,
                                                                          total_steps=5),
                "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e))}
    try:
        assert isinstance(opt, torch.optim.SGD) and isinstance(opt, torch.optim.Optimizer)
        sched, ref_sched = sched_of[make](opt), sched_of[make](ref_opt)
        for s in range(4):
            x, y = _global_batch(s, comm.world_size)
            opt.zero_grad()
            _loss(model, _rank_part(comm, x), _rank_part(comm, y)).backward()
            opt.step()
            sched.step()
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            ref_opt.step()
            ref_sched.step()
        assert sched.get_last_lr() == ref_sched.get_last_lr()
        err = (_flat(model) - _flat(ref)).abs().max().item()
        assert_all(comm, err < 1e-6, f"max |w - w_ref| = {err}")
        plain = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
        plain.load_state_dict(opt.state_dict())  # the inner class loads it as it is
        assert plain.state_dict()["state"][0]["momentum_buffer"].equal(
            inner.state_dict()["state"][0]["momentum_buffer"])
        assert plain.param_groups[0]["lr"] == inner.param_groups[0]["lr"]
    finally:
        opt.close()


def test_legw_and_the_old_state_dict_form_still_work(comm):
    model = _model()
    opt = _opt(comm, model)
    try:
        sched = hpclb.legw(opt, base_batch_size=8, batch_size=16, num_samples=64, epochs=2,
                           base_warmup_epochs=0.5)
        opt.zero_grad()
        _loss(model, *_global_batch(0, 1)).backward()
        opt.step()
        sched.step()
        state = opt.state_dict()
        assert state["steps"] == 1 and "param_groups" in state
        old = {"optimizer": opt.optimizer.state_dict(), "steps": 1, "skipped_steps": 0}
        opt.load_state_dict(old)
        opt.load_state_dict(state)
        assert opt.steps == 1
    finally:
        opt.close()
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        hpclb.DistributedOptimizer(opt, model, comm=comm)


def test_init_sets_up_torch_distributed_for_scripts_that_call_it(comm):
    """Before: under mpirun, DistributedSampler(ds) and dist.all_reduce raised for want of a
    default process group. hpclb.init(torch_process_group=True) makes one over Gloo."""
    import torch.distributed as dist

    was = dist.is_initialized()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ and comm.backend != "torch"}
    assert hpclb.init(torch_process_group=True) is comm
    try:
        if not was:  # torchrun's variables, as a script under torchrun reads them
            assert [os.environ[k] for k in names] == [str(comm.rank), str(comm.world_size),
                                                      str(comm.local_rank), str(comm.local_size)]
        sampler = torch.utils.data.distributed.DistributedSampler(range(10), shuffle=False)
        assert (sampler.num_replicas, sampler.rank) == (comm.world_size, comm.rank)
        assert list(sampler) == list(range(10))[comm.rank::comm.world_size] + \
            ([] if 10 % comm.world_size == 0 else [comm.rank])
        t = torch.tensor([float(comm.rank + 1)])
        dist.all_reduce(t)
        assert t.item() == comm.world_size * (comm.world_size + 1) / 2
        hpclb.init(torch_process_group=True)  # again: the same group is kept
        assert dist.get_world_size() == comm.world_size
    finally:
        if not was and comm.backend != "torch":
            dist.destroy_process_group()
            for k in names:  # this process's launcher did not set them: leave no trace
                os.environ.pop(k, None)
            os.environ.update(saved)


def test_a_rank_without_samples_in_a_micro_batch_keeps_the_windows_in_step(comm):
    """hpclb train's loop: a rank whose share of a micro-batch is empty skips its backward but
    calls step(); that step counts as an empty micro-batch, so no rank waits for another."""
    k = 2
    model = _model()
    opt = _opt(comm, model, accumulation_steps=k)
    try:
        for u in range(3):
            x, y = _global_batch(u, comm.world_size)
            for m in range(k):
                opt.zero_grad()
                if not (m == 1 and comm.rank == comm.world_size - 1):  # the last rank's is empty
                    _loss(model, _rank_part(comm, x), _rank_part(comm, y)).backward()
                assert opt.step() is (m == k - 1)
    finally:
        opt.close()
    assert_all(comm, opt.steps == 3, f"{opt.steps} updates")
    everyone = comm.allgather_object(_flat(model).tolist())
    assert_all(comm, all(e == everyone[0] for e in everyone), "replicas differ")
