"""``hpclb evaluate RUN_DIR``: score a run's checkpoint again, e.g. with another decoder.

Reads ``RUN_DIR/config.json`` (the resolved recipe the run was trained with) and the model
weights of ``RUN_DIR/checkpoint.pt`` (the last one saved: at the end of a finished run, or the
latest epoch/preemption checkpoint of an unfinished one), rebuilds the same task and model, and
runs the task's own evaluation (the one the training loop runs after every epoch), on every rank
of the communicator (the test set is sharded as in training). Nothing in ``RUN_DIR`` is changed.

Seq2seq runs take ``beam_size`` / ``length_penalty`` overrides (the recipe's ``data.beam_size``,
``data.length_penalty``), so a model trained once can be scored with greedy and beam decoding.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from hpclb._io import read_json
from hpclb.comm.base import Communicator
from hpclb.errors import ConfigError
from hpclb.models import build_model
from hpclb.tasks import build_task
from hpclb.train.checkpoint import CheckpointStore

__all__ = ["evaluate_run"]


def _decoding_overrides(recipe: dict, beam_size: int | None,
                        length_penalty: float | None) -> dict[str, Any]:
    """The recipe's ``data`` with the decoding overrides applied; ConfigError names a bad one."""
    data = dict(recipe["data"])
    if beam_size is None and length_penalty is None:
        return data
    if recipe.get("task") != "seq2seq":
        task = recipe.get("task", "classification")
        raise ConfigError(f"--beam-size / --length-penalty: the run is a {task} "
                          f"run; decoding options apply to seq2seq runs only (drop them)")
    if beam_size is not None:
        if beam_size < 1:
            raise ConfigError(f"--beam-size {beam_size}: must be an integer >= 1 (1: greedy)")
        data["beam_size"] = beam_size
    if length_penalty is not None:
        if not (math.isfinite(length_penalty) and length_penalty >= 0):
            raise ConfigError(f"--length-penalty {length_penalty}: must be a finite number >= 0 "
                              f"(GNMT's alpha; 0.6 is the usual choice)")
        data["length_penalty"] = length_penalty
    return data


def evaluate_run(run_dir: str | Path, comm: Communicator, *, data_dir: str | None = None,
                 beam_size: int | None = None,
                 length_penalty: float | None = None) -> dict[str, Any]:
    """Evaluate the model of ``run_dir``'s checkpoint; collective over ``comm``.

    ``data_dir`` overrides the run's data directory (None: the one it was trained with).
    Returns ``{"run": str, "experiment": str, "epoch": int, "global_step": int, "decoding": str
    | None, <metric name>: float, ...}`` with the task's metrics (e.g. ``test_accuracy`` as a
    fraction, ``test_perplexity``, ``test_bleu`` in BLEU points), the same on every rank.

    Raises ConfigError when ``run_dir`` has no ``config.json`` or no ``checkpoint.pt`` (yet) or
    an override is invalid, CheckpointError when no checkpoint generation is readable (a damaged
    newest one is skipped with a warning, as ``--resume`` does), DataError when
    the data is missing or unreadable.
    """
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path}: not found; point RUN_DIR at a directory written by "
                          f"`hpclb train --out RUN_DIR`")
    try:
        run = read_json(config_path, "the config.json files of `hpclb train`")
        recipe = dict(run["recipe"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{e}" if isinstance(e, ValueError) else f"{config_path}: not a "
                          f"config.json of `hpclb train` ({e!r}); point RUN_DIR at a directory "
                          f"written by `hpclb train --out RUN_DIR`") from None
    recipe["data"] = _decoding_overrides(recipe, beam_size, length_penalty)
    # the newest generation that verifies, as --resume reads it (a damaged newer one is skipped
    # with a warning); CheckpointError when none is usable, None when there is none
    store = CheckpointStore(run_dir)
    loaded = store.latest()
    if loaded is None:
        raise ConfigError(f"{store.latest_path}: not found; the run has not saved a checkpoint "
                          f"yet (it saves one at each epoch end, and mid-epoch with "
                          f"--checkpoint-interval): evaluate it after its first epoch, or point "
                          f"RUN_DIR at another run")
    ckpt = loaded.state
    data = recipe["data"]
    task = build_task(recipe, data_dir if data_dir is not None else run["data_dir"],
                      train_samples=data.get("train_samples"),
                      test_samples=data.get("test_samples"))
    model = build_model(recipe["model"]["name"], **task.model_kwargs,
                        **{k: v for k, v in recipe["model"].items() if k != "name"})
    model.load_state_dict(ckpt["model"])
    with torch.no_grad():  # evaluation reads only the test/valid data: no training set-up
        metrics = task.evaluate(model, comm)
    return {"run": str(run_dir), "experiment": run["experiment"], "epoch": int(ckpt["epoch"]),
            "global_step": int(ckpt["global_step"]),
            "decoding": getattr(task, "decoding", None), **metrics}
