"""The models the benchmarks reduce gradients of: the package's own models (hpclb.models) where
it has them, and GNMT's parameter shapes (torchvision does not import beside this torch).

``WORKLOADS[name]()`` builds the module; ``gradient_shapes(name)`` lists its parameters' shapes
without allocating them (meta device). Parameter counts: ResNet-50 25,557,032 (as published);
PTB-large LSTM (Zaremba et al. 2014: 2 x 1500, 10k vocabulary, untied) 66,034,000 (torch's LSTM
keeps two bias vectors); GNMT (Wu et al. 2016: 8+8 LSTM layers of 1024, bidirectional first
encoder layer, additive attention, separate 32k embeddings) 280,928,512; MNIST-LSTM (1 x 128)
82,186; ResNet-18 with a CIFAR stem 11,173,962.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from torch import nn

from hpclb.models.lstm_lm import LSTMLanguageModel
from hpclb.models.resnet import BasicBlock, ResNet50

__all__ = [
    "WORKLOADS", "GNMTShapes", "gradient_shapes", "mnist_lstm", "ptb_large", "resnet18_cifar",
    "resnet50"]


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ImageNet ResNet-50 of :mod:`hpclb.models.resnet` (25,557,032 parameters at 1000 classes)."""
    return ResNet50(num_classes)


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """ResNet-18 with a CIFAR stem (3x3, stride 1, no pooling; 11.2 M parameters), for 32x32
    RGB inputs ``[b, 3, 32, 32]``, built from :class:`hpclb.models.resnet.BasicBlock`."""
    layers, cin = [], 64
    for stage, width in enumerate((64, 128, 256, 512)):
        for i in range(2):
            layers.append(BasicBlock(cin, width, 2 if stage and i == 0 else 1))
            cin = width
    return nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(cin, num_classes))


def ptb_large() -> nn.Module:
    """Zaremba et al.'s large word LM of :mod:`hpclb.models.lstm_lm` (2 x 1500, 10k vocabulary)."""
    return LSTMLanguageModel(vocab_size=10000, hidden_size=1500, num_layers=2)


class GNMTShapes(nn.Module):
    """GNMT's parameters (Wu et al. 2016) for gradient-size studies; no forward."""

    def __init__(self, vocab: int = 32000, hidden: int = 1024, layers: int = 8):
        super().__init__()
        self.src_embed = nn.Embedding(vocab, hidden)
        self.tgt_embed = nn.Embedding(vocab, hidden)
        self.enc_bi = nn.LSTM(hidden, hidden, 1, bidirectional=True)
        self.enc = nn.ModuleList([nn.LSTM(2 * hidden if i == 0 else hidden, hidden)
                                  for i in range(layers - 1)])
        self.att_q = nn.Linear(hidden, hidden, bias=False)
        self.att_k = nn.Linear(hidden, hidden, bias=False)
        self.att_v = nn.Parameter(torch.empty(hidden))
        self.dec = nn.ModuleList([nn.LSTM(2 * hidden, hidden) for _ in range(layers)])
        self.classifier = nn.Linear(hidden, vocab)


def mnist_lstm() -> nn.Module:
    """The MNIST-LSTM of :mod:`hpclb.models` (one LSTM layer of 128 units, 82,186 parameters), for
    float32 inputs ``[b, 28, 28]``."""
    from hpclb.models import MnistLSTM
    return MnistLSTM(hidden_size=128)


WORKLOADS: dict[str, Callable[[], nn.Module]] = {
    "resnet50": resnet50, "ptb_large": ptb_large, "gnmt": GNMTShapes, "mnist_lstm": mnist_lstm,
    "resnet18_cifar": resnet18_cifar,
}


@lru_cache(maxsize=None)
def gradient_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(parameter name, shape)`` of workload ``name`` in registration order (fp32 gradients),
    built on the meta device (nothing allocated). Raises KeyError for an unknown name."""
    with torch.device("meta"):
        model = WORKLOADS[name]()
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # cached: read-only
