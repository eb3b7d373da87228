"""LARS/LAMB's step plan (hpclb/optim/plan.py) on the CPU: built once, reused until the parameter
set, a state tensor or a hyper-parameter changes, bit for bit the step that rebuilds everything;
the fused path's tables and rows uploaded from pinned memory, once (issue 25 finding 11); a
compile or launch error of the GPU stack falls back to the torch path with one warning (finding
10); CuPy's cache directory is set before CuPy is imported (finding 9)."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

import hpclb.optim.fused.launcher as L
import hpclb.optim.fused.trust as T
from hpclb.optim import LAMB, LARS
from hpclb.optim import fused as K

pytestmark = pytest.mark.timeout(120)
KW = {LARS: dict(lr=0.1, momentum=0.9, weight_decay=1e-4), LAMB: dict(lr=0.01)}


class NullLauncher:
    """The launcher interface on the CPU; counts launches, runs nothing (``fail`` raises)."""

    name, device = "null", torch.device("cpu")

    def __init__(self, fail: Exception | None = None, pinned: bool = False):
        self.launches, self.fail, self.pinned_uploads = 0, fail, pinned

    def stream_key(self) -> int:
        return 0

    def grid_for(self, n_chunks: int, block: int, kernel: str | None = None) -> int:
        return n_chunks

    def launch(self, name, grid, block, args) -> None:
        if self.fail is not None:
            raise self.fail
        self.launches += 1


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(torch.randn(p.shape, generator=g))


@pytest.fixture(autouse=True)
def _no_refusals(monkeypatch):
    monkeypatch.setattr(T, "_REFUSED", {})


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_plan_reused_until_something_changes(cls):
    model = _model()
    F = K.FusedTrust(NullLauncher())
    opt = cls(model.parameters(), **KW[cls])
    with K.use_fused("cpu", F):
        for step in range(4):
            _grads(model, step)
            opt.step()
        plan = opt._step_plan
        assert F.counters["tables"] == 1 and F.counters["validations"] == 1
        # LARS's rows change with the LR only; LAMB's bias corrections change every step
        assert F.counters["hp_uploads"] == (1 if cls is LARS else 4), F.counters
        opt.param_groups[0]["lr"] *= 0.5                   # a schedule: rows refilled only
        _grads(model, 9)
        opt.step()
        assert opt._step_plan is plan and F.counters["tables"] == 1
        assert F.counters["hp_uploads"] == (2 if cls is LARS else 5)
        first = next(model.parameters())
        first.grad = first.grad.clone()                    # a gradient replaced: a new plan
        opt.step()
        assert opt._step_plan is not plan and F.counters["tables"] == 2
        plan = opt._step_plan
        opt.param_groups[0]["exclude"] = False             # flags change: a new table
        opt.step()
        assert opt._step_plan is not plan and F.counters["tables"] == 3
        plan = opt._step_plan
        key = "momentum_buffer" if cls is LARS else "exp_avg"
        opt.state[first][key] = opt.state[first][key].clone()   # a state tensor replaced
        opt.step()
        assert opt._step_plan is not plan
        plan = opt._step_plan
        opt.load_state_dict(opt.state_dict())              # state loaded
        opt.step()
        assert opt._step_plan is not plan


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_reused_plan_is_bit_for_bit_the_rebuilt_one(cls):
    """The torch path (the CPU's): a plan kept for every step, and one rebuilt every step
    (what every step did before plans), under an LR that changes every step and a found-inf
    step, give the same bits."""
    a, b = _model(1), _model(1)
    oa, ob = cls(a.parameters(), **KW[cls]), cls(b.parameters(), **KW[cls])
    for step in range(6):
        for m, o in ((a, oa), (b, ob)):
            _grads(m, 20 + step)
            for g in o.param_groups:
                g["lr"] = KW[cls]["lr"] * (step + 1) / 6
            o.found_inf = torch.tensor(float(step == 3))
        ob.invalidate_plan()
        oa.step()
        ob.step()
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), step
        assert torch.equal(oa.trust_ratios, ob.trust_ratios)
        assert int(oa.nonfinite_layers) == int(ob.nonfinite_layers)


def test_lamb_step_count_set_by_hand_is_honoured():
    a, b = _model(2), _model(2)
    oa, ob = LAMB(a.parameters(), lr=0.01), LAMB(b.parameters(), lr=0.01)
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        if step == 2:   # a count changed by hand: the plan notices and uses it
            for o, m in ((oa, a), (ob, b)):
                o.state[next(m.parameters())]["step"] = 7
            ob.invalidate_plan()
        oa.step()
        ob.step()
    assert oa.state[next(a.parameters())]["step"] == 8
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_tables_and_rows_come_from_pinned_memory_once(cls, monkeypatch):
    """Finding 11: with a launcher that wants pinned uploads (CUDA's), the descriptor table, the
    chunk map and the rows are copied from pinned host tensors, non-blocking, and the table
    keeps its host sources alive; later steps copy nothing but changed rows."""
    pinned, copies = [], []
    real_copy = torch.Tensor.copy_

    def pin_memory(self):
        out = self.clone()
        pinned.append(out)
        return out

    def copy_(self, src, non_blocking=False):
        if any(src is p for p in pinned):
            copies.append(non_blocking)
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    model = _model()
    F = K.FusedTrust(NullLauncher(pinned=True))
    opt = cls(model.parameters(), **KW[cls])
    with K.use_fused("cpu", F):
        for step in range(3):
            _grads(model, step)
            opt.step()
    rows = 1 if cls is LARS else 3
    assert len(pinned) == 2 + rows and copies == [True] * (2 + rows)
    tab = opt._step_plan.table
    assert all(any(h is p for p in pinned) for h in tab.host)
    assert torch.equal(tab.desc.view(-1), tab.host[0].view(-1))


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_launch_error_falls_back_to_the_torch_path_once(cls, caplog):
    """Finding 10 (launch): a CuPy driver error at launch: the step runs on the torch path (the
    same bits as an optimizer that never had the kernel), one warning, torch from then on."""
    fake = type("CUDADriverError", (RuntimeError,), {"__module__": "cupy_backends.cuda.api.driver"})
    a, b = _model(3), _model(3)
    F = K.FusedTrust(NullLauncher(fail=fake("CUDA_ERROR_NO_BINARY_FOR_GPU")))
    oa, ob = cls(a.parameters(), **KW[cls]), cls(b.parameters(), **KW[cls])
    caplog.set_level(logging.WARNING)
    with K.use_fused("cpu", F):
        for step in range(3):
            _grads(a, step)
            _grads(b, step)
            oa.step()
            ob.step()
            assert oa.path == "torch"
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    warned = [r.getMessage() for r in caplog.records if "fused trust-ratio" in r.getMessage()]
    assert len(warned) == 1 and "launch failed" in warned[0] and "NO_BINARY" in warned[0]


def test_launch_bug_is_not_hidden():
    model = _model()
    F = K.FusedTrust(NullLauncher(fail=TypeError("a bug in hpclb")))
    opt = LARS(model.parameters(), lr=0.1)
    _grads(model, 0)
    with K.use_fused("cpu", F), pytest.raises(TypeError, match="a bug"):
        opt.step()


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A faked CUDA device whose CuPy fails to compile with ``cp.error`` (set by the test)."""
    cp = types.SimpleNamespace(error=None, tries=0)

    class Device:
        def __init__(self, index=0):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RawModule:
        def __init__(self, code, options):
            pass

        def get_function(self, name):
            cp.tries += 1
            raise cp.error

    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(Device=Device, compiler=types.SimpleNamespace(
        CompileException=type("CompileException", (Exception,), {})))
    monkeypatch.setattr(L, "_cupy", lambda: cp)
    monkeypatch.setattr(L, "_CUPY_OK", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(T, "_FUSED", {})
    monkeypatch.delenv("HPCLB_TRUST_BACKEND", raising=False)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    return cp


@pytest.mark.parametrize("module, name", [("cupy_backends.cuda.libs.nvrtc", "NVRTCError"),
                                          ("cupy_backends.cuda.api.driver", "CUDADriverError"),
                                          ("cupy.cuda.compiler", "CompileException")])
def test_compile_error_falls_back_with_one_warning(fake_gpu, caplog, module, name):
    """Finding 10 (compile): was only OSError; an NVRTC, driver or CuPy error escaped every
    step."""
    fake_gpu.error = type(name, (Exception,), {"__module__": module})("nvrtc: error: bad arch")
    caplog.set_level(logging.WARNING)
    assert [K.fused_for("cuda:0") for _ in range(3)] == [None] * 3
    warned = [r.getMessage() for r in caplog.records if "fused trust-ratio" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0] and "torch path" in warned[0]
    assert fake_gpu.tries == 1


def test_compile_bug_is_not_hidden(fake_gpu):
    fake_gpu.error = KeyError("hl_norms_pass1")
    with pytest.raises(KeyError):
        K.fused_for("cuda:0")


def test_cache_dir_is_set_before_cupy_is_imported(monkeypatch, tmp_path):
    """Finding 9: a stand-in ``cupy`` package records $CUPY_CACHE_DIR as it is imported; with a
    home that cannot be written it sees the temporary fallback, not nothing."""
    pkg = tmp_path / "site" / "cupy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os\nSEEN = os.environ.get('CUPY_CACHE_DIR')\n")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))      # cannot be created
    monkeypatch.delenv("CUPY_CACHE_DIR", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    L._cupy.cache_clear()
    try:
        cp = L._cupy()
    finally:
        L._cupy.cache_clear()
        sys.modules.pop("cupy", None)
    assert cp.SEEN is not None and cp.SEEN == L.cupy_cache_dir()
    assert "hpclb-cupy-" in cp.SEEN
