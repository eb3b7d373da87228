"""Models of the paper's experiments, built by name from an experiment's ``model`` section.

``model.name`` is a key of :data:`MODELS` or a plug-in ``package.module:attribute`` naming an
``nn.Module`` class or a factory returning one (:mod:`hpclb.plugins`, docs/plugins.md).
"""
from __future__ import annotations

from torch import nn

from hpclb.models.gnmt import GNMT
from hpclb.models.lstm_lm import LSTMLanguageModel
from hpclb.models.mnist_lstm import MnistLSTM
from hpclb.models.resnet import ResNet50, SmallResNet

MODELS = {"mnist_lstm": MnistLSTM, "lstm_lm": LSTMLanguageModel, "resnet50": ResNet50,
          "resnet_small": SmallResNet, "gnmt": GNMT}


def model_factory(name: str):
    """The class or factory of model ``name``: a key of :data:`MODELS`, or a plug-in imported by
    :func:`hpclb.plugins.load_object`. Raises ValueError for an unknown built-in name,
    ConfigError (a ValueError) for a plug-in that does not import."""
    from hpclb.plugins import is_plugin, load_object

    if is_plugin(name):
        return load_object(name, "model.name")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)} or name your "
                         f"own as package.module:attribute")
    return MODELS[name]


def build_model(name: str, **kwargs) -> nn.Module:
    """Instantiate model ``name`` (see :func:`model_factory`) with ``kwargs``.

    Raises ValueError for an unknown name, ConfigError when a plug-in does not import or its
    factory returns something other than an ``nn.Module``."""
    model = model_factory(name)(**kwargs)
    if not isinstance(model, nn.Module):
        from hpclb.errors import ConfigError

        raise ConfigError(f"model.name: {name!r} returned a {type(model).__name__}, not a "
                          f"torch.nn.Module; name an nn.Module class or a function returning "
                          f"an instance of one")
    return model
