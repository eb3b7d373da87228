"""Residual networks (He et al., *Deep Residual Learning*, CVPR 2016) in plain torch.

- :class:`ResNet50`: ImageNet ResNet-50 v1.5 (bottleneck blocks [3, 4, 6, 3], stride on the
  3x3 conv), input float32 ``[b, 3, 224, 224]`` -> logits ``[b, num_classes]``; the model of
  You et al.'s 32K-batch LARS + LEGW runs. 25,557,032 parameters at 1000 classes.
- :class:`SmallResNet`: the CIFAR-style ResNet-(6n+2) (three stages of ``n`` basic blocks,
  widths ``w, 2w, 4w``), for 28x28 grey images (Fashion-MNIST): input ``[b, in_channels, H, W]``.

BatchNorm keeps running statistics per rank (not synchronised): the usual large-batch setup,
each rank normalises its own share of the batch. The last BN of each block starts at zero
(Goyal et al. 2017), which the large-batch recipes rely on.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet50", "SmallResNet"]


def _bn(c: int, zero: bool = False) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    if zero:
        nn.init.zeros_(bn.weight)
    return bn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al. 2016, Fig. 2 left); input and
    output ``(N, C, H, W)`` float, ``H`` and ``W`` divided by ``stride``."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _bn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _bn(cout, zero=True)
        self.short = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), _bn(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.short is None else self.short(x)))


class Bottleneck(nn.Module):
    """1x1, 3x3, 1x1 convolutions with a residual connection (He et al. 2016, Fig. 5 right);
    ``width * expansion`` output channels, ``H`` and ``W`` divided by ``stride``."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = _bn(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = _bn(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = _bn(cout, zero=True)
        self.short = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), _bn(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.short is None else self.short(x)))


def _init(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


class _ResNet(nn.Module):
    """stem -> residual blocks -> global average pool -> linear; subclasses build the parts."""

    stem: nn.Module
    layers: nn.Module
    fc: nn.Linear

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ResNet50(_ResNet):
    """ImageNet ResNet-50 (v1.5). ``[b, 3, H, W]`` (H, W >= 32) -> ``[b, num_classes]``."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False), _bn(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)
        _init(self)



class SmallResNet(_ResNet):
    """ResNet-(6n+2) for small images: 3x3 stem (``width`` channels), stages of ``n`` basic blocks
    at widths ``width, 2*width, 4*width`` (stride 2 between stages), global average pool, linear.
    ``depth = 6n + 2`` (20, 32, 44, 56, 110). Raises ValueError for another depth."""

    def __init__(self, depth: int = 20, width: int = 16, num_classes: int = 10,
                 in_channels: int = 1):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"SmallResNet depth must be 6n+2 (20, 32, 44, ...), got {depth}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                                  _bn(width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for stage in range(3):
            cout = width * 2 ** stage
            for i in range(n):
                layers.append(BasicBlock(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)
        _init(self)

