"""A torch LR scheduler driven by a :class:`hpclb.schedules.Schedule` (LEGW or a baseline).

The schedule itself is a pure function of the global step (``hpclb.schedules``, no torch); this
adapter applies it to a ``torch.optim.Optimizer``'s parameter groups, one ``step()`` per update,
like the schedulers of ``torch.optim.lr_scheduler``.
"""
from __future__ import annotations

import torch

from hpclb.schedules import Schedule

__all__ = ["ScheduleLR"]


class ScheduleLR(torch.optim.lr_scheduler.LRScheduler):
    """Adapter: drives ``optimizer``'s LR from a :class:`Schedule`, one ``step()`` per update.

    Every parameter group gets ``schedule.lr(step) * group.get("lr_scale", 1.0)``. Call
    ``scheduler.step()`` after ``optimizer.step()`` as usual; ``last_epoch`` is the global step.
    Its ``state_dict`` holds only the step (the schedule is rebuilt from the recipe);
    :meth:`load_state_dict` restores the step and sets the groups' LRs (and ``get_last_lr()``) to
    that step's, so a resumed run reports and uses the LR of the restored step, not step 0's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule):
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        lr = self.schedule.lr(max(0, self.last_epoch))
        return [lr * g.get("lr_scale", 1.0) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the global step from :meth:`state_dict`: ``{"last_epoch": int >= 0}``.

        Raises ValueError naming ``last_epoch`` when it is missing or not a non-negative int.
        """
        step = state_dict.get("last_epoch") if isinstance(state_dict, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"ScheduleLR state must be {{'last_epoch': step >= 0}} (the global "
                             f"step), got {state_dict!r}")
        self.last_epoch = step
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]
