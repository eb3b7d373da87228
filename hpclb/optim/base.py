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
from itertools import chain
from operator import attrgetter, is_, itemgetter, methodcaller
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from hpclb.optim import fused as kernels
from hpclb.optim.plan import StepPlan

__all__ = ["check_range", "check_eps", "check_trust_clamp", "LayerwiseOptimizer", "clamp_row",
           "host_to_device", "unscale_grads_"]

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

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every layer with a gradient (the subclass's module docstring).

        torch's ``_step_supports_amp_scaling`` contract (``GradScaler.step``, and
        :class:`hpclb.DistributedOptimizer`'s non-finite guard), gathered here as torch's
        ``Adam.step`` does: ``grad_scale`` (when set and not None) divides the gradients first;
        ``found_inf`` (0-d tensor; when set and not 0) leaves every layer and its optimizer
        state as they were, decided on the device (no host read), handed as an argument to the
        kernel or to the torch path's math. Raises RuntimeError naming a parameter whose
        gradient is sparse."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan()
        if not plan.params:
            return loss
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self._hyper(plan)
        res = None
        if plan.fused is not None:
            res = self._run_fused(plan, grad_scale, found_inf)
            if res is None:   # the launch failed: the torch path from now on
                plan = self._build(plan.grads_all)
                self._hyper(plan)
        if res is None:
            ratios, nonfinite, adapted = self._torch_step(plan, grad_scale, found_inf)
        else:
            ratios, nonfinite, adapted = res.ratio, res.nonfinite, plan.adapted
        self.nonfinite_layers = nonfinite.reshape(()).to(torch.int32)
        self.trust_ratios = ratios.index_select(0, adapted).to(torch.float32)
        return loss

    def _hyper(self, plan: StepPlan) -> None:
        """The plan's hyper-parameters (``plan.cache``; the fused path's rows, uploaded),
        refilled when a group's value changed since the last step."""

    def _torch_step(self, plan: StepPlan, grad_scale: Tensor | None,
                    found_inf: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The step on the torch path: ``(ratios, nonfinite count, index of the adapted
        layers in ratios)``."""
        raise NotImplementedError

    def _init_state(self, params: list[Tensor]) -> None:
        """Create the state of ``params`` that have none (called as a plan is built)."""

    def _plan_rows(self, plan: StepPlan) -> None:
        """Set ``plan.rows`` (each layer's hyper-parameter row); default: its group."""

    def _plan(self) -> StepPlan:
        """The step plan (:mod:`hpclb.optim.plan`): the one of the last step when it still
        describes the optimizer (checked by identity; what it watches: that module's
        docstring), else a new one (:meth:`_build`)."""
        grads = list(map(_GRAD, chain.from_iterable(map(_PARAMS, self.param_groups))))
        plan = self._step_plan
        if plan is not None and self.state is plan.state_dict_obj \
                and len(grads) == len(plan.grads_all) and all(map(is_, grads, plan.grads_all)) \
                and list(map(_EXCLUDE, self.param_groups)) == plan.exclude \
                and plan.served == kernels.SERVED[0] \
                and (plan.fused is None or self._stream_key(plan.fused) == plan.stream):
            for get, held in plan.held:   # the state tensors: the same objects
                if not all(map(is_, map(get, plan.states), held)):
                    break
            else:
                return plan
        return self._build(grads)

    def _build(self, grads_all: list) -> StepPlan:
        """A new plan: layers gathered and checked, state created, the fused path chosen and
        its table found. Raises RuntimeError naming a parameter whose gradient is sparse."""
        plan = StepPlan(self, grads_all, self._STATE_KEYS, kernels.SERVED[0])
        self._plan_rows(plan)
        if plan.params:
            self._choose_fused(plan)
        self._step_plan = plan
        return plan

    @staticmethod
    def _stream_key(fused: kernels.FusedTrust) -> int:
        return int(getattr(fused.launcher, "stream_key", lambda: 0)())

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

    def _run_fused(self, plan: StepPlan, grad_scale: Tensor | None,
                   found_inf: Tensor | None) -> kernels.TrustResult | None:
        """Both passes of the fused step over the plan (its rows uploaded by :meth:`_hyper`),
        the gradients unscaled first, ``found_inf`` handed to the kernel; None when a launch
        failed in the GPU stack (:func:`hpclb.optim.fused.is_backend_error`): the device is
        refused from then on (one warning) and the caller runs the torch path instead (pass 1
        writes no parameter or state, and a failed launch runs nothing)."""
        if grad_scale is not None:
            unscale_grads_(plan.nonempty, grad_scale)
        try:
            return plan.fused.run_step(self._KIND, plan.table, plan.hp, found_inf=found_inf)
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


_GRAD, _PARAMS, _EXCLUDE = attrgetter("grad"), itemgetter("params"), methodcaller("get", "exclude")


def clamp_row(group: dict[str, Any]) -> tuple[float, float]:
    """``(HP_TMIN, HP_TMAX)`` for the fused kernel's hyper-parameter row (0, 0 = no clamp)."""
    clamp = group.get("trust_clamp")
    if clamp is None:
        return 0.0, 0.0
    lo, hi = (float(x) for x in clamp)
    return lo, (0.0 if math.isinf(hi) and lo == 0 else hi)


def check_trust_clamp(trust_clamp: Any) -> tuple[float, float] | None:
    """``trust_clamp`` as ``(min, max)`` floats, or None. Raises ValueError unless it is None or
    two numbers with ``0 <= min < max`` (max may be inf), e.g. ``(0.0, 10.0)``."""
    if trust_clamp is None:
        return None
    try:
        lo, hi = (float(x) for x in trust_clamp)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (0.0 <= lo < hi):   # also false for NaN
        raise ValueError(f"Invalid trust_clamp: {trust_clamp!r} (must be None or (min, max) "
                         "with 0 <= min < max, e.g. (0.0, 10.0))")
    return lo, hi


def host_to_device(values: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` (host numbers, a list or a NumPy array) as a ``dtype`` tensor on ``device``:
    for a CUDA device through pinned memory with ``non_blocking=True`` (a pageable copy would
    wait for the stream: a host synchronisation per call)."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def unscale_grads_(grads: Sequence[Tensor], grad_scale: Tensor | None) -> None:
    """Divide ``grads`` by ``grad_scale`` in place (as ``GradScaler.unscale_`` does); no-op for
    None. Part of torch's ``_step_supports_amp_scaling`` contract (``GradScaler.step`` sets
    ``optimizer.grad_scale`` when the gradients are still scaled)."""
    if grad_scale is None:
        return
    grads = [g for g in grads if g.numel()]
    if grads:
        torch._foreach_div_(grads, grad_scale.to(grads[0].device))
