"""The fused path's host work per step: the tensor checks and the descriptor table are built once
per tensor set (keyed by the tensors' addresses) and reused by every later step; a new tensor
set is checked and tabled again, and a set the kernel cannot take is refused every time."""
from __future__ import annotations

import pytest
import torch

from hpclb.optim import LAMB, LARS
from hpclb.optim import fused as K

pytestmark = pytest.mark.timeout(60)


class CountingLauncher:
    """The launcher interface on the CPU; records launches and runs nothing (the host side only:
    tests/test_kernel_logic.py runs the kernels themselves)."""

    name, device = "counting", torch.device("cpu")

    def __init__(self):
        self.launches, self.stream = [], 0

    def stream_key(self) -> int:
        return self.stream

    def grid_for(self, n_chunks: int, block: int, kernel: str | None = None) -> int:
        return n_chunks

    def launch(self, name, grid, block, args) -> None:
        self.launches.append((name, int(args[0])))   # the descriptor table's address


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("opt_class", [LARS, LAMB])
def test_steps_check_and_table_once(opt_class):
    model = _model()
    F = K.FusedTrust(CountingLauncher())
    opt = opt_class(model.parameters(), lr=0.1)
    with K.use_fused("cpu", F):
        for _ in range(5):
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.ones_like(p)
            opt.step()
    assert opt.path == "counting"
    assert F.counters["validations"] == 1 and F.counters["tables"] == 1, F.counters
    assert F.counters["launches"] == 10
    assert len({desc for _, desc in F.launcher.launches}) == 1   # one table, uploaded once


def test_a_new_tensor_set_is_checked_and_tabled_again():
    F = K.FusedTrust(CountingLauncher())
    ws = [torch.ones(10), torch.ones(3, 4)]
    gs = [torch.ones(10), torch.ones(3, 4)]
    t1 = F.table(ws, gs, adapt=[True, True])
    assert F.table(ws, gs, adapt=[True, True]) is t1 and F.why_not(ws, gs) is None
    assert F.counters["validations"] == 1 and F.counters["tables"] == 1
    assert F.table(ws, gs, adapt=[True, False]) is not t1           # other flags: a new table
    assert F.counters["tables"] == 2 and F.counters["validations"] == 1
    gs2 = [gs[0], torch.ones(3, 4)]                                 # a gradient reallocated
    assert F.table(ws, gs2, adapt=[True, True]) is not t1
    assert F.counters["validations"] == 2 and F.counters["tables"] == 3
    half = [w.half() for w in ws]                                   # cast: new addresses
    assert F.why_not(half, gs) == "layer 0: its tensors differ in dtype or size"
    F.launcher.stream = 7                                           # another stream
    assert F.table(ws, gs, adapt=[True, True]) is not t1


def test_a_refused_set_is_refused_every_time():
    F = K.FusedTrust(CountingLauncher())
    ws = [torch.ones(4, dtype=torch.float64)]
    for _ in range(3):
        assert "float64" in F.why_not(ws)
        with pytest.raises(ValueError, match="float64"):
            F.table(ws, adapt=[True])
    sparse = [torch.ones(4).to_sparse()]
    assert F.why_not(sparse) == "layer 0 is not a dense contiguous tensor"
    assert F.counters["tables"] == 0
