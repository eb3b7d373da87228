"""The fused trust-ratio kernel's 16-byte vector path on the packaged models (issue #10 item 5).

GradientSync starts every gradient view of its buckets at a 16-byte aligned offset
(``hpclb.sync.buckets.ALIGN_BYTES``), so that the kernel of ``kernels/trust_ratio.cu`` takes its
vector path on every chunk even where a layer's size is not a multiple of 16 bytes (MNIST-LSTM's
10-class head bias, 40 bytes; an odd vocabulary). Here the unchanged kernel runs on CPU tensors
through the emulator of ``kernels/testing`` (the launcher tests/test_kernel_logic.py uses), driven
by LARS and LAMB exactly as on a GPU, with every ``.grad`` a bucket view; FusedTrust.counters
says how many chunks took the vector path. A control with the padding switched off shows the
count falls, so the test can fail.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from hpclb.comm.local import SelfCommunicator
from hpclb.models import LSTMLanguageModel, MnistLSTM, SmallResNet
from hpclb.optim import LAMB, LARS
from hpclb.optim import fused as K
from hpclb.sync import buckets as parallel
from hpclb.sync.gradients import GradientSync

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "kernels" / "testing"))
import harness as H  # noqa: E402

# slow: building the emulator takes ~12 s, the seven cases ~20 s on one core
pytestmark = [pytest.mark.skipif(H.compiler() is None, reason="needs g++ (C++20)"),
              pytest.mark.timeout(300), pytest.mark.slow]


def _mnist_lstm():
    return MnistLSTM(), torch.randn(8, 28, 28)


def _zaremba_lm():
    # ptb_small's LSTM (2 x 200) with an odd 999-word vocabulary (decoder bias 3,996 bytes, so
    # the views after it need padding); the full 10k vocabulary only adds aligned chunks
    return LSTMLanguageModel(vocab_size=999, hidden_size=200, num_layers=2), \
        torch.randint(0, 999, (4, 6))


def _small_resnet():
    return SmallResNet(depth=20, width=16), torch.randn(4, 1, 28, 28)


MODELS = {"mnist_lstm": _mnist_lstm, "zaremba_lm": _zaremba_lm, "small_resnet": _small_resnet}


@pytest.fixture(scope="module")
def emu(tmp_path_factory) -> H.Emulator:
    import os

    lib = os.environ.get("HPCLB_EMULATOR_LIB") or \
        H.build_emulator(tmp_path_factory.mktemp("emulator"))
    return H.Emulator(lib)


def _loss(model, x) -> torch.Tensor:
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    return out.float().pow(2).mean()


def _step(model, x, opt_name: str, fused: K.FusedTrust | None, steps: int = 2):
    """``steps`` optimizer steps of ``model`` (gradients in GradientSync buckets) on the fused
    path when ``fused`` is given, else the torch path; returns (optimizer, sync)."""
    sync = GradientSync(model.named_parameters(), SelfCommunicator())
    opt = LARS(model.named_parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4) \
        if opt_name == "lars" else LAMB(model.named_parameters(), lr=0.01, weight_decay=0.01)
    with K.use_fused("cpu", fused):
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            _loss(model, x).backward()
            assert sync.synchronize()
            opt.step()
    return opt, sync


def _bucket_views(model, sync) -> int:
    """How many parameters' ``.grad`` lie inside one of ``sync``'s bucket buffers."""
    spans = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.numel() *
              b.buffer.element_size()) for b in sync.buckets]
    return sum(any(lo <= p.grad.data_ptr() < hi for lo, hi in spans)
               for p in model.parameters())


@pytest.mark.parametrize("opt_name", ["lars", "lamb"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_fused_step_takes_the_vector_path_on_every_chunk(emu, model_name, opt_name):
    torch.manual_seed(0)
    model, x = MODELS[model_name]()
    reference = copy.deepcopy(model)
    odd = [n for n, p in model.named_parameters() if (p.numel() * p.element_size()) % 16]
    assert odd, f"{model_name}: every layer is a multiple of 16 bytes, padding is not exercised"
    F = K.FusedTrust(H.EmulatorLauncher(emu))
    opt, sync = _step(model, x, opt_name, F)
    assert _bucket_views(model, sync) == len(list(model.parameters()))
    assert opt.path == "emulator"
    c = F.counters
    assert c["launches"] == 2 * 2 and c["chunks"] > 0
    assert c["vector_chunks"] == c["chunks"], (model_name, c)
    assert c["vector_launches"] == c["launches"]
    ref_opt, _ = _step(reference, x, opt_name, None)
    assert ref_opt.path == "torch"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for key, s in opt.state[p].items():
            if torch.is_tensor(s) and s.is_floating_point():
                torch.testing.assert_close(s, ref_opt.state[q][key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} {key}: {m}")


def test_without_padding_the_vector_path_is_lost(emu, monkeypatch):
    """Control: with 4-byte alignment (no padding) the views after MNIST-LSTM's 40-byte head
    bias start off 16 bytes and their chunks take the scalar path."""
    monkeypatch.setattr(parallel, "ALIGN_BYTES", 4)
    torch.manual_seed(0)
    model, x = _mnist_lstm()
    F = K.FusedTrust(H.EmulatorLauncher(emu))
    _step(model, x, "lars", F, steps=1)
    c = F.counters
    assert c["launches"] == 2 and c["vector_chunks"] < c["chunks"], c
