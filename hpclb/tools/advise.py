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
from pathlib import Path
from typing import Any

from hpclb._io import read_json
from hpclb.errors import ConfigError
from hpclb.noise import ONE_PROCESS
from hpclb.schedules import Schedule, WarmupTooLong
from hpclb.tools.dryrun import WARMUP_WARN_FRACTION
from hpclb.tools.runrows import RunRows, Warn, read_run
from hpclb.train.metrics import finite

__all__ = ["recommend_batch", "advise", "format_advice", "progress_ratio", "predict_k_max",
           "format_prediction",
           "predict_for_run", "PROBE_DIR"]

#: where ``hpclb advise RUN_DIR --lr-probe`` keeps its probe runs and ``lr_probe.json``
PROBE_DIR = "lr_probe"

#: LEGW's warmup (constant in steps) may take at most this share of the run's steps at k*B0
#: (the dry run warns past the same share: :data:`hpclb.tools.dryrun.WARMUP_WARN_FRACTION`)
WARMUP_SHARE_MAX = WARMUP_WARN_FRACTION
#: the budget bound: the same epochs at k*B0 must make at least this share of B0's progress
PROGRESS_MIN = 0.5


def recommend_batch(b_simple: float, base_batch_size: int) -> int:
    """The largest batch :func:`hpclb advise` recommends for LEGW: the largest ``B0 * 2^j``
    (``j >= 0``) not above ``b_simple``, so LEGW's ``k`` stays a power of two and the batch
    stays at or below the estimated critical batch; ``B0`` itself when ``b_simple < B0``.
    Raises ValueError for a non-positive or non-finite ``b_simple`` or ``B0``."""
    if not (isinstance(b_simple, (int, float)) and math.isfinite(b_simple) and b_simple > 0):
        raise ValueError(f"b_simple must be a positive finite number, got {b_simple!r}")
    if not (isinstance(base_batch_size, int) and base_batch_size > 0):
        raise ValueError(f"base_batch_size must be a positive integer, got {base_batch_size!r}")
    batch = base_batch_size
    while batch * 2 <= b_simple:
        batch *= 2
    return batch


def _config(run: Path) -> dict:
    path = run / "config.json"
    try:
        cfg = read_json(path, "the config.json files of `hpclb train`")
        b0 = int(cfg["recipe"]["base_batch_size"])
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; advise needs the run's base_batch_size") from None
    except ValueError as e:  # not UTF-8 or not JSON: the message names the file and the place
        raise ConfigError(f"{e}; advise needs the run's recipe.base_batch_size") from None
    except (OSError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a config.json of `hpclb train` ({e!r}); advise needs "
                          f"the run's recipe.base_batch_size") from e
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


def _noisy_epochs(rows: RunRows) -> list[dict]:
    """Epoch rows with a finite ``noise.b_simple``; a noise field without one is warned."""
    noisy = []
    for r in rows.epochs:
        noise = r.get("noise")
        if not isinstance(noise, dict):
            continue
        if finite(noise.get("b_simple")):
            noisy.append(r)
        elif finite(noise.get("g2")) and noise["g2"] <= 0:
            rows.warn(f"{rows.path}:{r['_line']}: epoch {r.get('epoch', '?')}: no B_simple (the "
                      f"smoothed |G|^2 is {noise['g2']:.3g} <= 0: the gradient is all noise); "
                      f"left out of critical_batch, counted as infinite in k_max's budget")
        else:
            rows.warn(f"{rows.path}:{r['_line']}: epoch {r.get('epoch', '?')}: noise.b_simple "
                      f"= {noise.get('b_simple')!r} is not a finite number; epoch left out")
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
    with the same rule at both ends of the spread.
    Raises ConfigError (exit 2) naming the directory when it or its metrics.jsonl is missing,
    and, when the run has no noise data, saying why (trained without ``--noise-scale``, or at
    one process, where it is not measured). Every line or epoch left out (a torn line, a
    non-finite value) goes to ``warn`` with its file and line (:mod:`hpclb.tools.runrows`).
    """
    if not (isinstance(last, int) and last >= 1):
        raise ConfigError(f"--last must be an integer >= 1 (epochs to combine), got {last!r}")
    run = Path(run_dir)
    rows = read_run(run, warn)
    noisy = _noisy_epochs(rows)
    if not noisy:
        raise ConfigError(f"{run}: no gradient noise scale in metrics.jsonl (no epoch row with a "
                          f"finite noise.b_simple): {_why_no_noise(rows.path.parent)}")
    cfg = _config(rows.path.parent)
    b0 = cfg["base_batch_size"]
    tail = noisy[-last:]
    values = sorted(r["noise"]["b_simple"] for r in tail)
    mid = len(values) // 2
    critical = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    # each epoch's window quantiles, widened to its end value (the estimate rises within an
    # epoch, so the end value can lie above the window's 90 % quantile)
    def spread(r: dict, key: str) -> list[float]:  # the end value and the quantile, if any
        return [r["noise"]["b_simple"], *([r["noise"][key]] if finite(r["noise"].get(key))
                                          else [])]

    lows = [min(spread(r, "b_simple_lo")) for r in tail]
    highs = [max(spread(r, "b_simple_hi")) for r in tail]
    lo, hi = (min(lows) if lows else None), (max(highs) if highs else None)
    pos = lambda x: x is not None and x > 0  # noqa: E731
    return {"critical_batch": critical, "critical_lo": lo, "critical_hi": hi,
            "epochs": [r.get("epoch") for r in tail], "base_batch_size": b0,
            "run_batch_size": cfg.get("global_batch_size"),
            "recommended_batch": recommend_batch(critical, b0) if critical > 0 else b0,
            "recommended_lo": recommend_batch(lo, b0) if pos(lo) else None,
            "recommended_hi": recommend_batch(hi, b0) if pos(hi) else None}


def format_advice(a: dict[str, Any]) -> str:
    """The lines ``hpclb advise`` prints for :func:`advise`'s result."""
    def g(x):
        return "?" if x is None else f"{x:.4g}"

    ep = a["epochs"]
    span = f"epoch {ep[0]}" if len(ep) == 1 else f"epochs {ep[0]}-{ep[-1]}"
    k = a["recommended_batch"] / a["base_batch_size"]
    return "\n".join([
        f"critical_batch {a['critical_batch']:.4g} (B_simple, McCandlish et al. 2018; median of "
        f"{span}; range {g(a['critical_lo'])} - {g(a['critical_hi'])})",
        f"recommended_batch {a['recommended_batch']} (LEGW, k = {k:g}: the largest B0 x 2^j not "
        f"above critical_batch, B0 = {a['base_batch_size']}; {a['recommended_lo'] or '?'} - "
        f"{a['recommended_hi'] or '?'} over the range)",
        f"this run's batch: {a['run_batch_size']}"])


def progress_ratio(batch: int, base_batch_size: int, b_simple: list[float]) -> float:
    """The share of a B0 run's optimisation progress that the same epochs make at ``batch``:
    the mean over the B0 run's epochs of ``(B0 + B_e) / (batch + B_e)``, ``B_e`` that epoch's
    B_simple. By McCandlish et al. (2018, eq. 2.11) a step at batch B makes ``1 / (1 +
    B_crit / B)`` of the progress of a step at infinite batch, so an epoch (N / B steps) at B
    makes ``(B0 + B_crit) / (B + B_crit)`` of an epoch at B0's; B_simple stands for B_crit, and
    it grows as training goes on, so each epoch has its own. ``inf`` (an epoch whose gradient
    was all noise: estimated ``|G|^2 <= 0``) counts 1. 1 at ``batch = B0``; with one
    constant ``B_e`` it is at least 1/2 while ``batch <= B_e + 2 B0``."""
    if not b_simple:
        raise ValueError("b_simple: no epoch's noise scale")
    return sum(1.0 if math.isinf(b) else (base_batch_size + b) / (batch + b)
               for b in b_simple) / len(b_simple)


def predict_k_max(*, base_batch_size: int, num_samples: int, epochs: float,
                  base_warmup_epochs: float, base_lr: float, b_simple: list[float],
                  stable_lr: float | None = None, k_limit: int = 1024) -> dict[str, Any]:
    """The largest ``k = 2^j`` (``k * B0`` the global batch) at which LEGW is expected to hold,
    by the rule of docs/science.md ("Where LEGW breaks", fixed before the k-map): each bound
    below is the largest ``k <= k_limit`` that passes it, and ``k_max`` the smallest of them.

    - ``budget``: the same epochs at ``k * B0`` make at least :data:`PROGRESS_MIN` of the B0
      run's progress (:func:`progress_ratio` of ``b_simple``, the B0 run's B_simple per epoch,
      in order): a recipe with about 2x slack in its epochs still reaches its result;
    - ``warmup``: LEGW's warmup (its B0 steps, at every k) takes at most
      :data:`WARMUP_SHARE_MAX` of the steps the budget leaves at ``k * B0``;
    - ``stability``: ``sqrt(k) * eta0 <= stable_lr`` (the LR probe at B0,
      :mod:`hpclb.tools.lr_probe`); no bound when ``stable_lr`` is None.

    ``num_samples``: training samples (the unit the recipe's batch counts); ``epochs`` the
    budget. Returns ``{"k_max", "batch", "bounds": {name: k}, "binding": [names], "rows":
    [{"k", "batch", "peak_lr", "warmup_steps", "total_steps", "warmup_share"}]}``. Raises
    ValueError for a non-positive input."""
    for name, v in (("base_batch_size", base_batch_size), ("num_samples", num_samples),
                    ("epochs", epochs), ("base_lr", base_lr), ("k_limit", k_limit),
                    *(("b_simple", b) for b in b_simple)):
        if not (isinstance(v, (int, float)) and v > 0 and (math.isfinite(v) or name == "b_simple"
                                                             and v == math.inf)):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    rows, k = [], 1
    while k <= k_limit and k * base_batch_size <= num_samples:
        try:
            s = Schedule.from_recipe(base_lr=base_lr, base_batch_size=base_batch_size,
                                     base_warmup_epochs=base_warmup_epochs,
                                     global_batch_size=k * base_batch_size,
                                     num_samples=num_samples, epochs=epochs, scheme="legw")
            share = s.warmup_steps / s.total_steps
            rows.append({"k": k, "batch": k * base_batch_size, "peak_lr": s.peak_lr,
                         "warmup_steps": s.warmup_steps, "total_steps": s.total_steps,
                         "warmup_share": share,
                         "progress": progress_ratio(k * base_batch_size, base_batch_size,
                                                    b_simple)})
        except WarmupTooLong:
            break
        k *= 2
    passes = {
        "budget": lambda r: r["k"] == 1 or r["progress"] >= PROGRESS_MIN,
        "warmup": lambda r: r["k"] == 1 or r["warmup_share"] <= WARMUP_SHARE_MAX,
        "stability": lambda r: stable_lr is None or r["peak_lr"] <= stable_lr * (1 + 1e-9)}
    bounds = {}
    for name, ok in passes.items():
        good = [r["k"] for r in rows]
        first_bad = next((r["k"] for r in rows if not ok(r)), None)
        bounds[name] = max(x for x in good if first_bad is None or x < first_bad)
    k_max = min(bounds.values())
    return {"k_max": k_max, "batch": k_max * base_batch_size, "bounds": bounds,
            "binding": [n for n, b in bounds.items() if b == k_max], "k_limit": k_limit,
            "stable_lr": stable_lr, "rows": rows}


def format_prediction(p: dict[str, Any]) -> str:
    """The lines ``hpclb advise`` prints for :func:`predict_k_max`'s result."""
    rows = {r["k"]: r for r in p["rows"]}
    b = p["bounds"]
    top = max(rows)

    def at(k: int) -> str:
        return f" (no k up to {top} fails)" if k >= top else f" (fails at k = {2 * k})"

    w = rows.get(2 * b["warmup"], rows[b["warmup"]])
    lines = [f"k_max {p['k_max']} (batch {p['batch']}): LEGW expected to hold up to here; bound "
             f"by {', '.join(p['binding'])}",
             f"  budget: the epochs at k x B0 make >= {PROGRESS_MIN:.0%} of B0's progress "
             f"(B_simple per epoch) -> k <= {b['budget']}{at(b['budget'])}"
             + (f"; at k = {2 * b['budget']}: {rows[2 * b['budget']]['progress']:.0%}"
                if 2 * b["budget"] in rows else ""),
             f"  warmup: {rows[1]['warmup_steps']} warmup steps <= "
             f"{WARMUP_SHARE_MAX:.0%} of the steps -> k <= {b['warmup']}{at(b['warmup'])}"
             + (f"; at k = {w['k']} it is {w['warmup_steps']} of {w['total_steps']}"
                if w["k"] != b["warmup"] else "")]
    if p["stable_lr"] is None:
        lines.append("  stability: not measured (hpclb advise RUN_DIR --lr-probe)")
    else:
        s = rows.get(2 * b["stability"])
        lines.append(f"  stability: sqrt(k) x eta0 <= stable LR {p['stable_lr']:.4g} (probe at "
                     f"B0) -> k <= {b['stability']}" + (
                         f" (peak {s['peak_lr']:.4g} at k = {s['k']})" if s else at(top)))
    return "\n".join(lines)


def _b_simple_per_epoch(rows: RunRows) -> list[float]:
    """Each epoch's B_simple for :func:`progress_ratio`: ``inf`` where the smoothed ``|G|^2``
    was not positive (the gradient all noise: late in a run whose loss is near 0), epochs
    without a noise field left out."""
    out = []
    for r in rows.epochs:
        noise = r.get("noise")
        if isinstance(noise, dict) and finite(noise.get("b_simple")):
            out.append(float(noise["b_simple"]))
        elif isinstance(noise, dict) and finite(noise.get("g2")) and noise["g2"] <= 0:
            out.append(math.inf)
    return out


def _run_inputs(run: Path, cfg: dict) -> dict[str, Any]:
    """The recipe's inputs to :func:`predict_k_max` for a B0 run's ``config.json`` ``cfg``;
    the training set is sized as the run's dry run sizes it (registry, else read)."""
    from hpclb.config import resolve
    from hpclb.tools.dryrun import train_set_size_of

    try:
        one = resolve(cfg["experiment"], optimizer=cfg.get("optimizer"), lr=cfg.get("lr"),
                      epochs=cfg.get("epochs"), data_dir=cfg.get("data_root"),
                      out=str(run / "advise-unused"))
    except ConfigError as e:
        raise ConfigError(f"{run}: cannot rebuild the run's recipe {cfg['experiment']!r} to "
                          f"size its budget: {e}") from e
    n, unit, _ = train_set_size_of(one)
    return {"experiment": cfg["experiment"], "optimizer": one.optimizer,
            "base_batch_size": one.base_batch_size, "num_samples": n, "unit": unit,
            "epochs": one.epochs, "base_warmup_epochs": float(one.spec.warmup_epochs),
            "base_lr": one.base_lr}


def predict_for_run(run_dir, *, last: int = 3, stable_lr: float | None = None,
                    probe: dict | None = None, warn: Warn | None = None) -> dict[str, Any]:
    """:func:`advise` of a B0 run trained with ``--noise-scale`` and :func:`predict_k_max` from
    its critical batch and recipe: ``{"advice", "inputs", "prediction", "probe"}``. The stable
    LR is ``stable_lr`` if given, else ``probe["stable_lr"]`` (:mod:`hpclb.tools.lr_probe`),
    else the probe saved in ``RUN_DIR/lr_probe/lr_probe.json`` when there is one, else none.
    Raises ConfigError as :func:`advise` does, and when the run is not at its recipe's B0
    (the prediction is made from a B0 run)."""
    a = advise(run_dir, last=last, warn=warn)
    run = Path(run_dir)
    run = run.parent if run.is_file() else run
    cfg = _config(run)
    if a["run_batch_size"] != a["base_batch_size"]:
        raise ConfigError(f"{run}: trained at batch {a['run_batch_size']}, not at its recipe's "
                          f"B0 {a['base_batch_size']}: the k_max prediction starts from a B0 run "
                          f"(hpclb train ... --noise-scale without --batch-size)")
    saved = run / PROBE_DIR / "lr_probe.json"
    if probe is None and stable_lr is None and saved.is_file():
        probe = read_json(saved, "hpclb advise --lr-probe's lr_probe.json")
    if stable_lr is None and probe is not None:
        stable_lr = probe["stable_lr"]
    inputs = _run_inputs(run, cfg)
    inputs["b_simple"] = _b_simple_per_epoch(read_run(run, warn))
    pred = predict_k_max(**{k: inputs[k] for k in ("base_batch_size", "num_samples", "epochs",
                                                   "base_warmup_epochs", "base_lr",
                                                   "b_simple")}, stable_lr=stable_lr)
    return {"advice": a, "inputs": inputs, "prediction": pred,
            "probe": None if probe is None else {k: v for k, v in probe.items()
                                                 if k != "probes"} | {
                "probes": [{k: p[k] for k in ("j", "k", "lr", "trains", "why")}
                           for p in probe["probes"]]}}
