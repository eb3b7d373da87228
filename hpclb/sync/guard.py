"""The non-finite guard of :meth:`hpclb.sync.optimizer.DistributedOptimizer.step`.

A step whose averaged gradient has a non-finite global norm is skipped on every rank (the norm
is the same on all of them) and counted. Two ways, by what the wrapped optimizer supports:

- **on the device**: an optimizer with torch's ``_step_supports_amp_scaling`` contract
  (:class:`hpclb.LARS`, :class:`hpclb.LAMB`, torch's fused Adam/AdamW/SGD) is given the found-inf
  flag as ``optimizer.found_inf`` (a 0-d float32 tensor, 1.0 = skip), as
  ``torch.amp.GradScaler.step`` does, and masks the whole update itself. The skip, the run of
  skips in a row and the optimizer step at which that run reached ``max_nonfinite_steps`` are
  counted in a 3-element int64 device tensor; :meth:`NonFiniteGuard.check` reads it (one read)
  and raises. Nothing is read from the device in the step.
- **on the host**: any other optimizer. One read per step (two flags in one copy with an fp16
  scaler), as ``GradScaler.step`` makes; the limit is checked at once.

With an fp16 scaler, a skip counts toward the limit only once the loss scale has fallen below 1
(before that it is the scaler calibrating itself), decided on the device from the scale tensor.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from hpclb.errors import NonFiniteError

__all__ = ["CALIBRATION_SCALE", "NonFiniteGuard", "masks_on_device"]

#: fp16 overflows while the loss scale is at least this are the scaler's calibration, not counted
#: toward ``max_nonfinite_steps``.
CALIBRATION_SCALE = 1.0
#: the device counts keep the step at which the limit was hit as ``_HIT_BASE - step``
_HIT_BASE = 2 ** 62


def masks_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step()`` honours ``optimizer.found_inf`` (torch's
    ``_step_supports_amp_scaling`` contract), so a skip can be masked without a host read."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class NonFiniteGuard:
    """Skips and counts non-finite steps (module docstring).

    ``found_inf`` after each :meth:`found`: 0-d bool device tensor, True when the last completed
    step was skipped (the training loop masks that step's statistics with it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_nonfinite_steps: int,
                 scaler: "torch.amp.GradScaler | None"):
        self.optimizer, self.max_steps, self.scaler = optimizer, max_nonfinite_steps, scaler
        self.on_device = masks_on_device(optimizer)
        self.found_inf: Tensor | None = None
        self.skipped_host = 0    # skips counted on the host (and those of a loaded state)
        self.streak = 0          # host path: skips in a row that count toward the limit
        self._counts: Tensor | None = None   # device: skipped, streak, step the limit was hit
        self._count_views: tuple[Tensor, ...] = ()   # its three elements (views)
        self._flags: dict = {}  # device -> (False, True) 0-d bool tensors (the host path's flag)

    def found(self, grad_norm: Tensor) -> Tensor:
        """The step's found-inf flag (0-d bool, on ``grad_norm``'s device; no read)."""
        self.found_inf = ~torch.isfinite(grad_norm)
        return self.found_inf

    def _counted(self, found: Tensor) -> Tensor:
        """Skips that count toward the limit: all, or with an fp16 scaler those at scale < 1."""
        if self.scaler is None:
            return found
        scale = self.scaler._get_scale_async()
        if scale is None:   # never scaled yet: the initial scale (>= 1)
            return torch.zeros_like(found)
        return found & (scale.to(found.device) < CALIBRATION_SCALE)

    def found_on_device(self, grad_norm: Tensor, step: int) -> Tensor:
        """The device path: the step's found-inf flag (0-d bool, no read), counted on the
        device (``step``: the optimizer step, 1-based) in six small ops, four in place on the
        three counts. The streak is ``(streak + counted) * found`` (a finite step resets it);
        the step at which it first reached the limit is kept as ``_HIT_BASE - step``, so a
        later step never replaces it (``clamp_(min=...)``)."""
        found = self.found_inf = ~torch.isfinite(grad_norm)
        if self._counts is None:
            self._counts = torch.zeros(3, dtype=torch.int64, device=found.device)
            self._count_views = self._counts.unbind()
        skipped, streak, hit = self._count_views
        skipped.add_(found)
        streak.add_(found if self.scaler is None else self._counted(found)).mul_(found)
        hit.clamp_(min=(streak >= self.max_steps) * (_HIT_BASE - step))
        return found

    def skip_on_host_norm(self, grad_norm: Tensor) -> bool:
        """The host path without a scaler: one read of the norm itself (``item()``, the same
        one read ``bool(found)`` makes) and the finiteness decided on the host, no tensor op;
        ``found_inf`` is a cached 0-d bool on the norm's device. With a scaler:
        :meth:`found` then :meth:`skip_on_host`."""
        if self.scaler is not None:
            return self.skip_on_host(self.found(grad_norm))
        bad = not math.isfinite(grad_norm.item())
        flags = self._flags.get(grad_norm.device)
        if flags is None:
            flags = self._flags[grad_norm.device] = (
                torch.tensor(False, device=grad_norm.device),
                torch.tensor(True, device=grad_norm.device))
        self.found_inf = flags[bad]
        if not bad:
            self.streak = 0
            return False
        self.skipped_host += 1
        self.streak += 1
        return True

    def skip_on_host(self, found: Tensor) -> bool:
        """One read: True when the step must be skipped (then counted; the caller raises
        :meth:`over_limit`)."""
        if self.scaler is None:
            bad = counted = bool(found)
        else:
            bad, counted = torch.stack([found, self._counted(found)]).tolist()
        if not bad:
            self.streak = 0
            return False
        self.skipped_host += 1
        self.streak += int(counted)
        return True

    def check(self, step: int, first_layer: Callable[[], str | None]) -> int:
        """The total of skipped steps; raises :class:`NonFiniteError` when
        ``max_nonfinite_steps`` skips in a row were reached (on the host path at ``step``; on
        the device path at the step the device recorded: one read)."""
        if self.streak >= self.max_steps:
            raise NonFiniteError(step, first_layer(), self.streak)
        skipped, streak, hit = self._read()
        if hit:
            raise NonFiniteError(hit, first_layer(), max(streak, self.max_steps))
        return self.skipped_host + skipped

    def _read(self) -> list[int]:
        """``[skipped, streak, step at which the limit was hit or 0]`` (one read)."""
        if self._counts is None or self._counts.device.type == "meta":
            return [0, 0, 0]
        skipped, streak, hit = self._counts.tolist()
        return [skipped, streak, _HIT_BASE - hit if hit else 0]

    def total(self) -> int:
        """Skipped steps so far (one read on the device path; never raises)."""
        return self.skipped_host + self._read()[0]

    def set_skipped(self, n: int) -> None:
        """Restart the counts at ``n`` skipped steps (a loaded state)."""
        self.skipped_host, self.streak = int(n), 0
        if self._counts is not None:
            self._counts.zero_()
