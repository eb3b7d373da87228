"""Batches copied to a GPU are pinned contiguous: a PTB window is a strided view of the rank's
streams, and pinning the view itself would pin its whole storage span (the rank's share) and
then copy through pageable memory. No GPU here: ``pin_memory`` and the copy are stand-ins that
record what they were handed."""
from __future__ import annotations

import pytest
import torch

from hpclb.data.loader import pin_batch
from hpclb.data.ptb import rank_streams
from hpclb.tasks.base import to_device

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fake_cuda_copy(monkeypatch):
    pinned, copied = [], []
    real_to = torch.Tensor.to

    def pin_memory(self):
        pinned.append((self.is_contiguous(), self.untyped_storage().nbytes()))
        return self.clone()

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copied.append((self.is_contiguous(), kwargs.get("non_blocking")))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return pinned, copied


def test_a_ptb_window_is_pinned_contiguous(fake_cuda_copy):
    pinned, copied = fake_cuda_copy
    x, y, _ = rank_streams(torch.arange(100_001), 20, 0, 1)       # 20 streams of 5000 tokens
    window = x[0:20, 35:70]                                        # what LanguageModel.batch cuts
    assert not window.is_contiguous()
    out = to_device((window, y[0:20, 35:70], slice(0, 20)), torch.device("cuda", 0))
    assert torch.equal(out[0], window) and torch.equal(out[1], y[0:20, 35:70])
    assert out[2] == slice(0, 20)
    assert pinned == [(True, 20 * 35 * 8)] * 2      # the window's bytes, not the 800 KB streams
    assert copied == [(True, True)] * 2


def test_pin_batch_keeps_a_contiguous_batch(fake_cuda_copy):
    pinned, _ = fake_cuda_copy
    images = torch.zeros(8, 1, 28, 28)
    assert torch.equal(pin_batch(images), images) and pinned == [(True, images.nbytes)]
