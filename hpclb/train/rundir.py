"""Which run directory, locked; resume or start, agreed by all ranks.

:func:`check_out` refuses a ``--out`` that may not be written before any rank loads data;
:func:`decide` then has rank 0 lock the run directory (``.hpclb.lock``, for the whole run),
decide to resume (which checkpoint, checked against the run's settings by
:func:`check_resumable`) or to start afresh (``--overwrite``: the old run deleted), and
broadcasts the decision; every rank loads the checkpoint. Both run inside
:func:`~hpclb.train.agreed.agreed`: a refusal on rank 0 ends every rank with its message, never
a hang. :class:`Decision` is what :mod:`hpclb.train.setup` builds the run from.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpclb.comm.base import Communicator
from hpclb.config import RunConfig
from hpclb.config.outputs import RUN_MARKER, check_run_dir, clear_run, run_files, start_run
from hpclb.errors import CheckpointError, ConfigError
from hpclb.train.agreed import agreed
from hpclb.train.checkpoint import CheckpointStore

__all__ = ["LOCK_NAME", "MODEL_FIELDS", "Decision", "check_out", "check_resumable", "decide"]

log = logging.getLogger(__name__)
LOCK_NAME = ".hpclb.lock"


@dataclass
class Decision:
    """The run's start, the same on every rank: ``checkpoint`` (the loaded state to resume
    from, or None: start afresh), its ``path`` (rank 0's, resolved), and ``lock`` (rank 0's open
    lock file on the run directory; None on the other ranks)."""

    checkpoint: dict | None
    path: str | None
    lock: Any = None

    def abandon(self, out: Path) -> None:
        """After a start-up that failed once the run directory ``out`` was taken: release the
        lock, and remove what the start left there (:func:`_forget_empty_start`)."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None
            _forget_empty_start(out)


def check_out(cfg: RunConfig, comm: Communicator) -> None:
    """Refuse (ConfigError on every rank, rank 0's verdict) a ``--out`` that this run may not
    write (:func:`hpclb.config.outputs.check_run_dir`); collective."""
    agreed(comm, "checking --out", lambda: check_run_dir(
        cfg.out, resume=bool(cfg.resume), overwrite=cfg.overwrite) if comm.rank == 0 else None)


def decide(cfg: RunConfig, comm: Communicator, store: CheckpointStore) -> Decision:
    """Rank 0 locks the run directory and decides (start afresh; else the checkpoint's path;
    ``--resume auto``: the newest checkpoint that verifies, else afresh); every rank loads it
    (the decision is broadcast); collective. Raises ConfigError (every rank) where rank 0
    refuses (another run holds the lock, no checkpoint to resume, other settings) or a rank
    cannot read rank 0's checkpoint; a failure releases the lock."""
    lock = []

    def decide_on_rank0():
        found = check_run_dir(store.out_dir, resume=bool(cfg.resume), overwrite=cfg.overwrite)
        lock.append(_lock_out(store.out_dir))
        path = _resume_path(cfg, store, found) if cfg.resume else None
        if found and not cfg.resume:  # --overwrite: no stale summary, metrics or checkpoint
            log.warning("--overwrite: deleting the run in %s (%s)", store.out_dir,
                        ", ".join(found))
            clear_run(store.out_dir)  # hpclb's files only
        start_run(store.out_dir)  # the marker: what this run writes is hpclb's
        return path
    try:
        path = agreed(comm, "checking --out and the checkpoint",
                      lambda: decide_on_rank0() if comm.rank == 0 else None)
        return _load_decided(comm, path, lock[0] if lock else None)
    except BaseException:
        if lock:
            lock[0].close()  # a failed start-up leaves the run directory free
        raise


def _lock_out(out: Path):
    """Rank 0's exclusive lock on the run directory for the whole run (``flock`` on
    ``.hpclb.lock``; released by the kernel when the process ends, even killed). Raises
    ConfigError when another run holds it; on a file system without locks, warns and goes on."""
    import fcntl

    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / LOCK_NAME, "a+")
    except OSError as e:  # not a directory, no permission, read-only file system
        raise ConfigError(f"--out {out}: cannot create the run directory or its lock ({e}); "
                          f"choose another --out") from e
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"--out {out}: another hpclb train ({holder}) is writing to this run "
                          f"directory; wait for it, or choose another --out") from None
    except OSError as e:  # e.g. a network file system mounted without locks
        log.warning("--out %s: cannot lock the run directory (%s); make sure no other run "
                    "writes to it", out, e)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def _resume_path(cfg: RunConfig, store: CheckpointStore, found: list[str]) -> str | None:
    """Rank 0's ``--resume`` decision: the checkpoint's path (checked against ``cfg``), or None
    (``--resume auto`` without one: start afresh)."""
    loaded = store.latest()
    if loaded is None and cfg.resume == "auto":
        return _start_afresh(store.out_dir, found)
    if loaded is None:  # a usage error, the same for every rank: exit 2
        raise ConfigError(f"--resume: no checkpoint to resume from in {store.out_dir}; "
                          f"drop --resume to start afresh (add --overwrite if the "
                          f"directory holds a run), or use --resume auto")
    for path, why in loaded.skipped:
        log.warning("--resume: skipped damaged checkpoint %s (%s); using %s", path, why,
                    loaded.path)
    check_resumable(cfg, loaded.state, loaded.path.resolve())  # before anything is written
    return str(loaded.path.resolve())


def _start_afresh(out: Path, found: list[str]) -> None:
    """``--resume auto`` without a checkpoint in ``out`` (rank 0): start afresh. The logs of a
    run stopped before its first checkpoint are replaced; a finished run (``summary.json``)
    whose checkpoints are gone is refused (ConfigError naming --overwrite), never deleted."""
    if "summary.json" in found:
        raise ConfigError(f"--resume auto: {out} holds a finished run without a checkpoint; "
                          f"add --overwrite (instead of --resume) to delete it ({', '.join(found)})"
                          f" and start afresh, or choose another --out")
    if found:
        log.warning("--resume auto: no checkpoint in %s, only the logs of a run stopped before "
                    "its first one (%s); starting afresh from step 0", out, ", ".join(found))
        clear_run(out)
    else:
        log.info("--resume auto: no checkpoint in %s; starting afresh", out)
    return None


def _load_decided(comm: Communicator, path: str | None, held) -> Decision:
    """Every rank's side of rank 0's decision ``path``: broadcast it, load the checkpoint."""
    if comm.world_size > 1:
        path = comm.broadcast_object(path, 0)
    if path is None:
        return Decision(None, None, held)

    def load():
        from hpclb.train.checkpoint import load_checkpoint
        try:
            return load_checkpoint(path)
        except (CheckpointError, OSError) as e:
            raise ConfigError(f"cannot read rank 0's checkpoint {path} ({e}); --out must be on "
                              f"a file system every rank sees") from e
    return Decision(agreed(comm, "loading the checkpoint", load), path, held)


def _forget_empty_start(out: Path) -> None:
    """After a start-up that failed before the run wrote anything: remove the lock and the
    marker it left, and the directory when that leaves it empty (no ``--out`` holding only
    ``.hpclb.lock``). A directory that holds a run's files keeps them all; other files stay."""
    try:
        if not run_files(out):
            for name in (LOCK_NAME, RUN_MARKER):
                (out / name).unlink(missing_ok=True)
            if not any(out.iterdir()):
                out.rmdir()
    except OSError:
        pass  # best effort: the start-up error is what the user needs to see


#: the recipe fields that fix the model's parameters (a checkpoint of others cannot be loaded)
MODEL_FIELDS = ("model", "task", "data.name")


def check_resumable(cfg: RunConfig, ckpt: dict, path) -> None:
    """Refuse (ConfigError) to resume ``cfg`` from the checkpoint ``ckpt`` read from ``path``
    where it was made with other settings (experiment, batch, scaling, optimizer, seed...) or
    another model: a recipe field of :data:`MODEL_FIELDS` (``model.hidden_size``...) other than
    the run's ``config.json`` in ``cfg.out`` records, named with both values, or a
    checkpoint without run settings (written by a library loop's ``hpclb.Checkpointer``)."""
    if not isinstance(ckpt.get("run"), dict):
        raise ConfigError(f"--resume: the checkpoint in {path} was written by a library loop "
                          f"(hpclb.Checkpointer), not by hpclb train: it holds no run settings "
                          f"(experiment, batch, scaling, optimizer, seed) to continue; resume it "
                          f"with that script's hpclb.Checkpointer, or use another --out")
    for key in ("experiment", "global_batch_size", "scaling", "optimizer", "seed", "epochs", "lr"):
        if ckpt["run"][key] != getattr(cfg, key):
            raise ConfigError(f"--resume: the checkpoint in {path} was made with {key}="
                              f"{ckpt['run'][key]!r}, this run has {getattr(cfg, key)!r}; resume "
                              f"with the same settings or use another --out")
    try:  # every start writes config.json after this check: its recipe is the checkpoint's
        saved = json.loads((Path(cfg.out) / "config.json").read_text())["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record: the parameters' shapes are checked when the checkpoint is loaded
    then, now = _model_fields(saved), _model_fields(json.loads(json.dumps(cfg.recipe)))
    for key in sorted(then.keys() | now.keys()):
        if then.get(key, _ABSENT) != now.get(key, _ABSENT):
            raise ConfigError(f"--resume: {key}: {_show(then.get(key, _ABSENT))} in the "
                              f"checkpoint's run, {_show(now.get(key, _ABSENT))} now (recipe "
                              f"{cfg.experiment}); the checkpoint in {path} holds another model: "
                              f"resume with the recipe it was made with, or use another --out")


_ABSENT = object()


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)


def _model_fields(recipe: dict) -> dict[str, Any]:
    """The :data:`MODEL_FIELDS` of ``recipe``, sections flattened to ``model.<field>``."""
    fields = {}
    for name in MODEL_FIELDS:
        section, _, key = name.partition(".")
        value = recipe.get(section)
        if key:
            value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
        if isinstance(value, dict):
            fields.update({f"{name}.{k}": v for k, v in value.items()})
        elif value is not _ABSENT:
            fields[name] = value
    return fields
