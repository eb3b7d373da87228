"""Models of the paper's experiments, built by name from an experiment's ``model`` section.

``model.name`` is a key of :data:`MODELS` or a plug-in ``package.module:attribute`` naming an
``nn.Module`` class or a factory returning one (:mod:`hpclb.plugins`, docs/plugins.md).

:data:`MODELS` holds ``"module:attribute"`` references, so listing the names does not import
torch; the model classes below are imported on first use (PEP 562). To add a model,
``MODELS.register("name", "package.module:Class")`` (or the class itself).
"""
from __future__ import annotations

import importlib
import re

from hpclb.plugins import Registry

__all__ = ["GNMT", "MODELS", "LSTMLanguageModel", "MnistLSTM", "ResNet50", "SmallResNet",
           "build_model", "model_factory"]

MODELS: Registry = Registry("model", {
    "mnist_lstm": "hpclb.models.mnist_lstm:MnistLSTM",
    "lstm_lm": "hpclb.models.lstm_lm:LSTMLanguageModel",
    "resnet50": "hpclb.models.resnet:ResNet50",
    "resnet_small": "hpclb.models.resnet:SmallResNet",
    "gnmt": "hpclb.models.gnmt:GNMT",
})
_CLASSES = {"MnistLSTM": "mnist_lstm", "LSTMLanguageModel": "lstm_lm", "ResNet50": "resnet",
            "SmallResNet": "resnet", "GNMT": "gnmt"}


def __getattr__(name: str):
    if name in _CLASSES:
        value = getattr(importlib.import_module(f"hpclb.models.{_CLASSES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpclb.models' has no attribute {name!r}")


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
    return MODELS.load(name)


def build_model(name: str, **kwargs):
    """Instantiate model ``name`` (see :func:`model_factory`) with ``kwargs``: an ``nn.Module``.

    Raises ValueError for an unknown name; ConfigError when a plug-in does not import, its
    factory returns something other than an ``nn.Module``, or the constructor refuses its
    arguments: a ValueError or TypeError of a built-in model, or of a plug-in when it names an
    argument (the message names ``model.<field>``, the constructor's exception is chained). A
    plug-in's other exceptions propagate (its own bug: the user's ``file:line`` tells where)."""
    from torch import nn

    from hpclb.errors import ConfigError
    from hpclb.plugins import is_plugin

    factory = model_factory(name)
    try:
        model = factory(**kwargs)
    except (TypeError, ValueError) as e:
        named = [k for k in kwargs if re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", str(e))]
        if isinstance(e, ConfigError) or (is_plugin(name) and not named):
            raise
        raise ConfigError(_refused(name, kwargs, named, e)) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: {name!r} returned a {type(model).__name__}, not a "
                          f"torch.nn.Module; name an nn.Module class or a function returning "
                          f"an instance of one")
    return model


def _refused(name: str, kwargs: dict, named: list[str], e: Exception) -> str:
    """The message of a constructor's ValueError/TypeError ``e`` naming the arguments
    ``named`` (all of them when none is)."""
    if named:
        fields = ", ".join(f"model.{k}: {kwargs[k]!r}" for k in named)
        fix = f"fix {' and '.join(f'model.{k}' for k in named)} in the recipe"
    else:
        fields = "model: " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        fix = "fix the recipe's model section"
    return f"{fields}: refused by model {name!r} ({type(e).__name__}: {e}); {fix}"
