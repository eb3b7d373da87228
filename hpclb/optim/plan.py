"""The step plan of LARS and LAMB: what a step needs that changes only with the parameter set,
the optimizer state's tensors or a hyper-parameter, built once and reused by every later step.

A training step passes the same parameters, gradient tensors (bucket views, or gradients that
backward accumulates into) and state tensors every time. Gathering the layers with gradients,
their exclusion flags, state tensors, hyper-parameter rows and the fused kernel's descriptor
table cost about 3 us per tensor and step (issue 26); the plan holds them. Each step checks, by
identity (C-speed comparisons, about 0.1 us per tensor; no function call), that it still
fits; it is rebuilt when

- a parameter gains or loses its gradient, or a gradient tensor is replaced (``set_to_none``);
- a state tensor (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) is replaced, the state is
  loaded (``load_state_dict``), a group is added, or a group's ``exclude`` changes;
- LAMB: a step count differs from the one the plan expects (set by hand);
- the fused kernel's availability changes (an override installed or removed, a device refused:
  counted in :data:`hpclb.optim.fused.SERVED`) or, on the fused path, torch's current stream.

Its hyper-parameter rows are refilled (and uploaded, from pinned memory) only when a group's
hyper-parameter value changes (the LR under a schedule, LAMB's bias corrections every step).
Not seen (call :meth:`~hpclb.optim.base.LayerwiseOptimizer.invalidate_plan`): one parameter's
state dict replaced wholesale (``opt.state[p] = {...}``), a group's ``params`` list edited in
place while keeping its length.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["StepPlan"]


class StepPlan:
    """One optimizer's layers with gradients and everything a step derives from them.

    Attributes: ``pairs`` ``(group, param)`` in group order; ``params``, ``grads`` (the
    gradient tensors), ``nonempty`` (those with elements), ``adapt`` (tuple of bool: trust
    ratio and weight decay), ``adapted`` (long ``[k]`` on the device: the adapted layers'
    indices), ``group_index`` (each layer's group), ``states`` (each layer's state dict),
    ``tensors`` (state key -> that tensor per layer), ``held`` (``(itemgetter(key), tensors)``
    pairs: what the optimizer checks each step), ``device``, ``norm_dtype`` (float64 when every
    parameter is fp64, float32 when none is, None when mixed); ``fused`` (the
    :class:`~hpclb.optim.fused.FusedTrust` or None) with ``table`` and ``stream``; ``served``
    (the :data:`hpclb.optim.fused.SERVED` count it was chosen under); ``rows`` (each layer's
    hyper-parameter row, set by the optimizer), ``hp`` (device rows, or None until uploaded)
    and ``hp_key`` (the values they were filled from). ``cache``: whatever the optimizer
    derives from the hyper-parameters (refilled when they change).
    """

    def __init__(self, opt: Any, grads_all: list, state_keys: Sequence[str], served: int):
        self.state_dict_obj = opt.state
        self.grads_all = grads_all
        self.served = served
        self.exclude = [g.get("exclude") for g in opt.param_groups]
        self.pairs = opt._gather()
        self.params = [p for _, p in self.pairs]
        self.grads = [p.grad for p in self.params]
        self.nonempty = [g for g in self.grads if g.numel()]
        self.adapt = tuple(opt.is_adapted(p, g) for g, p in self.pairs)
        where = {id(g): k for k, g in enumerate(opt.param_groups)}
        self.group_index = [where[id(g)] for g, _ in self.pairs]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.adapted = adapted_index(self.adapt, self.device)
        wide = [p.dtype == torch.float64 for p in self.params]
        self.norm_dtype = torch.float64 if all(wide) else None if any(wide) else torch.float32
        opt._init_state(self.params)
        self.states = [opt.state[p] for p in self.params]
        self.tensors = {k: [st[k] for st in self.states] for k in state_keys}
        self.held = [(itemgetter(k), ts) for k, ts in self.tensors.items()]
        self.fused: Any = None   # hpclb.optim.fused.FusedTrust or None
        self.table: Any = None
        self.stream = 0
        self.rows: list[int] = list(self.group_index)
        self.hp: Tensor | None = None
        self._hp_source: Any = None
        self.hp_key: Any = None
        self.cache: dict[str, Any] = {}

    def upload(self, hp: Any) -> None:
        """Put the host rows ``hp`` (float32 ``[R, HP_WORDS]``) on the device for the fused
        kernel, from pinned memory without waiting; the host copy stays referenced until the
        next upload (torch's pinned-memory allocator also waits for the copy before reuse)."""
        self.hp, self._hp_source = self.fused.upload_hp(hp)


def adapted_index(adapt: Sequence[bool], device: torch.device) -> Tensor:
    """long ``[k]`` on ``device``: the indices of the True entries of ``adapt``."""
    idx = torch.tensor([i for i, a in enumerate(adapt) if a], dtype=torch.long)
    return idx.to(device)
