"""What LARS and LAMB share: hyper-parameter checks, which layers are adapted, the path choice
(fused kernel or torch) and what every step leaves behind for the training loop.

A parameter is *excluded* from the trust ratio and from weight decay when its group says
``exclude=True``, or, by default (``exclude=None``), when it has ``ndim < 2`` (biases, norm
scales): You et al.'s LARS and LAMB recipes exclude BN/LayerNorm and biases. Override per
parameter group, e.g. ``[{"params": biases, "exclude": False}, ...]``.

After every :meth:`step` (either path; nothing synchronises with the host):

- ``nonfinite_layers``: 0-d int32 tensor on the parameters' device, the number of layers whose
  ``||w||`` or ``||g||`` (LARS) / ``||u||`` (LAMB) was inf or NaN. Those layers' parameters and
  optimizer state were left untouched by the step (their host-side step count, LAMB's ``step``,
  still advanced).
- ``trust_ratios``: 1-D float32 tensor on that device, the trust ratios of the adapted layers
  (those with a gradient, in parameter-group order) from the last step.
- ``path``: ``"cupy"`` (the fused kernel; ``"emulator"`` in the tests) or ``"torch"``; logged
  once per optimizer, and again only if it changes (with the reason for a fall-back).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.plan import StepPlan, all_grads
from hpclb.optim.trust import check_trust_clamp

__all__ = ["check_range", "check_eps", "LayerwiseOptimizer", "clamp_row", "select_"]

log = logging.getLogger(__name__)


def check_range(name: str, value: float, lo: float, hi: float = float("inf"), *,
                lo_open: bool = False, hi_open: bool = False, hint: str = "") -> None:
    """Raise ValueError naming ``name`` unless ``lo <= value <= hi`` (open ends as flagged);
    ``hint`` (e.g. "typical: 1e-6") is appended to the message."""
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"Invalid {name}: {value} (must be in {left}{lo}, {hi}{right})"
                         + (f"; {hint}" if hint else ""))


def check_eps(eps: float, typical: str) -> None:
    """Raise ValueError unless ``eps`` is finite, > 0 and still > 0 in float32 (it keeps the
    trust-ratio and LAMB denominators away from 0/0). ``typical``: the value to suggest."""
    check_range("eps", eps, 0.0, lo_open=True, hi_open=True,
                hint=f"eps keeps a denominator away from 0 (0/0 gives NaN); typical: {typical}")
    if np.float32(eps) == 0:
        raise ValueError(f"Invalid eps: {eps} (rounds to 0 in float32; use at least 1e-38, "
                         f"typical: {typical})")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Base of LARS and LAMB: exclusion policy, its one-time report, per-layer gathering with
    the sparse-gradient check, path choice, and the per-step outputs of the module docstring.
    Every group's ``eps`` and ``trust_clamp`` are validated as the group is added."""

    _EPS_TYPICAL = "1e-6"

    def __init__(self, params: Iterable, defaults: dict):
        self._reset_outputs()
        super().__init__(params, defaults)
        self._report_exclusions()

    def _reset_outputs(self) -> None:
        """The per-step outputs and caches: not optimizer state (torch's ``__getstate__`` keeps
        only ``defaults``, ``state`` and ``param_groups``), so rebuilt after a copy."""
        self.nonfinite_layers: Tensor | None = None
        self.trust_ratios: Tensor | None = None
        self.path: str | None = None
        self._paths_logged: set[tuple[str, str]] = set()
        self._adapted_index: tuple[tuple, Tensor] | None = None
        self._step_plan: StepPlan | None = None

    def invalidate_plan(self) -> None:
        """Drop the step plan (:mod:`hpclb.optim.plan`): the next :meth:`step` gathers the layers,
        checks them and finds the kernel table again. Needed only after a change the plan does
        not see (a parameter's state dict replaced wholesale, a group's ``params`` list edited
        in place)."""
        self._step_plan = None

    def __setstate__(self, state: dict) -> None:
        """``copy.deepcopy`` and ``pickle``: torch restores the state and groups; the step's
        outputs start empty, as after construction."""
        super().__setstate__(state)
        self._reset_outputs()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._step_plan = None
        group = self.param_groups[-1]
        check_eps(group["eps"], self._EPS_TYPICAL)
        group["trust_clamp"] = check_trust_clamp(group.get("trust_clamp"))

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
        """``(group, param)`` for every parameter with a gradient, in group order.
        Raises RuntimeError naming the parameter when a gradient is sparse."""
        pairs = []
        for k, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.layout != torch.strided:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients (parameter "
                        f"{self._name(k, j)}); use dense embeddings (nn.Embedding(sparse=False))")
                pairs.append((group, p))
        return pairs

    def _name(self, k: int, j: int) -> str:
        names = self.param_groups[k].get("param_names")
        return names[j] if names else f"param_groups[{k}]['params'][{j}]"

    def _layer_names(self, pairs: list[tuple[dict, Tensor]]) -> list[str]:
        where = {id(p): self._name(k, j) for k, g in enumerate(self.param_groups)
                 for j, p in enumerate(g["params"])}
        return [where[id(p)] for _, p in pairs]

    #: the optimizer-state tensors a step reads and writes, per layer (in the kernel's order)
    _STATE_KEYS: tuple[str, ...] = ()
    _KIND = ""

    def _init_state(self, params: list[Tensor]) -> None:
        """Create the state of ``params`` that have none (called as a plan is built)."""

    def _plan_rows(self, plan: StepPlan) -> None:
        """Set ``plan.rows`` (each layer's hyper-parameter row); default: its group."""

    def _plan(self) -> StepPlan:
        """The step plan (:mod:`hpclb.optim.plan`): the one of the last step when it still fits,
        else a new one (layers gathered and checked, state created, fused path chosen, its
        table found). Raises RuntimeError naming a parameter whose gradient is sparse."""
        grads_all = all_grads(self.param_groups)
        plan = self._step_plan
        if plan is not None and plan.fits(self, grads_all) and self._fused_fits(plan):
            return plan
        plan = StepPlan(self, grads_all, self._STATE_KEYS)
        self._plan_rows(plan)
        if plan.params:
            self._choose_fused(plan)
        self._step_plan = plan
        return plan

    @staticmethod
    def _stream_key(fused: kernels.FusedTrust) -> int:
        return int(getattr(fused.launcher, "stream_key", lambda: 0)())

    def _fused_fits(self, plan: StepPlan) -> bool:
        if not plan.params:
            return True
        fused = kernels.fused_for(plan.device)
        return fused is plan.fused and (fused is None or self._stream_key(fused) == plan.stream)

    def _choose_fused(self, plan: StepPlan) -> None:
        """The fused kernel when it serves the plan's layers (``plan.fused``, ``plan.table``),
        else the torch path (``plan.fused`` None); announces the path once (module
        docstring)."""
        lists = (plan.params, plan.grads, *plan.tensors.values())
        fused = kernels.fused_for(plan.device)
        reason = ""
        if fused is not None:
            reason = fused.why_not(*lists, names=self._layer_names(plan.pairs)) or ""
            if reason:
                fused = None
        if fused is not None:
            plan.fused, plan.stream = fused, self._stream_key(fused)
            plan.table = fused.table(*lists, adapt=plan.adapt, rows=plan.rows)
        self._announce("torch" if fused is None else fused.launcher.name, plan.device, reason)

    def _run_fused(self, plan: StepPlan) -> kernels.TrustResult | None:
        """Both passes of the fused step over the plan (its rows uploaded); None when a launch
        failed in the GPU stack (:func:`hpclb.optim.fused.is_backend_error`): the device is
        refused from then on (one warning) and the caller runs the torch path instead (pass 1
        writes no parameter or state, and a failed launch runs nothing)."""
        try:
            return plan.fused.run_step(self._KIND, plan.table, plan.hp)
        except Exception as e:
            if not kernels.is_backend_error(e):
                raise
            kernels.refuse(plan.device, e, "launch")
            self._step_plan = None
            return None

    def _announce(self, path: str, device: torch.device, reason: str) -> None:
        self.path = path
        if (path, reason.split(" ", 2)[-1]) in self._paths_logged:
            return
        self._paths_logged.add((path, reason.split(" ", 2)[-1]))
        name = type(self).__name__
        if reason:
            log.warning("%s: torch path on %s, not the fused kernel: %s", name, device, reason)
        elif path == "torch":
            log.info("%s: torch path on %s (torch._foreach ops)", name, device)
        else:
            log.info("%s: fused trust-ratio kernel (%s, 2 launches per step) on %s", name, path,
                     device)

    def _record(self, ratios: Tensor, nonfinite: Tensor, adapt: list[bool]) -> None:
        """Keep the step's non-finite count and the adapted layers' ratios (device-side)."""
        self.nonfinite_layers = nonfinite.reshape(()).to(torch.int32)
        key = (tuple(adapt), ratios.device)
        if self._adapted_index is None or self._adapted_index[0] != key:
            idx = torch.tensor([i for i, a in enumerate(adapt) if a], dtype=torch.long)
            self._adapted_index = (key, idx.to(ratios.device))
        self.trust_ratios = ratios.index_select(0, self._adapted_index[1]).to(torch.float32)

    @staticmethod
    def _finite(*norms: Tensor) -> Tensor:
        """bool ``[n]``: the layer's norms are all finite (it will be updated)."""
        ok = torch.isfinite(norms[0])
        for n in norms[1:]:
            ok &= torch.isfinite(n)
        return ok


def clamp_row(group: dict[str, Any]) -> tuple[float, float]:
    """``(HP_TMIN, HP_TMAX)`` for the fused kernel's hyper-parameter row (0, 0 = no clamp)."""
    clamp = group.get("trust_clamp")
    if clamp is None:
        return 0.0, 0.0
    lo, hi = (float(x) for x in clamp)
    return lo, (0.0 if math.isinf(hi) and lo == 0 else hi)


def select_(update: Tensor, olds: Sequence[Tensor], news: Sequence[Tensor]) -> None:
    """In place ``old <- new`` for the layers where ``update`` (bool ``[n]``) is True; the others
    keep their values bit for bit. A device-side select per layer, no host sync."""
    for k, old, new in zip(update.unbind(), olds, news):
        torch.where(k, new, old, out=old)
