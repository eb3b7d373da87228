"""Learning-rate scaling rules, warmup and decay: LEGW and its baselines.

Source: You et al., *Large-Batch Training for LSTM and Beyond*, SC '19 (arXiv 1901.08256).
A recipe tuned at global batch ``B0`` (peak LR ``eta0``, warmup ``W0`` epochs, a decay, ``E``
epochs) is moved to ``B = k * B0`` by a *scaling scheme*:

========  ===============  ==================  ==========================================
scheme    peak LR          warmup (epochs)     source
========  ===============  ==================  ==========================================
legw      eta0 * sqrt(k)   W0 * k              You et al. 2019 (warmup *iterations* fixed)
goyal     eta0 * k         5, ramp from eta0   Goyal et al. 2017 (the paper's linear baseline)
linear    eta0 * k         W0                  linear scaling with the recipe's own W0
sqrt      eta0 * sqrt(k)   W0                  sqrt scaling with a fixed-epoch warmup
none      eta0             W0                  the B0 recipe unchanged
========  ===============  ==================  ==========================================

``goyal`` is Goyal et al.'s *gradual warmup* (arXiv 1706.02677, section 2.2): the LR starts at
the B0 LR ``eta0`` and grows linearly to ``k * eta0`` over 5 epochs, whatever the recipe's W0.
``linear`` keeps the recipe's W0 epochs: at large k that can be one or two steps, which is
"linear with almost no warmup", a weaker baseline than the paper's (a warmup that rounds to 0
steps is warned about: :class:`WarmupRoundedToZero`).

Decay type, decay boundaries (in epochs) and total epochs never change with ``k``.

Units. A *step* is one optimizer update on one global batch. An epoch has
``steps_per_epoch = ceil(N / B)`` steps (the last batch may be partial), and the fractional epoch
of step ``s`` is ``s / steps_per_epoch``; decays are functions of that. Warmup is counted in
samples: ``W`` epochs of warmup last ``round(W * N / B)`` steps, so LEGW's ``W0 * k`` epochs are
exactly ``round(W0 * N / B0)`` steps at every ``k`` (counting it as ``W * steps_per_epoch`` would
let the ceiling drift it by up to ``W`` steps per epoch of warmup). Warmup is a linear
per-iteration ramp from 0 that multiplies the decayed LR: the update at step ``s`` uses
``min(1, s / warmup_steps) * decay(s)``, so the first update's LR is 0, as in the reference code
(``lr = peak * global_step / warmup_steps``, You et al.'s LARS and TF implementations); Goyal's
ramp starts at ``eta0`` instead: ``eta0 + (decay(s) - eta0) * s / warmup_steps``. Poly and
cosine decays start at the end of warmup (from ``peak``); step decays (multistep, exponential)
keep their epoch boundaries even when a long LEGW warmup reaches past one.

Pitfall the paper warns about: multiplying warmup *steps* by ``k`` gives ``k**2`` in epochs.
Everything here is a pure function of the step (no torch); :class:`hpclb.optim.lr_scheduler.
ScheduleLR` adapts a :class:`Schedule`
to ``torch.optim.lr_scheduler``.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hpclb.errors import BudgetTooLarge, WarmupTooLong

__all__ = ["SCALING_RULES", "WARMUP_RULES", "DECAYS", "SCHEMES", "GOYAL_WARMUP_EPOCHS",
           "MAX_TOTAL_STEPS", "WarmupRoundedToZero", "steps_per_epoch", "batch_ratio", "scale_lr",
           "scale_warmup_epochs", "warmup_steps_for", "warmup_factor", "decay_factor",
           "validate_decay", "Schedule", "set_lr"]

SCALING_RULES = ("none", "linear", "sqrt")
WARMUP_RULES = ("legw", "goyal", "fixed", "none")
# Goyal et al. 2017 (arXiv 1706.02677), section 2.2: "gradual warmup" over 5 epochs from eta0.
GOYAL_WARMUP_EPOCHS = 5.0
#: The most optimizer steps a run may have: a billion steps, a thousand times the longest
#: published large-batch runs, is weeks of work even at a millisecond a step, so a budget past
#: it is a slip (``epochs: 1.0e12``) that would train until killed, and is refused.
MAX_TOTAL_STEPS = 10 ** 9
DECAYS = ("constant", "poly", "exponential", "multistep", "cosine")
# A scheme is the pair (LR rule, warmup rule) that `--scaling` selects.
SCHEMES = {
    "legw": ("sqrt", "legw"),
    "goyal": ("linear", "goyal"),
    "linear": ("linear", "fixed"),
    "sqrt": ("sqrt", "fixed"),
    "none": ("none", "fixed"),
}


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch: ``ceil(N / B)`` (the last global batch may be partial).

    Raises ValueError if either number is not a positive integer.
    """
    if num_samples <= 0 or global_batch_size <= 0:
        raise ValueError(
            f"num_samples ({num_samples}) and global_batch_size ({global_batch_size}) must be > 0")
    return -(-num_samples // global_batch_size)


def batch_ratio(base_batch_size: int, global_batch_size: int) -> float:
    """``k = B / B0`` (may be < 1). Raises ValueError for a non-positive batch size."""
    if base_batch_size <= 0 or global_batch_size <= 0:
        raise ValueError(f"batch sizes must be > 0, got base_batch_size={base_batch_size}, "
                         f"global_batch_size={global_batch_size}")
    return global_batch_size / base_batch_size


def scale_lr(base_lr: float, base_batch_size: int, global_batch_size: int, rule: str) -> float:
    """Peak LR at batch ``B`` from the peak ``base_lr`` tuned at ``B0``.

    ``rule``: ``"none"`` (eta0), ``"linear"`` (eta0 * k) or ``"sqrt"`` (eta0 * sqrt(k)).
    Raises ValueError for an unknown rule.
    """
    k = batch_ratio(base_batch_size, global_batch_size)
    if rule == "none":
        return base_lr
    if rule == "linear":
        return base_lr * k
    if rule == "sqrt":
        return base_lr * math.sqrt(k)
    raise ValueError(f"unknown LR scaling rule {rule!r}; choose one of {SCALING_RULES}")


def scale_warmup_epochs(base_warmup_epochs: float, base_batch_size: int,
                        global_batch_size: int, rule: str) -> float:
    """Warmup length in epochs at batch ``B``: LEGW ``W0 * k``, Goyal 5 (whatever ``W0``),
    fixed ``W0``, none 0.

    Raises ValueError for an unknown rule, a negative ``W0``, or LEGW with ``W0 == 0`` (LEGW
    scales a non-zero base warmup; choose one at B0).
    """
    if base_warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {base_warmup_epochs}")
    k = batch_ratio(base_batch_size, global_batch_size)
    if rule == "legw":
        if base_warmup_epochs == 0:
            raise ValueError("LEGW needs a non-zero base warmup (warmup_epochs at B0); set "
                             "warmup_epochs > 0 in the recipe")
        return base_warmup_epochs * k
    if rule == "goyal":
        return GOYAL_WARMUP_EPOCHS
    if rule == "fixed":
        return base_warmup_epochs
    if rule == "none":
        return 0.0
    raise ValueError(f"unknown warmup rule {rule!r}; choose one of {WARMUP_RULES}")


def warmup_steps_for(warmup_epochs: float, num_samples: int, global_batch_size: int) -> int:
    """Warmup length in steps: ``round(W * N / B)`` (see the module docstring for why)."""
    # The 1e-9 guard keeps LEGW's W0*k*N/(k*B0) from rounding differently for different k.
    return int(math.floor(warmup_epochs * num_samples / global_batch_size + 0.5 + 1e-9))


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear per-iteration ramp from 0: ``min(1, step / warmup_steps)`` (the first update's
    factor is 0, as in the reference code); 1 if no warmup."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, step / warmup_steps)


class WarmupRoundedToZero(UserWarning):
    """A non-zero warmup in epochs that is less than half a step at this batch: the run has no
    warmup at all (e.g. a fixed 0.02-epoch warmup at a large batch)."""


def decay_factor(step: int, *, steps_per_epoch: int, warmup_steps: int, total_steps: int,
                 decay: str, params: Mapping[str, object], peak_lr: float) -> float:
    """The LR after warmup, as a function of the global step; equals ``peak_lr`` at its start.

    ``decay`` and its ``params``:
      - ``constant``: none.
      - ``poly``: ``power`` (default 1), ``end_lr`` (default 0); polynomial from ``peak_lr`` at the
        end of warmup to ``end_lr`` at ``total_steps`` (You et al.'s LARS ResNet recipe: power 2).
      - ``cosine``: ``end_lr`` (default 0); half cosine over the same span.
      - ``exponential``: ``gamma``, ``start_epoch``; ``peak * gamma ** max(0, floor(e) + 1 -
        start_epoch)`` for fractional epoch ``e`` (Zaremba et al.: gamma 0.5, start_epoch 4 means
        epochs 0..3 at full LR, then halved each epoch).
      - ``multistep``: ``milestones`` (epochs), ``gamma``; multiplied by ``gamma`` at each
        milestone epoch reached.
    Decay boundaries are in epochs (``step / steps_per_epoch``), so they sit at the same epochs
    for every batch size.
    """
    epoch = step / steps_per_epoch
    if decay == "constant":
        return peak_lr
    if decay in ("poly", "cosine"):
        end_lr = float(params.get("end_lr", 0.0))
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, max(0.0, (step - warmup_steps) / span))
        if decay == "poly":
            shape = (1.0 - progress) ** float(params.get("power", 1.0))
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return end_lr + (peak_lr - end_lr) * shape
    if decay == "exponential":
        n = max(0, math.floor(epoch) + 1 - int(params["start_epoch"]))
        return peak_lr * float(params["gamma"]) ** n
    if decay == "multistep":
        n = sum(1 for m in params["milestones"] if epoch >= float(m))
        return peak_lr * float(params["gamma"]) ** n
    raise ValueError(f"unknown decay {decay!r}; choose one of {DECAYS}")


_DECAY_PARAMS = {
    "constant": ((), ()),
    "poly": ((), ("power", "end_lr")),
    "cosine": ((), ("end_lr",)),
    "exponential": (("gamma", "start_epoch"), ()),
    "multistep": (("milestones", "gamma"), ()),
}


def validate_decay(decay: str, params: Mapping[str, object]) -> None:
    """Raise ValueError naming a missing, unknown or out-of-range decay parameter."""
    if decay not in _DECAY_PARAMS:
        raise ValueError(f"unknown decay {decay!r}; choose one of {DECAYS}")
    required, optional = _DECAY_PARAMS[decay]
    for name in required:
        if name not in params:
            raise ValueError(f"decay {decay!r} needs parameter {name!r}")
    for name in params:
        if name not in required and name not in optional:
            raise ValueError(f"decay {decay!r} has no parameter {name!r}; "
                             f"it takes {sorted(required + optional)}")
    for name in ("gamma", "power", "end_lr", "start_epoch"):
        value = params.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise ValueError(f"{decay} {name} must be a finite number, got {value!r}")
    if "gamma" in params and not 0 < float(params["gamma"]) <= 1:
        raise ValueError(f"decay gamma must be in (0, 1], got {params['gamma']}")
    if "power" in params and float(params["power"]) < 0:
        raise ValueError(f"poly power must be >= 0, got {params['power']}")
    if "end_lr" in params and float(params["end_lr"]) < 0:
        raise ValueError(f"end_lr must be >= 0, got {params['end_lr']}")
    if "milestones" in params:
        ms = params["milestones"]
        if isinstance(ms, str) or not isinstance(ms, Sequence) or any(
                isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0
                or not math.isfinite(m) for m in ms):
            raise ValueError(f"multistep milestones must be a list of positive epochs, got {ms!r}")


def _round_up(x: float, digits: int = 3) -> float:
    """``x`` rounded up to ``digits`` significant digits (for printing a lower bound)."""
    if x <= 0:
        return x
    quantum = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return float(f"{math.ceil(x / quantum - 1e-9) * quantum:.{digits}g}")


@dataclass(frozen=True)
class Schedule:
    """The LR of every step of one run, a pure function of the global step.

    Fields: ``peak_lr`` (after scaling), ``warmup_steps``, ``total_steps``, ``steps_per_epoch``
    (steps), ``decay`` and ``decay_params``, ``warmup_start_lr`` (the LR the ramp starts from at
    step 0: 0 for LEGW and the fixed-warmup schemes, ``eta0`` for Goyal's). Build one with
    :meth:`from_recipe`.
    Raises ValueError when the peak LR is not positive or a decay's ``end_lr`` is not below it,
    :class:`WarmupTooLong` (a ValueError)
    when warmup is not shorter than training, :class:`BudgetTooLarge` (a ValueError) for more
    than :data:`MAX_TOTAL_STEPS` steps.
    """

    peak_lr: float
    warmup_steps: int
    total_steps: int
    steps_per_epoch: int
    decay: str = "constant"
    decay_params: Mapping[str, object] = field(default_factory=dict)
    warmup_start_lr: float = 0.0

    def __post_init__(self) -> None:
        if not (self.peak_lr > 0 and math.isfinite(self.peak_lr)):
            raise ValueError(f"peak learning rate must be a positive number, got {self.peak_lr}")
        if self.total_steps <= 0 or self.steps_per_epoch <= 0:
            raise ValueError(f"total_steps ({self.total_steps}) and steps_per_epoch "
                             f"({self.steps_per_epoch}) must be > 0")
        if self.total_steps > MAX_TOTAL_STEPS:
            raise BudgetTooLarge(self.total_steps, self.steps_per_epoch, MAX_TOTAL_STEPS)
        if self.warmup_steps >= self.total_steps:
            raise WarmupTooLong(self.warmup_steps, self.total_steps, self.steps_per_epoch,
                                _round_up((self.warmup_steps + 1) / self.steps_per_epoch))
        validate_decay(self.decay, self.decay_params)
        end_lr = float(self.decay_params.get("end_lr", 0.0))
        if end_lr >= self.peak_lr:
            raise ValueError(f"decay end_lr {end_lr:g} must be below the peak learning rate "
                             f"{self.peak_lr:g}: a {self.decay} decay goes from the peak down to "
                             f"end_lr, so this one would raise the LR to {end_lr:g}")
        if not (0 <= self.warmup_start_lr <= self.peak_lr):
            raise ValueError(f"warmup_start_lr must be in [0, peak_lr {self.peak_lr}], got "
                             f"{self.warmup_start_lr}")

    @classmethod
    def from_recipe(cls, *, base_lr: float, base_batch_size: int, base_warmup_epochs: float,
                    global_batch_size: int, num_samples: int, epochs: float, scheme: str = "legw",
                    decay: str = "constant",
                    decay_params: Mapping[str, object] | None = None) -> "Schedule":
        """Transfer a recipe tuned at ``base_batch_size`` to ``global_batch_size`` by ``scheme``.

        ``scheme`` is one of :data:`SCHEMES` (legw, linear, sqrt, none). ``epochs`` may be
        fractional; ``total_steps = ceil(epochs * steps_per_epoch)``.
        """
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scaling scheme {scheme!r}; choose one of {tuple(SCHEMES)}")
        if not epochs > 0:
            raise ValueError(f"epochs must be > 0, got {epochs}")
        lr_rule, warmup_rule = SCHEMES[scheme]
        spe = steps_per_epoch(num_samples, global_batch_size)
        w_epochs = scale_warmup_epochs(base_warmup_epochs, base_batch_size, global_batch_size,
                                       warmup_rule)
        w_steps = warmup_steps_for(w_epochs, num_samples, global_batch_size)
        if w_epochs > 0 and w_steps == 0:
            steps = w_epochs * num_samples / global_batch_size
            warnings.warn(WarmupRoundedToZero(
                f"--scaling {scheme}: a warmup of {w_epochs:g} epochs is {steps:.2f} steps at "
                f"batch {global_batch_size}, which rounds to 0: this run has no warmup "
                f"(LEGW keeps the warmup's steps at every batch: --scaling legw; Goyal's 5-epoch "
                f"warmup: --scaling goyal)"), stacklevel=2)
        peak = scale_lr(base_lr, base_batch_size, global_batch_size, lr_rule)
        return cls(
            peak_lr=peak,
            warmup_steps=w_steps,
            total_steps=math.ceil(epochs * spe - 1e-9),
            steps_per_epoch=spe,
            decay=decay,
            decay_params=dict(decay_params or {}),
            warmup_start_lr=min(base_lr, peak) if warmup_rule == "goyal" else 0.0,
        )

    @property
    def warmup_epochs(self) -> float:
        return self.warmup_steps / self.steps_per_epoch

    def lr(self, step: int) -> float:
        """LR of the update made at global step ``step`` (0-based)."""
        decay = decay_factor(step, steps_per_epoch=self.steps_per_epoch,
                             warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                             decay=self.decay, params=self.decay_params, peak_lr=self.peak_lr)
        start = self.warmup_start_lr
        return start + (decay - start) * warmup_factor(step, self.warmup_steps)


def set_lr(optimizer, lr: float) -> list:
    """Give every parameter group of ``optimizer`` (a ``torch.optim.Optimizer`` or anything with
    its ``param_groups``) the LR ``lr`` times the group's ``lr_scale`` (1.0 when absent); a
    tensor LR (torch's ``capturable`` optimizers) is filled in place. Returns the groups' LRs.
    What ``hpclb train`` calls before each step with ``Schedule.lr(global_step)`` (nanoGPT's
    loop) and :class:`hpclb.optim.lr_scheduler.ScheduleLR` after each one."""
    out = []
    for group in optimizer.param_groups:
        value = lr * group.get("lr_scale", 1.0)
        if hasattr(group["lr"], "fill_"):  # a tensor LR
            group["lr"].fill_(value)
        else:
            group["lr"] = value
        out.append(group["lr"])
    return out
