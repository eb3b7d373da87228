"""``zero_grad()`` between ``backward()`` and ``step()`` inside an accumulation window is refused:
it would drop that micro-batch from the window silently (a window of 2 applied half the
gradient). At ``accumulation_steps=1`` and one process it zeroes, as plain torch does."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hpclb.comm.local import SelfCommunicator
from hpclb.sync.optimizer import DistributedOptimizer


def _setup(k):
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model,
                               comm=SelfCommunicator(), accumulation_steps=k)
    return model, opt


def _backward(model):
    model(torch.ones(1, 2)).sum().backward()


def test_zero_grad_after_backward_in_a_window_is_refused():
    model, opt = _setup(2)
    _backward(model)
    with pytest.raises(RuntimeError, match="drop this micro-batch"):
        opt.zero_grad()
    assert opt.step() is False           # the window goes on with its first micro-batch
    _backward(model)
    assert opt.step() is True
    assert torch.equal(model.weight, torch.full((1, 2), -1.0))  # mean of two gradients of 1


def test_documented_loop_zero_grad_before_backward_is_a_no_op_in_the_window():
    model, opt = _setup(2)
    for _ in range(2):
        opt.zero_grad()
        _backward(model)
        opt.step()
    assert torch.equal(model.weight, torch.full((1, 2), -1.0))


def test_without_accumulation_zero_grad_after_backward_zeroes_as_torch_does():
    model, opt = _setup(1)
    _backward(model)
    opt.zero_grad()
    assert torch.equal(model.weight.grad, torch.zeros(1, 2))
