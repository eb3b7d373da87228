"""What LARS and LAMB share: hyper-parameter checks and which layers are adapted.

A parameter is *excluded* from the trust ratio and from weight decay when its group says
``exclude=True``, or, by default (``exclude=None``), when it has ``ndim < 2`` (biases, norm
scales): You et al.'s LARS and LAMB recipes exclude BN/LayerNorm and biases. Override per
parameter group, e.g. ``[{"params": biases, "exclude": False}, ...]``.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def check_range(name: str, value: float, lo: float, hi: float = float("inf"), *,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``lo <= value <= hi`` (open ends as flagged)."""
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"Invalid {name}: {value} (must be in {left}{lo}, {hi}{right})")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Base of LARS and LAMB: exclusion policy, its one-time report, and per-layer gathering."""

    def __init__(self, params: Iterable, defaults: dict):
        super().__init__(params, defaults)
        self._report_exclusions()

    @staticmethod
    def is_adapted(p: Tensor, group: dict) -> bool:
        """True when ``p`` gets a trust ratio and weight decay (see the module docstring)."""
        exclude = group.get("exclude")
        return p.ndim >= 2 if exclude is None else not exclude

    def _report_exclusions(self) -> None:
        excluded, adapted = [], 0
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for name, p in zip(names, group["params"]):
                if self.is_adapted(p, group):
                    adapted += 1
                else:
                    excluded.append(f"{name or 'param'}{list(p.shape)}")
        log.info("%s: %d parameter tensors adapted; %d excluded from trust ratio and weight "
                 "decay: %s", type(self).__name__, adapted, len(excluded),
                 ", ".join(excluded) or "none")

    def _gather(self) -> list[tuple[dict, Tensor]]:
        """``(group, param)`` for every parameter with a gradient, in group order."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
