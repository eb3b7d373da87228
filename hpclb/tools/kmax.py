"""Where LEGW is expected to break: ``hpclb advise``'s ``k_max`` for a B0 run trained with
``--noise-scale`` (the rule of docs/science.md, "Where LEGW breaks", fixed 2026-12-07 before the
k-map). :func:`predict_k_max` is the rule on plain numbers; :func:`predict_for_run` reads them
from a run directory: the B0 run's B_simple per epoch (:mod:`hpclb.tools.advise`), its recorded
recipe (``config.json``: the recipe the run trained, not the name it was started by) and the
stable LR of the LR probe (:mod:`hpclb.tools.lr_probe`) kept beside it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hpclb._io import read_json
from hpclb.errors import ConfigError
from hpclb.schedules import Schedule, WarmupTooLong
from hpclb.tools.advise import advice_of, run_config
from hpclb.tools.dryrun import WARMUP_WARN_FRACTION
from hpclb.tools.runrows import RunRows, Warn, read_run
from hpclb.train.metrics import finite

__all__ = ["PROBE_DIR", "PROGRESS_MIN", "WARMUP_SHARE_MAX", "progress_ratio", "predict_k_max",
           "format_prediction", "run_data_dir", "run_recipe", "saved_probe", "predict_for_run"]

#: where ``hpclb advise RUN_DIR --lr-probe`` keeps its probe runs and ``lr_probe.json``
PROBE_DIR = "lr_probe"
#: LEGW's warmup (constant in steps) may take at most this share of the run's steps at k*B0
#: (the dry run warns past the same share: :data:`hpclb.tools.dryrun.WARMUP_WARN_FRACTION`)
WARMUP_SHARE_MAX = WARMUP_WARN_FRACTION
#: the budget bound: the same epochs at k*B0 must make at least this share of B0's progress
PROGRESS_MIN = 0.5


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


def _rows(base_batch_size, num_samples, epochs, base_warmup_epochs, base_lr, b_simple,
          k_limit) -> list[dict]:
    """LEGW at ``k = 1, 2, 4, ...`` up to ``k_limit``, the training set, or a warmup no longer
    shorter than the run."""
    rows, k = [], 1
    while k <= k_limit and k * base_batch_size <= num_samples:
        try:
            s = Schedule.from_recipe(base_lr=base_lr, base_batch_size=base_batch_size,
                                     base_warmup_epochs=base_warmup_epochs,
                                     global_batch_size=k * base_batch_size,
                                     num_samples=num_samples, epochs=epochs, scheme="legw")
        except WarmupTooLong:
            break
        rows.append({"k": k, "batch": k * base_batch_size, "peak_lr": s.peak_lr,
                     "warmup_steps": s.warmup_steps, "total_steps": s.total_steps,
                     "warmup_share": s.warmup_steps / s.total_steps,
                     "progress": progress_ratio(k * base_batch_size, base_batch_size, b_simple)})
        k *= 2
    return rows


def predict_k_max(*, base_batch_size: int, num_samples: int, epochs: float,
                  base_warmup_epochs: float, base_lr: float, b_simple: list[float],
                  stable_lr: float | None = None, k_limit: int = 1024) -> dict[str, Any]:
    """The largest ``k = 2^j`` (``k * B0`` the global batch) at which LEGW is expected to hold,
    by the rule of docs/science.md ("Where LEGW breaks", fixed before the k-map): each bound
    below is the largest ``k <= k_limit`` that passes it (k = 1, the B0 recipe itself, always
    does), and ``k_max`` the smallest of them.

    - ``budget``: the same epochs at ``k * B0`` make at least :data:`PROGRESS_MIN` of the B0
      run's progress (:func:`progress_ratio` of ``b_simple``, the B0 run's B_simple per epoch,
      in order): a recipe with about 2x slack in its epochs still reaches its result;
    - ``warmup``: LEGW's warmup (its B0 steps, at every k) takes at most
      :data:`WARMUP_SHARE_MAX` of the steps the budget leaves at ``k * B0``;
    - ``stability``: ``sqrt(k) * eta0 <= stable_lr`` (the LR probe at B0,
      :mod:`hpclb.tools.lr_probe`); no bound when ``stable_lr`` is None.

    ``num_samples``: training samples (the unit the recipe's batch counts); ``epochs`` the
    budget. ``binding``: the bounds that fail at ``2 * k_max``; where none does, why the k range
    ends there (``"k_limit"`` or ``"training set"``: ``2 * k_max * B0`` is above it). A warmup
    no shorter than the whole run at the next k fails the warmup bound there (``table_end``,
    why the rows stop after ``k_max``'s table: ``"k_limit"``, ``"training set"`` or None, that
    warmup).
    Returns ``{"k_max", "batch", "bounds": {name: k}, "binding": [names], "k_limit", "table_end",
    "stable_lr", "rows": [{"k", "batch", "peak_lr", "warmup_steps", "total_steps",
    "warmup_share", "progress"}]}``. Raises ValueError for a non-positive input."""
    for name, v in (("base_batch_size", base_batch_size), ("num_samples", num_samples),
                    ("epochs", epochs), ("base_lr", base_lr), ("k_limit", k_limit),
                    *(("stable_lr", s) for s in [stable_lr] if s is not None),
                    *(("b_simple", b) for b in b_simple)):
        if not (isinstance(v, (int, float)) and v > 0 and (math.isfinite(v) or name == "b_simple"
                                                             and v == math.inf)):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    rows = _rows(base_batch_size, num_samples, epochs, base_warmup_epochs, base_lr, b_simple,
                 k_limit)
    passes = {
        "budget": lambda r: r["progress"] >= PROGRESS_MIN,
        "warmup": lambda r: r["warmup_share"] <= WARMUP_SHARE_MAX,
        "stability": lambda r: stable_lr is None or r["peak_lr"] <= stable_lr * (1 + 1e-9)}
    # why the table ends after its last k: k_limit, the training set, or (else) a warmup no
    # shorter than the run at the next k, which fails the warmup bound there
    after = 2 * rows[-1]["k"]
    end = ("k_limit" if after > k_limit else "training set"
           if after * base_batch_size > num_samples else None)
    bounds, failed = {}, []
    for name, ok in passes.items():
        first_bad = next((r["k"] for r in rows[1:] if not ok(r)), None)
        if first_bad is None and name == "warmup" and end is None:
            first_bad = after
        bounds[name] = max(r["k"] for r in rows if first_bad is None or r["k"] < first_bad)
        failed += [name] if first_bad is not None else []
    k_max = min(bounds.values())
    return {"k_max": k_max, "batch": k_max * base_batch_size, "bounds": bounds,
            "binding": [n for n in failed if bounds[n] == k_max] or [end], "k_limit": k_limit,
            "table_end": end, "stable_lr": stable_lr, "rows": rows}


#: the optimizers whose k_max the k-maps found to be an upper bound only (docs/science.md)
SGD_FAMILY = ("sgd", "momentum")
SGD_CAVEAT = ("with SGD (+ momentum) read k_max as an upper bound: the rule's bounds (budget, "
              "warmup, stability) do not bound an LR too small for the batch; LEGW failed at "
              "every k measured (8 to 64) on MNIST-LSTM with momentum, where this rule predicted "
              "32, and from k = 8 on PTB-small with plain SGD (under-trained, not unstable), "
              "where it predicted 16; the linear rule (--scaling goyal) did better with momentum "
              "up to its stability bound (docs/science.md, 'Momentum: the miss, and why')")
#: the trust-ratio optimizers, whose stability bound the CNN's k-map found conservative
TRUST_FAMILY = ("lars", "lamb")
TRUST_CAVEAT = ("with {optimizer}, a k_max bound by stability from a probe at B0 was "
                "conservative where measured: on Fashion ResNet-8 with LARS this rule predicted "
                "1 and LEGW held at k = 4 (its short warmup's peak, 2x the probe's stable LR, "
                "trained), failing at 8 (docs/science.md, 'Which batch should I use?'); LAMB "
                "was not measured")


def format_prediction(p: dict[str, Any], stable_from: str = "probe at B0") -> str:
    """The lines ``hpclb advise`` prints for :func:`predict_k_max`'s result; ``stable_from``
    says where the stable LR came from."""
    rows = {r["k"]: r for r in p["rows"]}
    b = p["bounds"]
    top = max(rows)

    def at(k: int, warmup: bool = False) -> str:
        if k >= top and warmup and p.get("table_end", "k_limit") is None:
            return f" (fails at k = {2 * k}: the warmup is no shorter than the whole run there)"
        return f" (no k up to {top} fails)" if k >= top else f" (fails at k = {2 * k})"

    w = rows.get(2 * b["warmup"], rows[b["warmup"]])
    lines = [f"k_max {p['k_max']} (batch {p['batch']}): LEGW expected to hold up to here; bound "
             f"by {', '.join(p['binding'])}",
             f"  budget: the epochs at k x B0 make >= {PROGRESS_MIN:.0%} of B0's progress "
             f"(B_simple per epoch) -> k <= {b['budget']}{at(b['budget'])}"
             + (f"; at k = {2 * b['budget']}: {rows[2 * b['budget']]['progress']:.0%}"
                if 2 * b["budget"] in rows else ""),
             f"  warmup: {rows[1]['warmup_steps']} warmup steps <= "
             f"{WARMUP_SHARE_MAX:.0%} of the steps -> k <= {b['warmup']}{at(b['warmup'], True)}"
             + (f"; at k = {w['k']} it is {w['warmup_steps']} of {w['total_steps']}"
                if w["k"] != b["warmup"] else "")]
    if p["stable_lr"] is None:
        lines.append("  stability: not measured (hpclb advise RUN_DIR --lr-probe)")
    else:
        s = rows.get(2 * b["stability"])
        below = " (B0's own eta0 is above it)" if rows[1]["peak_lr"] > p["stable_lr"] else ""
        lines.append(f"  stability: sqrt(k) x eta0 <= stable LR {p['stable_lr']:.4g} "
                     f"({stable_from}) -> k <= {b['stability']}{below}" + (
                         f" (peak {s['peak_lr']:.4g} at k = {s['k']})" if s else at(top)))
    if p.get("caveat"):
        lines.append(f"  caveat: {p['caveat']}")
    return "\n".join(lines)


def _b_simple_per_epoch(rows: RunRows) -> list[float]:
    """Each epoch's B_simple for :func:`progress_ratio`: ``inf`` where the smoothed ``|G|^2``
    was not positive (the gradient all noise: late in a run whose loss is near 0), epochs
    without a positive finite value left out."""
    out = []
    for r in rows.epochs:
        noise = r.get("noise")
        if isinstance(noise, dict) and finite(noise.get("b_simple")) and noise["b_simple"] > 0:
            out.append(float(noise["b_simple"]))
        elif isinstance(noise, dict) and finite(noise.get("g2")) and noise["g2"] <= 0:
            out.append(math.inf)
    return out


def run_recipe(cfg: dict, folder: Path) -> Path:
    """The recipe the run recorded (``config.json``'s ``recipe``: its plug-in paths absolute)
    written to ``folder/run-recipe.yaml``, so that a run started from a copy, a plug-in recipe
    or another working directory is rebuilt as it trained. ConfigError when there is none."""
    recipe = cfg.get("recipe")
    if not isinstance(recipe, dict) or "name" not in recipe:
        raise ConfigError("config.json holds no recipe (a run of an older hpclb?); advise needs "
                          "the recipe the run trained")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run-recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _recipe_digest(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg.get("recipe"), sort_keys=True).encode()).hexdigest()


def run_data_dir(cfg: dict, given: str | None = None) -> str | None:
    """Where to read the data of a run of ``config.json`` ``cfg``: ``given`` (``--data-dir``),
    else the run's own ``--data-dir``, else None (``$HPCLB_DATA``, as a run resolves it) when
    that is set, else the directory the run read (``data_root``) when it is an absolute path
    to a directory here, else None (``./data``)."""
    if given or cfg.get("data_dir"):
        return given or cfg["data_dir"]
    root = Path(cfg.get("data_root") or ".")
    if os.environ.get("HPCLB_DATA") or not root.is_absolute() or not root.is_dir():
        return None
    return str(root)


def _run_inputs(run: Path, cfg: dict, data_dir: str | None = None) -> dict[str, Any]:
    """The inputs of :func:`predict_k_max` from a B0 run's ``config.json`` ``cfg``: its recorded
    recipe, optimizer, ``--lr``, epochs and data; the training set sized as the run's dry run
    sizes it (registry, else read from :func:`run_data_dir`)."""
    from hpclb.config import resolve
    from hpclb.tools.dryrun import train_set_size_of

    with tempfile.TemporaryDirectory() as tmp:
        try:
            one = resolve(str(run_recipe(cfg, Path(tmp))), optimizer=cfg.get("optimizer"),
                          lr=cfg.get("lr"), epochs=cfg.get("epochs"),
                          data_dir=run_data_dir(cfg, data_dir), out=str(Path(tmp) / "unused"))
            n, unit, _ = train_set_size_of(one)
        except ConfigError as e:
            raise ConfigError(f"{run}: cannot rebuild the recipe the run trained "
                              f"({cfg.get('experiment')!r}) to size its budget: {e}") from e
    return {"experiment": cfg.get("experiment"), "recipe_sha256": _recipe_digest(cfg),
            "optimizer": one.optimizer, "base_batch_size": one.base_batch_size,
            "num_samples": n, "unit": unit, "epochs": one.epochs,
            "base_warmup_epochs": float(one.spec.warmup_epochs), "base_lr": one.base_lr}


def saved_probe(run: Path, inputs: dict, warn: Warn) -> dict | None:
    """``RUN_DIR/lr_probe/lr_probe.json`` (else ``RUN_DIR/lr_probe.json``, as a run's record
    keeps it) when it probed this run's recipe, optimizer and eta0;
    None (with a warning) when it probed another (the run was overwritten since) or is
    unreadable."""
    path = run / PROBE_DIR / "lr_probe.json"
    if not path.is_file():  # a run's record keeps it beside config.json (results/science/)
        path = run / "lr_probe.json"
    if not path.is_file():
        return None
    try:
        probe = read_json(path, "hpclb advise --lr-probe's lr_probe.json")
        same = (probe["optimizer"] == inputs["optimizer"]
                and math.isclose(probe["base_lr"], inputs["base_lr"], rel_tol=1e-9)
                and probe.get("recipe_sha256", inputs["recipe_sha256"]) == inputs["recipe_sha256"])
    except (ValueError, KeyError, TypeError) as e:
        warn(f"{path}: not a probe of hpclb advise ({e}); ignored: run --lr-probe again")
        return None
    if not same:
        warn(f"{path}: probed {probe['optimizer']} from eta0 {probe['base_lr']:g} (or another "
             f"recipe), not this run's {inputs['optimizer']} from {inputs['base_lr']:g}; ignored: "
             f"run --lr-probe again")
        return None
    return probe


def _cap_at_k_max(a: dict, batch: int) -> None:
    """The advice ``a``'s recommended batches, in place, at most ``batch`` (the predicted
    k_max's): the critical batch alone recommended batches the k_max line (and ``hpclb
    train``'s warmup check) refused (fresh-user review); ``a["capped_at"]``: ``batch`` when it
    capped one."""
    if a["recommended_batch"] > batch:
        a["capped_at"] = batch
        for key in ("recommended_batch", "recommended_lo", "recommended_hi"):
            if a.get(key) is not None:
                a[key] = min(a[key], batch)


def predict_for_run(run_dir, *, last: int = 3, stable_lr: float | None = None,
                    probe: dict | None = None, warn: Warn | None = None,
                    data_dir: str | None = None) -> dict[str, Any]:
    """The advice (:func:`~hpclb.tools.advise.advise`) and, for a run at its recipe's B0, the
    prediction: ``{"advice", "inputs", "prediction", "probe", "stable_from"}`` (the advice's
    recommended batches at most the prediction's batch, ``capped_at`` it; ``stable_from``:
    ``"given"``, ``"probe at B0"`` or None without a stable LR)
    (``prediction`` None, with ``why``, for a run at another batch). The stable LR is
    ``stable_lr`` if given, else ``probe["stable_lr"]``, else the probe saved beside the run
    (:func:`saved_probe`), else none. ``data_dir``: where the run's data is, when the training
    set is counted by reading it (:func:`run_data_dir`). For an SGD-family optimizer the
    prediction has a ``caveat`` (:data:`SGD_CAVEAT`), for LARS/LAMB bound by stability another
    (:data:`TRUST_CAVEAT`). Raises ConfigError as ``advise`` does, DataError when the data cannot
    be read."""
    rows = read_run(Path(run_dir), warn)
    warn = rows.warn
    a = advice_of(rows, last)
    run = rows.path.parent
    if a["run_batch_size"] != a["base_batch_size"]:
        return {"advice": a, "prediction": None,
                "why": f"trained at batch {a['run_batch_size']}, not at its recipe's B0 "
                       f"{a['base_batch_size']}: the k_max prediction starts from a B0 run"}
    cfg = run_config(run)
    inputs = _run_inputs(run, cfg, data_dir)
    inputs["b_simple"] = _b_simple_per_epoch(rows)
    planned = (cfg.get("recipe") or {}).get("epochs")
    if finite(planned) and not math.isclose(planned, inputs["epochs"]):
        e = f"{inputs['epochs']:g} epoch{'' if inputs['epochs'] == 1 else 's'}"
        warn(f"{run}: trained {e}, not its recipe's {planned:g}: k_max is "
             f"for a budget of {e} (the noise scale of the epochs it did "
             f"not train is unknown); train the B0 run for the recipe's epochs to predict for them")
    if probe is None and stable_lr is None:
        probe = saved_probe(run, inputs, warn)
    stable_from = "given" if stable_lr is not None else None
    if stable_lr is None and probe is not None:
        stable_lr, stable_from = probe["stable_lr"], "probe at B0"
    pred = predict_k_max(**{k: inputs[k] for k in ("base_batch_size", "num_samples", "epochs",
                                                   "base_warmup_epochs", "base_lr",
                                                   "b_simple")}, stable_lr=stable_lr)
    if inputs["optimizer"] in SGD_FAMILY:
        pred["caveat"] = SGD_CAVEAT
    elif inputs["optimizer"] in TRUST_FAMILY and "stability" in pred["binding"]:
        pred["caveat"] = TRUST_CAVEAT.format(optimizer=inputs["optimizer"].upper())
    _cap_at_k_max(a, pred["batch"])
    return {"advice": a, "inputs": inputs, "prediction": pred, "stable_from": stable_from,
            "probe": None if probe is None else {k: v for k, v in probe.items()
                                                 if k != "probes"} | {
                "probes": [{k: p[k] for k in ("j", "k", "lr", "trains", "why")}
                           for p in probe["probes"]]}}
