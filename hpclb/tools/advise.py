"""``hpclb advise RUN_DIR``: the critical batch size of a finished run and the largest batch to
train it at with LEGW.

A run trained with ``--noise-scale`` logs the gradient noise scale ``B_simple`` of
:mod:`hpclb.noise` (McCandlish et al. 2018) in the ``noise`` field of every epoch row of its
``metrics.jsonl``; :func:`advise` combines the last epochs' values into the critical batch and
:func:`recommend_batch` turns it into a batch LEGW can scale to (``B0 * 2^j``).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from hpclb._io import read_json
from hpclb.errors import ConfigError
from hpclb.noise import ONE_PROCESS
from hpclb.tools.runrows import RunRows, Warn, read_run
from hpclb.train.metrics import finite

__all__ = ["recommend_batch", "advise", "advice_of", "format_advice", "noisy_epochs",
           "run_config"]


def recommend_batch(b_simple: float, base_batch_size: int, max_batch: int | None = None) -> int:
    """The largest batch :func:`hpclb advise` recommends for LEGW: the largest ``B0 * 2^j``
    (``j >= 0``) not above ``b_simple`` nor ``max_batch`` (the training set, in samples), so
    LEGW's ``k`` stays a power of two and the batch stays at or below the estimated critical
    batch and within one epoch; ``B0`` itself when ``b_simple < B0``.
    Raises ValueError for a non-positive or non-finite ``b_simple`` or ``B0``."""
    if not (isinstance(b_simple, (int, float)) and math.isfinite(b_simple) and b_simple > 0):
        raise ValueError(f"b_simple must be a positive finite number, got {b_simple!r}")
    if not (isinstance(base_batch_size, int) and base_batch_size > 0):
        raise ValueError(f"base_batch_size must be a positive integer, got {base_batch_size!r}")
    batch = base_batch_size
    while batch * 2 <= min(b_simple, max_batch or math.inf):
        batch *= 2
    return batch


def run_config(run: Path) -> dict:
    """``run/config.json`` with ``base_batch_size`` (the recipe's B0) added; ConfigError naming
    the file when it is missing, unreadable or holds no positive B0."""
    path = run / "config.json"
    try:
        cfg = read_json(path, "the config.json files of `hpclb train`")
        b0 = cfg["recipe"]["base_batch_size"]
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; advise needs the run's base_batch_size") from None
    except ValueError as e:  # not UTF-8 or not JSON: the message names the file and the place
        raise ConfigError(f"{e}; advise needs the run's recipe.base_batch_size") from None
    except (OSError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a config.json of `hpclb train` ({e!r}); advise needs "
                          f"the run's recipe.base_batch_size") from e
    if isinstance(b0, bool) or not isinstance(b0, int) or b0 <= 0:
        raise ConfigError(f"{path}: recipe.base_batch_size {b0!r} is not a positive integer")
    return {**cfg, "base_batch_size": b0}


def _why_no_noise(run: Path) -> str:
    """Why the run has no usable noise scale, from its config.json where it has one."""
    try:
        cfg = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("noise_scale") and cfg.get("world_size") == 1:
        return f"it was trained at one process with noise_scale on, where {ONE_PROCESS}"
    if cfg.get("noise_scale"):
        return ("noise_scale was on but no epoch row has a finite noise.b_simple (the smoothed "
                "|G|^2 never became positive: the gradient was all noise so far); train more "
                "epochs")
    return ("it was trained without the noise scale; train with `hpclb train ... "
            "--noise-scale` (recipe field noise_scale: true) on >= 2 ranks to measure it")


def noisy_epochs(rows: RunRows) -> list[dict]:
    """Epoch rows with a finite ``noise.b_simple``; a noise field without one is warned."""
    noisy = []
    for r in rows.epochs:
        noise = r.get("noise")
        if not isinstance(noise, dict):
            continue
        if finite(noise.get("b_simple")) and noise["b_simple"] > 0:
            noisy.append(r)
        elif finite(noise.get("g2")) and noise["g2"] <= 0:
            rows.warn(f"{rows.path}:{r['_line']}: epoch {r.get('epoch', '?')}: no B_simple (the "
                      f"smoothed |G|^2 is {noise['g2']:.3g} <= 0: the gradient is all noise); "
                      f"left out of critical_batch, counted as infinite in k_max's budget")
        else:
            rows.warn(f"{rows.path}:{r['_line']}: epoch {r.get('epoch', '?')}: noise.b_simple "
                      f"= {noise.get('b_simple')!r} is not a positive finite number; epoch left "
                      f"out")
    return noisy


def advise(run_dir, last: int = 3, warn: Warn | None = None) -> dict[str, Any]:
    """What ``hpclb advise RUN_DIR`` prints, from the ``noise`` field of the run's epoch rows
    (``{"b_simple", "g2", "trace", "b_simple_lo", "b_simple_hi", "n"}``, written by ``hpclb
    train --noise-scale``) and ``config.json``.

    ``critical_batch``: the median ``b_simple`` over the last ``last`` epochs that have one (the
    noise scale grows as training goes on, so the late epochs are the ones that bound the batch
    for a full run); ``critical_lo``/``critical_hi``: the lowest ``b_simple_lo`` and the highest
    ``b_simple_hi`` of those epochs, each widened to include the epoch's end value.
    ``recommended_batch``: :func:`recommend_batch` of it (the largest ``B0 * 2^j`` not above it),
    with the same rule at both ends of the spread; none above ``train_samples_min``, the fewest
    training samples the run's ``config.json`` allows (``(steps_per_epoch - 1) * batch + 1``;
    None when it does not say), so no batch is larger than the training set.
    Raises ConfigError (exit 2) naming the directory when it or its metrics.jsonl is missing,
    and, when the run has no noise data, saying why (trained without ``--noise-scale``, or at
    one process, where it is not measured). Every line or epoch left out (a torn line, a
    non-finite value) goes to ``warn`` with its file and line (:mod:`hpclb.tools.runrows`).
    """
    return advice_of(read_run(Path(run_dir), warn), last)


def advice_of(rows: RunRows, last: int = 3) -> dict[str, Any]:
    """:func:`advise` of a run's rows already read (:func:`~hpclb.tools.runrows.read_run`)."""
    if isinstance(last, bool) or not (isinstance(last, int) and last >= 1):
        raise ConfigError(f"--last must be an integer >= 1 (epochs to combine), got {last!r}")
    run = rows.path.parent
    noisy = noisy_epochs(rows)
    if not noisy:
        why = _why_no_noise(run) if rows.epochs else (
            "it has no epoch row at all (the run ended, or is still, in its first epoch); "
            "advise reads the epochs' noise scale: let it finish at least one epoch")
        raise ConfigError(f"{run}: no gradient noise scale in metrics.jsonl (no epoch row with a "
                          f"positive finite noise.b_simple): {why}")
    cfg = run_config(rows.path.parent)
    b0 = cfg["base_batch_size"]
    tail = noisy[-last:]
    critical = statistics.median(r["noise"]["b_simple"] for r in tail)
    # each epoch's window quantiles, widened to its end value (the estimate rises within an
    # epoch, so the end value can lie above the window's 90 % quantile)
    def spread(r: dict, key: str) -> list[float]:  # the end value and the quantile, if any
        return [r["noise"]["b_simple"], *([r["noise"][key]] if finite(r["noise"].get(key))
                                          else [])]

    lows = [min(spread(r, "b_simple_lo")) for r in tail]
    highs = [max(spread(r, "b_simple_hi")) for r in tail]
    lo, hi = (min(lows) if lows else None), (max(highs) if highs else None)
    pos = lambda x: x is not None and x > 0  # noqa: E731
    n = _train_samples_min(cfg)
    return {"critical_batch": critical, "critical_lo": lo, "critical_hi": hi,
            "epochs": [r.get("epoch") for r in tail], "base_batch_size": b0,
            "run_batch_size": cfg.get("global_batch_size"),
            "train_samples_min": n, "capped_at": None,
            "recommended_batch": recommend_batch(critical, b0, n) if critical > 0 else b0,
            "recommended_lo": recommend_batch(lo, b0, n) if pos(lo) else None,
            "recommended_hi": recommend_batch(hi, b0, n) if pos(hi) else None}


def _train_samples_min(cfg: dict) -> int | None:
    """The fewest training samples an epoch of ``steps_per_epoch`` steps at ``global_batch_size``
    can hold (its last step at least one sample); None when config.json lacks either."""
    steps, batch = cfg.get("steps_per_epoch"), cfg.get("global_batch_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (steps, batch)):
        return None
    return (steps - 1) * batch + 1


def format_advice(a: dict[str, Any]) -> str:
    """The lines ``hpclb advise`` prints for :func:`advise`'s result."""
    def g(x):
        # batches in samples: whole numbers from 1,000 up (17811, not 1.781e+04)
        return "?" if x is None else f"{x:.0f}" if x >= 1000 else f"{x:.4g}"

    ep = a["epochs"]
    consecutive = all(isinstance(e, int) for e in ep) and ep == list(range(ep[0], ep[0] + len(ep)))
    span = (f"epoch {ep[0]}" if len(ep) == 1 else f"epochs {ep[0]}-{ep[-1]}" if consecutive
            else f"epochs {', '.join(map(str, ep))}")
    k = a["recommended_batch"] / a["base_batch_size"]
    n = a.get("train_samples_min")
    rule = ("B0 itself: critical_batch is below it" if a["critical_batch"] < a["base_batch_size"]
            else "the largest B0 x 2^j not above critical_batch"
            + (f" nor the training set (>= {n} samples)" if n and n < a["critical_batch"]
               else "")
            + (f", capped at k_max's batch {a['capped_at']} (below)" if a.get("capped_at")
               else ""))
    return "\n".join([
        f"critical_batch {g(a['critical_batch'])} (B_simple, McCandlish et al. 2018; median of "
        f"{span}; range {g(a['critical_lo'])} - {g(a['critical_hi'])})",
        f"recommended_batch {a['recommended_batch']} (LEGW, k = {k:g}: {rule}, B0 = "
        f"{a['base_batch_size']}; {a['recommended_lo'] or '?'} - "
        f"{a['recommended_hi'] or '?'} over the range)",
        f"this run's batch: {a['run_batch_size']}"])
