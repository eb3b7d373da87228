"""The step plan of LARS and LAMB: what a step needs that changes only with the parameter set,
the optimizer state's tensors or a hyper-parameter, built once and reused by every later step.

A training step passes the same parameters, gradient tensors (bucket views, or gradients that
backward accumulates into) and state tensors every time. Gathering the layers with gradients,
their exclusion flags, state tensors, hyper-parameter rows and the fused kernel's descriptor
table cost about 3 us per tensor and step (issue 26); the plan holds them. Each step checks, by
identity (C-speed comparisons, about 0.1 us per tensor), that it still fits; it is rebuilt when

- a parameter gains or loses its gradient, or a gradient tensor is replaced (``set_to_none``);
- a state tensor (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``) is replaced, the state is
  loaded (``load_state_dict``), a group is added, or a group's ``exclude`` changes;
- LAMB: a step count differs from the one the plan expects (set by hand);
- the fused kernel's availability or torch's current stream changes.

Its hyper-parameter rows are refilled (and uploaded, from pinned memory) only when a group's
hyper-parameter value changes (the LR under a schedule, LAMB's bias corrections every step).
Not seen (call :meth:`~hpclb.optim.base.LayerwiseOptimizer.invalidate_plan`): one parameter's
state dict replaced wholesale (``opt.state[p] = {...}``), a group's ``params`` list edited in
place while keeping its length.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["StepPlan", "all_grads", "same_objects"]


def all_grads(groups: Sequence[dict]) -> list[Tensor | None]:
    """Every parameter's ``.grad`` (None included), group by group: what the plan is keyed by."""
    return list(map(_GRAD, chain.from_iterable(map(_PARAMS, groups))))   # C-speed loops


_GRAD, _PARAMS = attrgetter("grad"), itemgetter("params")


def same_objects(a: Sequence, b: Sequence) -> bool:
    """True when ``a`` and ``b`` hold the very same objects in the same order."""
    return len(a) == len(b) and all(map(is_, a, b))


class StepPlan:
    """One optimizer's layers with gradients and everything a step derives from them.

    Attributes: ``pairs`` ``(group, param)`` in group order; ``params``, ``grads`` (the
    gradient tensors), ``nonempty`` (those with elements), ``adapt`` (tuple of bool: trust
    ratio and weight decay), ``group_index`` (each layer's group), ``states`` (each layer's
    state dict), ``tensors`` (state key -> that tensor per layer), ``device``; ``fused`` (the
    :class:`~hpclb.optim.fused.FusedTrust` or None) with ``table`` and ``stream``; ``rows``
    (each layer's hyper-parameter row, set by the optimizer), ``hp`` (device rows, or None
    until uploaded) and ``hp_key`` (the values they were filled from). ``cache``: whatever the
    optimizer derives from the hyper-parameters (refilled when they change).
    """

    def __init__(self, opt: Any, grads_all: list, state_keys: Sequence[str]):
        self.state_dict_obj = opt.state
        self.grads_all = grads_all
        self.exclude = [g.get("exclude") for g in opt.param_groups]
        self.pairs = opt._gather()
        self.params = [p for _, p in self.pairs]
        self.grads = [p.grad for p in self.params]
        self.nonempty = [g for g in self.grads if g.numel()]
        self.adapt = tuple(opt.is_adapted(p, g) for g, p in self.pairs)
        where = {id(g): k for k, g in enumerate(opt.param_groups)}
        self.group_index = [where[id(g)] for g, _ in self.pairs]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        opt._init_state(self.params)
        self.states = [opt.state[p] for p in self.params]
        self.tensors = {k: [st[k] for st in self.states] for k in state_keys}
        self.fused: Any = None   # hpclb.optim.fused.FusedTrust or None
        self.table: Any = None
        self.stream = 0
        self.rows: list[int] = list(self.group_index)
        self.hp: Tensor | None = None
        self._hp_source: Any = None
        self.hp_key: Any = None
        self.cache: dict[str, Any] = {}
        self._heads: list[Tensor] | None = None

    def fits(self, opt: Any, grads_all: list) -> bool:
        """True when the plan still describes ``opt`` (see the module docstring); ``grads_all``
        from :func:`all_grads`."""
        return (opt.state is self.state_dict_obj and same_objects(grads_all, self.grads_all)
                and [g.get("exclude") for g in opt.param_groups] == self.exclude
                and all(all(map(is_, map(itemgetter(k), self.states), ts))
                        for k, ts in self.tensors.items()))

    def heads(self) -> list[Tensor]:
        """Views of every non-empty gradient's first element (for
        :func:`hpclb.optim.trust.nan_if_found`), made once."""
        if self._heads is None:
            self._heads = [g.view(-1)[:1] for g in self.nonempty]
        return self._heads

    def upload(self, hp: Any) -> None:
        """Put the host rows ``hp`` (float32 ``[R, HP_WORDS]``) on the device for the fused
        kernel, from pinned memory without waiting; the host copy stays referenced until the
        next upload (torch's pinned-memory allocator also waits for the copy before reuse)."""
        self.hp, self._hp_source = self.fused.upload_hp(hp)
