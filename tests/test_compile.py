"""`hpclb train --compile` and a compiled model under the library: the mode is checked before any
work; a compiled forward (torch.compile, inductor on the CPU) trains like eager to rounding over
the first steps, at any world size (the MPI suite runs it at 2 ranks); and `hpclb train` with
`--compile` reaches the eager run's result (extended: compiling takes a while)."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import all_ranks_ok
from helpers import quick_recipe

import hpclb
from hpclb.comm.local import SelfCommunicator
from hpclb.config import COMPILE_MODES, resolve
from hpclb.errors import ConfigError
from hpclb.train import loop as train_mod
from hpclb.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                                 reason="inductor on the CPU needs a C++ compiler")]


def test_compile_mode_is_checked_before_work(tmp_path):
    recipe = quick_recipe(tmp_path)
    assert resolve(recipe, out=str(tmp_path / "a")).compile is None
    assert resolve(recipe, out=str(tmp_path / "a"), compile="max-autotune").compile == \
        "max-autotune"
    assert COMPILE_MODES == ("default", "reduce-overhead", "max-autotune")
    with pytest.raises(ConfigError, match=r"--compile.*'fast' is not one of"):
        resolve(recipe, out=str(tmp_path / "a"), compile="fast")


def _train(comm, compiled: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if compiled:
        model.compile()
    opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     model, comm=comm)
    g = torch.Generator().manual_seed(10 + comm.rank)   # each rank its own data
    try:
        for _ in range(steps):
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    finally:
        opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi
def test_compiled_model_trains_like_eager_at_any_world_size(comm):
    eager, compiled = _train(comm, False), _train(comm, True)
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(eager, compiled))
    moved = not all(torch.equal(a, b) for a, b in zip(eager, _init()))
    all_ranks_ok(comm, ok and moved, "compiled and eager parameters differ after 3 steps")


def _init() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.extended
@pytest.mark.slow
def test_train_with_compile_matches_eager(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 1024,
                                          "test_samples": 500})
    out = {}
    for mode in (None, "default"):
        cfg = resolve(recipe, out=str(tmp_path / str(mode)), batch_size=256, epochs=1,
                      data_dir=str(mnist_dir.parent), compile=mode)
        out[mode] = (train_mod.train(cfg, SelfCommunicator(), quiet=True),
                     load_checkpoint(f"{cfg.out}/checkpoint.pt")["model"])
    (s0, p0), (s1, p1) = out[None], out["default"]
    assert list(p0) == list(p1)                      # the same state_dict keys
    assert all(torch.allclose(p0[k], p1[k], rtol=1e-4, atol=1e-5) for k in p0)
    assert s1["final_test_loss"] == pytest.approx(s0["final_test_loss"], rel=1e-4)


def test_compile_warns_that_rnn_layers_stay_eager(tmp_path, mnist_dir, caplog):
    """MNIST-LSTM's nn.LSTM is skipped by dynamo (allow_rnn off): `--compile` says so once,
    before any step (torch.compile is lazy: nothing is compiled here); eager says nothing."""
    from hpclb.train.setup import setup_run
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 256,
                                          "test_samples": 100})
    for mode in (None, "default"):
        caplog.clear()
        cfg = resolve(recipe, out=str(tmp_path / str(mode)), data_dir=str(mnist_dir.parent),
                      compile=mode)
        with caplog.at_level("WARNING", logger="hpclb"):
            setup_run(cfg, SelfCommunicator()).close()
        eager = [r.getMessage() for r in caplog.records if "layer(s) eager" in r.getMessage()]
        if mode is None:
            assert eager == [], eager
        else:
            assert len(eager) == 1 and "LSTM" in eager[0] and "allow_rnn is off" in eager[0]
    assert not torch._dynamo.config.allow_rnn   # left as torch has it
