"""Layer-wise large-batch optimizers (LARS, LAMB) and their shared trust-ratio computation.

:data:`OPTIMIZERS` is the registry of the optimizers a recipe may name: name -> builder
``builder(named_parameters, **hyper_parameters) -> torch.optim.Optimizer`` (a function or a
``"module:attribute"`` string). It and this package load without torch; the classes are
imported on first use (PEP 562).
"""
from __future__ import annotations

import importlib

from hpclb.plugins import Registry

__all__ = ["LAMB", "LARS", "OPTIMIZERS", "lamb_trust_ratios", "lars_trust_ratios", "layer_norms"]

_EXPORTS = {"LARS": "lars", "LAMB": "lamb", "lars_trust_ratios": "trust",
            "lamb_trust_ratios": "trust", "layer_norms": "trust"}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"hpclb.optim.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpclb.optim' has no attribute {name!r}")


def _sgd(params, **hp):
    import torch

    return torch.optim.SGD(params, **hp)


def _momentum(params, **hp):
    hp.setdefault("momentum", 0.9)
    return _sgd(params, **hp)


def _adam(params, **hp):
    import torch

    return torch.optim.Adam(params, **hp)


OPTIMIZERS: Registry = Registry("optimizer", {
    "sgd": _sgd, "momentum": _momentum, "adam": _adam,
    "lars": "hpclb.optim.lars:LARS", "lamb": "hpclb.optim.lamb:LAMB",
})
