"""Gradient noise scale B_simple from the two batch sizes data-parallel training already has.

Source: McCandlish, Kaplan, Amodei et al., *An Empirical Model of Large-Batch Training*, 2018
(arXiv 1812.06162), Section 2.2 and Appendix A. For a gradient estimate from ``B`` samples,
``E|G_B|^2 = |G|^2 + tr(Sigma) / B`` (``G`` the true gradient, ``Sigma`` the per-sample
gradient covariance). Two batch sizes ``b_small < B_big`` give the unbiased estimates

    |G|^2    ~  (B_big |G_big|^2 - b_small |G_small|^2) / (B_big - b_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / B_big)

and the *simple noise scale* ``B_simple = tr(Sigma) / |G|^2`` (eq. 2.9), the paper's estimate
of the critical batch size: larger batches than about B_simple give diminishing returns per
sample. In data-parallel training ``G_small`` is each rank's local gradient (``b_small = B / W``
samples; ``|G_small|^2`` is the mean over ranks of each rank's squared norm) and ``G_big`` is
the allreduced gradient (``B_big = B``); with one rank, the accumulation micro-batches play the
ranks. Both estimates are noisy, so, as in the paper, numerator and denominator are smoothed
separately with an exponential moving average before dividing.

What a run's measured noise scale means for its batch size (``hpclb advise``) is in
:mod:`hpclb.tools.advise`.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable

import torch

from hpclb.errors import ConfigError

__all__ = ["Number", "ONE_PROCESS", "check_world_size", "grad_sq_norm", "NoiseScaleEstimator"]

Number = float | torch.Tensor

# Why ``hpclb train --noise-scale`` is refused at one process (also what ``hpclb advise`` says of
# a run that asked for it there).
ONE_PROCESS = ("the gradient noise scale needs >= 2 ranks: it compares each rank's gradient (B/W "
               "samples) with the allreduced one (B samples), and one process has only one "
               "gradient per step (hpclb train does not measure accumulation micro-batches "
               "separately); run under `mpirun -n 2` or more, or drop --noise-scale (recipe "
               "field noise_scale)")


def check_world_size(noise_scale: bool, world_size: int) -> None:
    """Raise ConfigError (exit 2) naming ``--noise-scale`` when it is asked for at one process
    (:data:`ONE_PROCESS` says why); the same verdict on every rank."""
    if noise_scale and world_size < 2:
        raise ConfigError(f"--noise-scale at world size {world_size}: {ONE_PROCESS}")


def grad_sq_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm ``sum_i |t_i|^2`` of several tensors (e.g. the ``.grad`` of every
    parameter), as a 0-d float64 tensor on their device; no host synchronisation. The norm is
    computed in the tensors' dtype (``torch.nn.utils.get_total_norm``), then squared in float64.
    Tensors that are None are skipped; an empty list gives 0."""
    ts = [t for t in tensors if t is not None]
    if not ts:
        return torch.zeros((), dtype=torch.float64)
    norm = torch.nn.utils.get_total_norm(ts, norm_type=2.0)
    return norm.to(torch.float64) ** 2


class NoiseScaleEstimator:
    """EMA-smoothed ``|G|^2``, ``tr(Sigma)`` and ``B_simple`` (McCandlish et al. 2018, App. A).

    Args:
        ema: smoothing factor in [0, 1): each update moves the averages by ``1 - ema`` toward the
            step's estimate (bias-corrected like Adam, so the first steps are not pulled to 0).

    :meth:`update` takes Python floats or 0-d tensors and never synchronises with a device
    (state stays on the inputs' device in float64); :meth:`summary` does. The spread it reports
    (``b_simple_lo``, ``b_simple_hi``) is the 10 % and 90 % quantile of the smoothed estimate
    ``EMA(tr Sigma) / EMA(|G|^2)`` over the steps of the current window (since the last
    :meth:`new_window`, e.g. one epoch), steps where the smoothed ``|G|^2`` is not yet positive
    left out. It describes how much the estimate moved over the window, not a confidence
    interval of the true value.
    """

    QUANTILES = (0.1, 0.9)

    def __init__(self, ema: float = 0.9, *, window: int = 100_000):
        if not (isinstance(ema, (int, float)) and 0 <= ema < 1):
            raise ValueError(f"ema must be in [0, 1) (e.g. 0.9; 0: no smoothing), got {ema!r}")
        self.ema = float(ema)
        self.window = window
        self._g2: torch.Tensor | None = None      # EMA numerators, not bias-corrected
        self._trace: torch.Tensor | None = None
        self.steps = 0                            # updates since construction
        self._history: deque[torch.Tensor] = deque(maxlen=window)

    @staticmethod
    def _check_batches(small_batch: int, big_batch: int) -> None:
        if not (small_batch > 0 and big_batch > small_batch):
            raise ValueError(
                f"need 0 < small_batch < big_batch (samples behind each squared norm: a rank's "
                f"local gradient and the allreduced one), got small_batch={small_batch}, "
                f"big_batch={big_batch}; with one rank use accumulation micro-batches as the "
                f"small batch")

    @classmethod
    def estimates(cls, small_sq_norm: Number, small_batch: int, big_sq_norm: Number,
                  big_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's unbiased ``(|G|^2, tr(Sigma))`` estimates (App. A), unsmoothed, as
        float64 tensors (0-d for 0-d inputs; any matching shapes broadcast). Arguments as in
        :meth:`update`."""
        cls._check_batches(small_batch, big_batch)
        s = torch.as_tensor(small_sq_norm, dtype=torch.float64)
        b = torch.as_tensor(big_sq_norm, dtype=torch.float64, device=s.device)
        g2 = (big_batch * b - small_batch * s) / (big_batch - small_batch)
        trace = (s - b) / (1.0 / small_batch - 1.0 / big_batch)
        return g2, trace

    def update(self, small_sq_norm: Number, small_batch: int, big_sq_norm: Number,
               big_batch: int) -> None:
        """Add one step: ``small_sq_norm`` = ``|G_small|^2`` (mean over ranks of each rank's
        squared gradient norm, ``small_batch`` samples each), ``big_sq_norm`` = ``|G_big|^2``
        of the averaged gradient over ``big_batch`` samples. Raises ValueError unless
        ``0 < small_batch < big_batch``."""
        g2, trace = self.estimates(small_sq_norm, small_batch, big_sq_norm, big_batch)
        if self._g2 is None:
            self._g2, self._trace = torch.zeros_like(g2), torch.zeros_like(trace)
        a = self.ema
        self._g2 = a * self._g2 + (1 - a) * g2
        self._trace = a * self._trace + (1 - a) * trace
        self.steps += 1
        self._history.append(self._trace / self._g2)  # bias corrections cancel in the ratio

    def _corrected(self) -> tuple[float, float]:
        c = 1.0 - self.ema ** self.steps
        return float(self._g2) / c, float(self._trace) / c

    def new_window(self) -> None:
        """Start a new window for the spread and ``n`` (the averages carry on)."""
        self._history.clear()

    def summary(self) -> dict[str, Any]:
        """``{"b_simple", "g2", "trace", "b_simple_lo", "b_simple_hi", "n"}``: the smoothed
        ``B_simple`` (samples), ``|G|^2`` and ``tr(Sigma)`` (squared gradient units; ``tr(Sigma)``
        per sample), the 10/90 % range of ``B_simple`` over the window and ``n``, the steps in
        the window. A value that is undefined (no step yet, or the smoothed ``|G|^2`` not
        positive, which happens when the gradient is pure noise) is None."""
        out: dict[str, Any] = {"b_simple": None, "g2": None, "trace": None,
                               "b_simple_lo": None, "b_simple_hi": None,
                               "n": len(self._history)}
        if self._g2 is None:
            return out
        g2, trace = self._corrected()
        out.update(g2=g2, trace=trace, b_simple=trace / g2 if g2 > 0 else None)
        if self._history:
            hist = torch.stack(list(self._history)).cpu()
            ok = hist[torch.isfinite(hist) & (hist > 0)]
            if ok.numel():
                lo, hi = torch.quantile(ok, torch.tensor(self.QUANTILES, dtype=ok.dtype))
                out.update(b_simple_lo=float(lo), b_simple_hi=float(hi))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit for bit (floats; synchronises)."""
        return {"ema": self.ema, "steps": self.steps,
                "g2": None if self._g2 is None else float(self._g2),
                "trace": None if self._trace is None else float(self._trace),
                "history": [float(h) for h in self._history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (on the CPU; the next update moves nothing it needs)."""
        self.ema, self.steps = float(state["ema"]), int(state["steps"])
        f64 = torch.float64
        self._g2 = None if state["g2"] is None else torch.tensor(state["g2"], dtype=f64)
        self._trace = None if state["trace"] is None else torch.tensor(state["trace"], dtype=f64)
        self._history = deque((torch.tensor(h, dtype=f64) for h in state["history"]),
                              maxlen=self.window)
