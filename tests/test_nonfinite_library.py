"""Library mode on the device path (LARS/LAMB mask a non-finite step on the device): a run whose
gradients stay non-finite stops by itself within ``check_nonfinite_every`` steps, without the
caller calling ``check_nonfinite()``; finite runs are never read more often than that."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hpclb import LARS, NonFiniteError
from hpclb.comm.local import SelfCommunicator
from hpclb.sync.optimizer import DistributedOptimizer


def _opt(model, every):
    return DistributedOptimizer(LARS(model.parameters(), lr=0.1), model,
                                comm=SelfCommunicator(), max_nonfinite_steps=3,
                                check_nonfinite_every=every)


def _step(model, opt, value):
    model.zero_grad()
    loss = model(torch.full((4, 3), value)).sum()
    loss.backward()
    return opt.step()


def test_diverged_device_path_run_stops_without_check_nonfinite():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = _opt(model, every=5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError) as e:
        for _ in range(5):
            assert _step(model, opt, float("nan"))  # masked on the device, reported as issued
    assert opt.steps == 5 and "3" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # all masked


def test_check_every_zero_leaves_it_to_the_caller():
    model = nn.Linear(3, 2)
    opt = _opt(model, every=0)
    for _ in range(6):
        _step(model, opt, float("nan"))
    with pytest.raises(NonFiniteError):
        opt.check_nonfinite()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_check_every_is_refused(bad):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="check_nonfinite_every"):
        _opt(model, every=bad)
