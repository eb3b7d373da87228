"""``hpclb advise --lr-probe``: the largest peak LR a recipe trains at **at its own B0 batch**.

LEGW moves the B0 peak LR ``eta0`` to ``eta0 * sqrt(k)`` at ``k * B0``. Where the loss surface
bounds the LR independently of the batch (a curvature limit, ``eta < 2 / lambda_max``, which a
larger batch does not raise), ``sqrt(k) * eta0`` past that limit diverges at any batch; the
probe measures the limit at B0, where it is cheapest.

One probe at LR ``eta``: the recipe at B0, seed 0, its own warmup (a linear ramp from 0 over
its ``W0`` epochs, the same steps LEGW keeps at every k), then ``eta`` held constant
(``decay: constant``) for :data:`HOLD_STEPS` steps; the training loss is logged every
:data:`LOG_EVERY` steps. It **trains** (:func:`trains`) when every logged loss is finite, none
rises above the first interval's loss (the loss at initialisation, the warmup's LR being near 0)
by more than :data:`RISE`, and the last :data:`TAIL` intervals average at most :data:`FALL` of
it. The grid is ``eta0 * 2^(j/2)``, ``j = 0, 1, ...`` (the peaks LEGW gives at ``k = 2^j``), and
the probe stops at the first LR that does not train; the **stable LR** is the last one that did.
Rule and constants fixed 2026-12-07 (docs/science.md, "Where LEGW breaks"), before the k-map.
"""
from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import yaml

from hpclb._io import write_json
from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError, Diverged, NonFiniteError, Preempted
from hpclb.tools.dryrun import train_set_size_of
from hpclb.tools.runrows import read_run
from hpclb.train.loop import train

__all__ = ["HOLD_STEPS", "LOG_EVERY", "RISE", "FALL", "TAIL", "trains", "probe_lr",
           "stability_probe"]

HOLD_STEPS = 300   # optimizer steps at the probed LR after the warmup
LOG_EVERY = 10     # steps per logged (mean) training loss
RISE = 1.10        # a logged loss above RISE x the first one: diverging
FALL = 0.90        # the last TAIL losses must average at most FALL x the first one: training
TAIL = 5


def trains(losses: list[float]) -> tuple[bool, str]:
    """(whether the logged losses of one probe train, why): see the module docstring.
    ``losses``: the mean training loss of each :data:`LOG_EVERY`-step interval, in order."""
    if len(losses) < TAIL + 1:
        return False, f"only {len(losses)} logged losses (the probe stopped early)"
    bad = [x for x in losses if x is None or not math.isfinite(x)]
    if bad:
        return False, f"non-finite loss {bad[0]!r}"
    first, peak = losses[0], max(losses[1:])
    if peak > RISE * first:
        return False, f"loss rose to {peak:.4g} from {first:.4g} at the start"
    tail = sum(losses[-TAIL:]) / TAIL
    if tail > FALL * first:
        return False, f"loss still {tail:.4g} at the end (start {first:.4g}): not training"
    return True, f"loss {first:.4g} -> {tail:.4g}"


def _probe_recipe(experiment: str, work: Path) -> Path:
    """The recipe with a constant LR after its warmup, as a YAML file in ``work``."""
    recipe = load_recipe(experiment)
    recipe["decay"] = {"name": "constant"}  # plugin_path is already absolute
    work.mkdir(parents=True, exist_ok=True)
    path = work / "probe-recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def probe_lr(recipe_path: Path, lr: float, *, optimizer: str | None, out: Path,
             data_dir: str | None = None, seed: int = 0, hold_steps: int = HOLD_STEPS) -> dict:
    """One probe (module docstring) of the recipe at ``recipe_path`` (``decay: constant``) at
    peak ``lr``, trained in this process at one rank in ``out`` (replaced):
    ``{"lr", "trains", "why", "steps", "losses"}``."""
    def cfg_for(epochs: float | None):
        return resolve(str(recipe_path), optimizer=optimizer, lr=lr, seed=seed,
                       data_dir=data_dir, out=str(out), overwrite=True, log_every=LOG_EVERY,
                       epochs=epochs)

    one = cfg_for(None)
    sched = one.schedule(train_set_size_of(one)[0])
    steps = sched.warmup_steps + hold_steps
    cfg = cfg_for(steps / sched.steps_per_epoch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(cfg, SelfCommunicator(), quiet=True, tensorboard=False, progress_every_s=None)
    except (Diverged, NonFiniteError) as e:
        return {"lr": lr, "trains": False, "why": f"diverged: {e}", "steps": steps, "losses": []}
    except Preempted as e:  # Ctrl-C (or a scheduler's signal) inside a probe: stop the probe
        raise KeyboardInterrupt from e
    finally:  # a probe keeps its metrics, not its checkpoints (a ResNet's would be GBs)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        for f in ("checkpoint.pt", "checkpoint.pt.sha256"):
            (out / f).unlink(missing_ok=True)
    losses = [r.get("loss") for r in read_run(out).steps]
    ok, why = trains(losses)
    return {"lr": lr, "trains": ok, "why": why, "steps": steps, "losses": losses}


def stability_probe(experiment: str, *, optimizer: str | None, work: Path,
                    lr: float | None = None, data_dir: str | None = None, max_j: int = 10,
                    hold_steps: int = HOLD_STEPS, record: dict | None = None,
                    report: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """The probe on the grid ``eta0 * 2^(j/2)``, ``j = 0 .. max_j``, stopping at the first LR that
    does not train: ``{"experiment", "optimizer", "base_lr", "probes": [...], "stable_lr",
    "k_stable", "bounded"}`` (``k_stable``: the largest ``k = 2^j`` whose LEGW peak
    ``eta0 * 2^(j/2)`` trained; ``bounded`` False when every LR up to ``j = max_j`` did);
    written to ``work/lr_probe.json`` with ``record``'s fields. ``lr``: eta0 (default the
    recipe's). ``report`` gets each probe as it ends. ConfigError when ``eta0`` itself does
    not train (nothing to scale from); KeyboardInterrupt for a Ctrl-C (nothing written)."""
    path = _probe_recipe(experiment, work)
    base = resolve(str(path), optimizer=optimizer, lr=lr, out=str(work / "lr-base"))
    eta0, probes, stable_j = base.base_lr, [], None
    for j in range(max_j + 1):
        lr = eta0 * 2 ** (j / 2)
        p = {"j": j, "k": 2 ** j, **probe_lr(path, lr, optimizer=base.optimizer,
                                             out=work / f"lr-j{j}", data_dir=data_dir,
                                             hold_steps=hold_steps)}
        probes.append(p)
        if report:
            report(p)
        if not p["trains"]:
            break
        stable_j = j
    if stable_j is None:
        raise ConfigError(f"{experiment}: the B0 recipe's own LR {eta0:g} does not train in the "
                          f"probe ({probes[0]['why']}); nothing to scale from")
    result = {**(record or {}), "experiment": experiment, "optimizer": base.optimizer,
              "base_lr": eta0,
              "hold_steps": hold_steps, "probes": probes,
              "stable_lr": eta0 * 2 ** (stable_j / 2), "k_stable": 2 ** stable_j,
              "bounded": stable_j < max_j}
    write_json(work / "lr_probe.json", result)
    return result
