"""The fused LARS/LAMB path (kernels/trust_ratio.cu run on CPU tensors by the emulator of
``kernels/testing``, as tests/test_kernel_models.py does) under a found-inf flag: a flagged step
leaves every layer, its optimizer state and the gradients as they were; an unflagged step is the
fused step bit for bit; and hpclb's own code reads nothing from the device in either."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hpclb.optim import LAMB, LARS
from hpclb.optim import fused as K
from hpclb.train.hostreads import HostReadCounter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "kernels" / "testing"))
import harness as H  # noqa: E402

pytestmark = [pytest.mark.skipif(H.compiler() is None, reason="needs g++ (C++20)"),
              pytest.mark.timeout(300), pytest.mark.slow]
SHAPES = [(6, 5), (5,), (8, 4), (3,)]


@pytest.fixture(scope="module")
def emu(tmp_path_factory) -> H.Emulator:
    import os

    lib = os.environ.get("HPCLB_EMULATOR_LIB") or \
        H.build_emulator(tmp_path_factory.mktemp("emulator"))
    return H.Emulator(lib)


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _set_grads(ps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


def _state(opt, ps) -> list[dict]:
    return [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in ps]


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0, momentum=0.9, weight_decay=1e-4)),
                                    (LAMB, dict(lr=0.01))])
def test_fused_step_masked_by_found_inf(emu, cls, kw):
    fused = K.FusedTrust(H.EmulatorLauncher(emu))
    plain, masked = _params(1), _params(1)
    opts = cls(plain, **kw), cls(masked, **kw)
    with K.use_fused("cpu", fused):
        for step in range(3):
            _set_grads(plain, 10 + step)
            _set_grads(masked, 10 + step)
            skip = step == 1
            before, state = [p.detach().clone() for p in masked], _state(opts[1], masked)
            grads = [p.grad.clone() for p in masked]
            opts[1].found_inf, opts[1].grad_scale = torch.tensor(float(skip)), None
            with HostReadCounter() as reads:
                opts[1].step()
            del opts[1].found_inf, opts[1].grad_scale
            assert opts[1].path == "emulator"
            ours = [r for r in reads.reads if f"{REPO / 'hpclb'}" in r.where]
            assert not ours, ours
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, masked))  # restored
            if skip:
                assert all(torch.equal(a, p) for a, p in zip(before, masked))
                assert all(torch.equal(v, opts[1].state[p][k])
                           for p, s in zip(masked, state) for k, v in s.items())
                assert int(opts[1].nonfinite_layers) == len(SHAPES)
                for p in plain:  # LAMB's host-side step count advances on a masked step
                    if "step" in opts[0].state[p]:
                        opts[0].state[p]["step"] += 1
                continue
            opts[0].step()
            assert all(torch.equal(p, q) for p, q in zip(plain, masked)), step


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0, momentum=0.9, weight_decay=1e-4)),
                                    (LAMB, dict(lr=0.01))])
def test_found_inf_reaches_the_kernel_as_a_flag(emu, cls, kw):
    """The fused step hands found_inf to both kernels as a device flag (their last argument),
    no NaN written into the gradients: the trust ratios and the count of skipped layers are the
    torch path's, and nothing is updated."""
    fused = K.FusedTrust(H.EmulatorLauncher(emu))
    args = []
    launch = fused.launcher.launch
    fused.launcher.launch = lambda name, grid, block, a: (args.append(a), launch(name, grid,
                                                                                   block, a))
    ps, ref = _params(3), _params(3)
    opts = cls(ps, **kw), cls(ref, **kw)
    for o, group in zip(opts, (ps, ref)):
        _set_grads(group, 4)
        o.found_inf, o.grad_scale = torch.tensor(1.0), None
    before = [p.detach().clone() for p in ps]
    with K.use_fused("cpu", fused):
        opts[0].step()
    opts[1].step()
    assert (opts[0].path, opts[1].path) == ("emulator", "torch")
    assert len(args) == 2 and all(int(a[-1]) != 0 for a in args)   # the flag's address
    assert all(torch.equal(a, p) for a, p in zip(before, ps))
    assert int(opts[0].nonfinite_layers) == int(opts[1].nonfinite_layers) == len(SHAPES)
    torch.testing.assert_close(opts[0].trust_ratios, opts[1].trust_ratios, rtol=1e-5, atol=0)
