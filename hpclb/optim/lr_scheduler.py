"""A torch LR scheduler driven by a :class:`hpclb.schedules.Schedule` (LEGW or a baseline).

The schedule itself is a pure function of the global step (``hpclb.schedules``, no torch); this
adapter applies it to a ``torch.optim.Optimizer``'s parameter groups, one ``step()`` per update,
like the schedulers of ``torch.optim.lr_scheduler``.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable

import torch

from hpclb.schedules import Schedule, set_lr

__all__ = ["ScheduleLR"]


class ScheduleLR(torch.optim.lr_scheduler.LRScheduler):
    """Adapter: drives ``optimizer``'s LR from a :class:`Schedule`, one ``step()`` per update.

    Every parameter group gets ``schedule.lr(step) * group.get("lr_scale", 1.0)``. Call
    ``scheduler.step()`` after ``optimizer.step()`` as usual; ``last_epoch`` is the global step.

    ``updates``: optional ``() -> int``, the number of optimizer updates so far (a
    :class:`~hpclb.sync.optimizer.DistributedOptimizer`'s ``steps``). With it, ``step()`` only
    advances when that number has changed since the last ``step()``: the schedule moves once per
    optimizer update whatever loop calls it (e.g. after every micro-batch of an accumulation
    window), never ``accumulation_steps`` times too fast.

    Its ``state_dict`` holds the step, and with ``keep_peak_lr`` (the library's schedulers,
    :func:`hpclb.legw` ...) the schedule's ``peak_lr`` (its base LR, as torch's ``LambdaLR``
    keeps ``base_lrs``; ``hpclb train`` rebuilds it from the recipe instead);
    :meth:`load_state_dict` restores both and sets the groups'
    LRs (and ``get_last_lr()``) to that step's, so a resumed run uses the restored step's LR at
    the saved peak, not step 0's nor one guessed from a loaded optimizer's current LR.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule,
                 updates: Callable[[], int] | None = None, keep_peak_lr: bool = False):
        self.schedule = schedule
        self.keep_peak_lr = keep_peak_lr
        self._updates = updates
        self._seen = updates() if updates is not None else None
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        lr = self.schedule.lr(max(0, self.last_epoch))
        return [lr * g.get("lr_scale", 1.0) for g in self.optimizer.param_groups]

    def step(self, epoch=None) -> None:
        """Advance one global step (with ``updates``: only after a new optimizer update) and
        set every group's LR to ``schedule.lr(step) * lr_scale`` directly. The first two calls
        (construction's and the first update's, where torch warns about a ``step()`` before
        ``optimizer.step()``) and a deprecated ``epoch`` go through torch's ``step()``."""
        if self._updates is not None and self.last_epoch >= 0:
            seen = self._updates()
            if seen == self._seen:
                return  # no optimizer update since the last step(): hold the LR
            self._seen = seen
        if epoch is not None or self._step_count <= 1:
            super().step(epoch)
            return
        self._step_count += 1
        self.last_epoch += 1
        self._last_lr = set_lr(self.optimizer, self.schedule.lr(self.last_epoch))

    def state_dict(self) -> dict:
        state = {"last_epoch": self.last_epoch}
        if self.keep_peak_lr:
            state["peak_lr"] = self.schedule.peak_lr
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the global step and peak LR from :meth:`state_dict`: ``{"last_epoch": int
        >= 0, "peak_lr": float}`` (``peak_lr`` may be missing: older states). A saved peak that
        differs from this scheduler's replaces it, with a UserWarning naming both.

        Raises ValueError naming ``last_epoch`` / ``peak_lr`` when missing or malformed.
        """
        step = state_dict.get("last_epoch") if isinstance(state_dict, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"ScheduleLR state must be {{'last_epoch': step >= 0}} (the global "
                             f"step), got {state_dict!r}")
        peak = state_dict.get("peak_lr", self.schedule.peak_lr)
        if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
            raise ValueError(f"ScheduleLR state: peak_lr={peak!r} must be a positive LR")
        if not math.isclose(peak, self.schedule.peak_lr, rel_tol=1e-12):
            warnings.warn(f"the scheduler state's peak LR {peak:g} replaces this scheduler's "
                          f"{self.schedule.peak_lr:g} (built from a guessed base LR? pass "
                          f"base_lr= to the scheduler)", UserWarning, stacklevel=2)
            self.schedule = dataclasses.replace(self.schedule, peak_lr=float(peak))
        self.last_epoch = step
        if self._updates is not None:
            self._seen = self._updates()
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]
