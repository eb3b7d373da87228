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

import dataclasses
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpclb.comm.base import Communicator
from hpclb.config import RunConfig
from hpclb.config.agreement import FINGERPRINT_PARTS, _canonical, config_settings
from hpclb.config.fields import SETTINGS, SYNC_SETTINGS
from hpclb.config.outputs import RUN_MARKER, check_run_dir, clear_run, run_files, start_run
from hpclb.errors import CheckpointError, ConfigError, RunFinished
from hpclb.tasks.spec import show_metric
from hpclb.train.agreed import agreed
from hpclb.train.checkpoint import CheckpointStore

__all__ = ["LOCK_NAME", "MAY_CHANGE", "MODEL_FIELDS", "Decision", "check_out", "check_resumable",
           "decide", "fingerprint_changes"]

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


def decide(cfg: RunConfig, comm: Communicator, store: CheckpointStore,
           fingerprint: dict | None = None) -> Decision:
    """Rank 0 locks the run directory and decides (start afresh; else the checkpoint's path;
    ``--resume auto``: the newest checkpoint that verifies, else afresh); every rank loads it
    (the decision is broadcast); collective. Raises ConfigError (every rank) where rank 0
    refuses (another run holds the lock, no checkpoint to resume, other settings, other code
    or data than ``fingerprint``: :func:`check_resumable`) or a rank cannot read rank 0's
    checkpoint; a failure releases the lock."""
    lock = []

    def decide_on_rank0():
        found = check_run_dir(store.out_dir, resume=bool(cfg.resume), overwrite=cfg.overwrite)
        lock.append(_lock_out(store.out_dir))
        path = _resume_path(cfg, store, found, fingerprint) if cfg.resume else None
        if path is not None and "summary.json" in found:  # nothing left to train
            start_run(store.out_dir)  # a run of an earlier version: marked, nothing else
            return RunFinished(_finished(store.out_dir, path))
        if found and not cfg.resume:  # --overwrite: no stale summary, metrics or checkpoint
            log.warning("--overwrite: deleting the run in %s (%s)", store.out_dir,
                        ", ".join(found))
            clear_run(store.out_dir)  # hpclb's files only
        start_run(store.out_dir)  # the marker: what this run writes is hpclb's
        return path
    try:
        path = agreed(comm, "checking --out and the checkpoint",
                      lambda: decide_on_rank0() if comm.rank == 0 else None)
        if comm.world_size > 1:
            path = comm.broadcast_object(path, 0)
        if isinstance(path, RunFinished):
            raise path
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


def _resume_path(cfg: RunConfig, store: CheckpointStore, found: list[str],
                 fingerprint: dict | None) -> str | None:
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
    check_resumable(cfg, loaded.state, loaded.path.resolve(), fingerprint)  # before any write
    return str(loaded.path.resolve())


def _finished(out: Path, path: str) -> str:
    """What ``--resume`` of the finished run in ``out`` says: its recorded summary."""
    try:
        s = json.loads((out / "summary.json").read_text())
        metric = s.get("metric_name")  # None: a task with no metric (a plug-in's loss only)
        result = (f"{metric} {show_metric(metric, s['final_' + metric]).strip()} " if metric
                  else "")
        shown = (f"{s['experiment']} {s['scaling']} global batch {s['global_batch_size']} on "
                 f"{s['world_size']} rank(s): {result}after {s['steps']} steps")
    except (OSError, ValueError, KeyError, TypeError) as e:
        shown = f"its summary.json cannot be read ({e})"
    return (f"--resume: {out} holds a finished run ({shown}; checkpoint {path}): nothing left to "
            f"train, its files are left as they are -> {out / 'summary.json'}; to train "
            f"further, start a new run with another --out")


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
    """Every rank's side of rank 0's decision ``path`` (broadcast): load the checkpoint."""
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
#: what ``--resume`` may change (docs/cli.md), beside the locations (``--out``, ``--data-dir``,
#: the recipe's ``plugin_path``) and the world size: how the run executes, observes and keeps
#: checkpoints, none of which moves its trajectory beyond rounding. The recipe's copies of
#: resolved settings (its run settings, ``sync:``, ``epochs``, ``optimizers``) are compared as
#: the resolved ones (``epochs``, ``optimizer_params``, ``sync.compression``...).
MAY_CHANGE = ("resume", "resume_changed", "overwrite", "accumulation_steps", "device", "compile",
              "log_every", "noise_scale", "max_nonfinite_steps", "keep_checkpoints",
              *(f"sync.{k}" for k in SYNC_SETTINGS if k != "compression"),
              *(f"recipe.{k}" for k in (*SETTINGS, "sync", "epochs", "optimizers")))


def check_resumable(cfg: RunConfig, ckpt: dict, path, fingerprint: dict | None = None) -> None:
    """Refuse (ConfigError) to resume ``cfg`` from the checkpoint ``ckpt`` read from ``path``
    where it was made with another model (a recipe field of :data:`MODEL_FIELDS`, e.g.
    ``model.hidden_size``, named with both values) or other settings (every setting of
    :func:`~hpclb.config.agreement.config_settings` but :data:`MAY_CHANGE`: the experiment,
    batch, scaling, optimizer and its hyper-parameters, LR, epochs, seed, precision, every
    recipe field such as ``warmup_epochs`` or ``decay``; each named with both values), or a
    checkpoint without run settings (written by a library loop's ``hpclb.Checkpointer``). The
    run's recipe is the checkpoint's; one written before checkpoints held it: ``config.json``'s
    in ``cfg.out``, else only the other settings are compared. ``fingerprint``: this run's code
    and data (:func:`~hpclb.config.agreement.run_fingerprint`), compared with the checkpoint's
    (:func:`_check_fingerprint`); None: not compared."""
    if not isinstance(ckpt.get("run"), dict):
        raise ConfigError(f"--resume: the checkpoint in {path} was written by a library loop "
                          f"(hpclb.Checkpointer), not by hpclb train: it holds no run settings "
                          f"(experiment, batch, scaling, optimizer, seed) to continue; resume it "
                          f"with that script's hpclb.Checkpointer, or use another --out")
    names = {f.name for f in dataclasses.fields(cfg)}
    recorded = {k: v for k, v in ckpt["run"].items() if k in names}
    recorded.setdefault("recipe", _config_json_recipe(cfg.out, cfg.recipe))
    now = json.loads(json.dumps(cfg.recipe))
    then, now = _model_fields(recorded["recipe"]), _model_fields(now)
    for key in sorted(then.keys() | now.keys()):
        if then.get(key, _ABSENT) != now.get(key, _ABSENT):
            raise ConfigError(f"--resume: {key}: {_show(then.get(key, _ABSENT))} in the "
                              f"checkpoint's run, {_show(now.get(key, _ABSENT))} now (recipe "
                              f"{cfg.experiment}); the checkpoint in {path} holds another model: "
                              f"resume with the recipe it was made with, or use another --out")
    before = _canonical(config_settings(dataclasses.replace(cfg, **recorded), MAY_CHANGE))
    after = _canonical(config_settings(cfg, MAY_CHANGE))
    differ = [f"{name}: {before.get(name, 'absent')} there, {after.get(name, 'absent')} now"
              for name in [*before, *sorted(after.keys() - before.keys())]
              if before.get(name) != after.get(name)]
    if differ:
        raise ConfigError(f"--resume: the checkpoint in {path} was made with other settings than "
                          f"this run's, {len(differ)} differ: {'; '.join(differ)}; resume with "
                          f"the recipe and flags the run was started with (its config.json "
                          f"records them), or start a new run with another --out")
    if fingerprint is not None:
        _check_fingerprint(cfg, ckpt["run"].get("fingerprint"), fingerprint, path)


def fingerprint_changes(then: dict | None, now: dict) -> dict[str, list[str]]:
    """What differs between two run fingerprints (``then`` the checkpoint's, ``now`` this
    run's): part (``code``, ``data``) -> each module or file with both digests."""
    changes = {}
    for part, what in FINGERPRINT_PARTS.items():
        a, b = (then or {}).get(part, {}), now.get(part, {})
        differ = [f"{what} {name}: {a.get(name, 'absent')} in the checkpoint's run, "
                  f"{b.get(name, 'absent')} now" for name in sorted(a.keys() | b.keys())
                  if a.get(name) != b.get(name)]
        if differ:
            changes[part] = differ
    return changes


def _check_fingerprint(cfg: RunConfig, then: dict | None, now: dict, path) -> None:
    """ConfigError naming each plug-in module and data file whose content differs from the
    checkpoint's run (``then``), unless ``--resume-changed`` names its part: then a warning."""
    if then is None:
        log.warning("--resume: the checkpoint in %s records no code and data fingerprint (an "
                    "earlier hpclb wrote it): the plug-in modules and data files are not "
                    "compared with its run", path)
        return
    changes = fingerprint_changes(then, now)
    refused = [part for part in changes if part not in cfg.resume_changed]
    if refused:
        raise ConfigError(
            f"--resume: the checkpoint in {path} was made with other {' and '.join(refused)}: "
            f"{'; '.join(d for part in refused for d in changes[part])}; restore the files the "
            f"run was made with (config.json's fingerprint records them), or add "
            f"--resume-changed {','.join(refused)} to continue with these on purpose (recorded "
            f"in config.json), or start a new run with another --out")
    for part, differ in changes.items():
        log.warning("--resume-changed %s: continuing the run in %s with changed %s: %s "
                    "(recorded in config.json)", part, cfg.out, part, "; ".join(differ))


def _config_json_recipe(out: str, default: dict) -> dict:
    """The recipe the run in ``out`` records in its ``config.json`` (``default`` without one)."""
    try:
        recipe = json.loads((Path(out) / "config.json").read_text())["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return default
    return recipe if isinstance(recipe, dict) else default


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
