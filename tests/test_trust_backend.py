"""Backend choice of hpclb.optim.trust, the lazy CuPy import, and the trust-ratio benchmark."""
from __future__ import annotations

import logging
import math
import subprocess
import sys

import torch

from hpclb.bench import shapes
from hpclb.optim import fused as K
from hpclb.optim import trust
from hpclb.optim.fused import trust as fused_trust


def test_cpu_tensors_take_the_torch_backend_and_say_so_once(caplog, monkeypatch):
    monkeypatch.setattr(trust, "_announced", set())
    ws = [torch.randn(4, 3), torch.randn(3)]
    with caplog.at_level(logging.INFO, logger="hpclb.optim.trust"):
        assert trust.backend_for(ws) == "torch"
        trust.lars_trust_ratios(ws, ws, trust_coefficient=1e-3, weight_decay=0.0, eps=0.0,
                                adapt=[True, False])
    lines = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert lines == ["trust ratios: backend torch on cpu"]
    assert K.fused_for("cpu") is None


def test_importing_hpclb_does_not_import_cupy():
    code = ("import sys, torch; import hpclb.optim, hpclb.optim.fused, hpclb.cli;"
            "from hpclb.optim import trust; trust.layer_norms([torch.ones(3)]);"
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_forced_torch_backend_and_missing_cuda(monkeypatch):
    monkeypatch.setenv("HPCLB_TRUST_BACKEND", "torch")
    assert K.fused_for("cuda:0") is None
    monkeypatch.setenv("HPCLB_TRUST_BACKEND", "auto")
    if not torch.cuda.is_available():
        # fused_for (hpclb.optim.fused.trust) is where cupy_available is looked up
        monkeypatch.setattr(fused_trust, "cupy_available", lambda: False)
        assert K.fused_for("cuda:0") is None


def test_parameter_sets_are_the_real_models():
    def count(s):
        return len(s), sum(math.prod(shape) for _, shape in s)

    assert count(shapes.RESNET50) == (161, 25_557_032)
    assert count(shapes.BERT_LARGE) == (391, 335_141_888)
    # a few well-known shapes
    assert dict(shapes.RESNET50)["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert dict(shapes.BERT_LARGE)["embeddings.word_embeddings.weight"] == (30522, 1024)
