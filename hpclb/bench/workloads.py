"""The models the benchmarks reduce gradients of, defined here in plain torch (torchvision does
not import beside this torch).

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


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.down = None
        if stride != 1 or cin != width:
            self.down = nn.Sequential(nn.Conv2d(cin, width, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(width))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ImageNet-style ResNet (He et al. 2016). Input float32 ``[batch, 3, H, W]`` (any H, W >=
    32; 224 in the paper), output logits ``[batch, num_classes]``."""

    def __init__(self, block, layers: list[int], num_classes: int = 1000, stem: str = "imagenet"):
        super().__init__()
        if stem == "imagenet":
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        else:  # CIFAR-style: 3x3, stride 1, no pooling
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU())
        cin, stages = 64, []
        for i, (n, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        y = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


def resnet18_cifar(num_classes: int = 10) -> ResNet:
    """ResNet-18 with a CIFAR stem (11.2 M parameters), for 32x32 inputs."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, stem="cifar")


class LSTMLanguageModel(nn.Module):
    """Zaremba et al. word LM: embedding, stacked LSTM, linear decoder (untied). Input int64
    ``[batch, steps]`` token ids, output logits ``[batch, steps, vocab]``."""

    def __init__(self, vocab: int = 10000, hidden: int = 1500, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.decoder(out)


def ptb_large() -> LSTMLanguageModel:
    return LSTMLanguageModel(10000, 1500, 2)


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
    from ..models import MnistLSTM
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


def num_params(name: str) -> int:
    return sum(int(torch.Size(s).numel()) for _, s in gradient_shapes(name))
