"""torch's optimizer and scheduler contracts for the library's LARS, LAMB and legw: copies step,
and a resumed schedule keeps its peak LR (1 process; no communication involved)."""
from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import hpclb
from hpclb.comm.local import SelfCommunicator

pytestmark = pytest.mark.timeout(120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("cls", ["LARS", "LAMB"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_every_attribute_and_step_like_the_original(cls, how):
    """Before: the copy's next step() raised AttributeError ('_paths_logged')."""
    model = _model()
    opt = getattr(hpclb, cls)(model.parameters(), lr=0.05, weight_decay=0.01)
    _step(model, opt, 0)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    for attr in ("nonfinite_layers", "trust_ratios", "path"):
        assert hasattr(opt2, attr), attr
    _step(model, opt, 1)
    _step(model2, opt2, 1)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt2.trust_ratios is not None and opt2.path == opt.path


def _legw(opt, **kw):
    return hpclb.legw(opt, base_batch_size=100, batch_size=400, num_samples=4000, epochs=10,
                      base_warmup_epochs=0.25, decay="constant", **kw)


def test_legw_resume_keeps_the_peak_lr_and_warns_when_it_guesses():
    """Before: with an optimizer state whose groups lack initial_lr loaded first, legw took eta0
    from the scheduled lr (1.2x too high here) and the scheduler state did not fix it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = _legw(opt)  # peak 0.2 after 10 warmup steps
    for s in range(6):
        _step(model, opt, s)
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    for g in saved_opt["param_groups"]:
        del g["initial_lr"]  # e.g. saved before the scheduler existed, or by another tool
    model2 = _model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved_opt)  # lr is now the scheduled 0.12 (6/10 of 0.2), not eta0 0.1
    with pytest.warns(UserWarning, match="taking the base LR eta0 = 0.12"):
        sched2 = _legw(opt2)
    assert math.isclose(sched2.schedule.peak_lr, 0.24)  # the guess: 1.2x too high
    with pytest.warns(UserWarning, match="peak LR 0.2 replaces"):
        sched2.load_state_dict(saved_sched)
    assert sched2.last_epoch == 6 and math.isclose(sched2.schedule.peak_lr, 0.2)
    for s in range(6, 15):
        _step(model, opt, s)
        sched.step()
        _step(model2, opt2, s)
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
    assert math.isclose(sched.get_last_lr()[0], 0.2)


def test_legw_on_a_fresh_optimizer_does_not_warn():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _legw(torch.optim.SGD(model.parameters(), lr=0.1))


def test_scheduler_of_a_distributed_optimizer_advances_once_per_update():
    """sched.step() after every micro-batch (K=3): the LR moves once per optimizer update."""
    model = _model()
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                     comm=SelfCommunicator(), accumulation_steps=3)
    sched = _legw(opt)
    try:
        for m in range(9):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            sched.step()
            sched.step()  # a second call without an update does not advance either
    finally:
        opt.close()
    assert opt.steps == 3 and sched.last_epoch == 3
    assert math.isclose(sched.get_last_lr()[0], sched.schedule.lr(3))
