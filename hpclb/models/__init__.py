"""Models of the paper's experiments, built by name from an experiment's ``model`` section."""
from __future__ import annotations

from torch import nn

from .gnmt import GNMT
from .lstm_lm import LSTMLanguageModel
from .mnist_lstm import MnistLSTM
from .resnet import ResNet50, SmallResNet

MODELS = {"mnist_lstm": MnistLSTM, "lstm_lm": LSTMLanguageModel, "resnet50": ResNet50,
          "resnet_small": SmallResNet, "gnmt": GNMT}


def build_model(name: str, **kwargs) -> nn.Module:
    """Instantiate model ``name`` with ``kwargs``. Raises ValueError for an unknown name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)
