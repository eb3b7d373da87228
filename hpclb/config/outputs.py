"""Where commands write, and the one check that nothing is overwritten without asking.

A run directory is named by its experiment, scaling scheme and global batch
(``runs/<experiment>/<scheme>-b<B>``, as ``hpclb sweep`` names its points), so runs of one recipe
at different batches or schemes never share a directory. A directory that already holds a run
(:data:`RUN_FILES`) is refused unless the command is told what to do with it: ``--resume``
(continue it) or ``--overwrite`` (delete its run files and start afresh). An output file
(``hpclb scale``'s recipe and job script, ``hpclb plot``'s PNG) that exists is refused unless
``--overwrite``. Every refusal is a :class:`~hpclb.errors.ConfigError` (exit 2) naming the flags.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from hpclb.errors import ConfigError

__all__ = ["RUN_FILES", "check_output_file", "check_run_dir", "clear_run", "default_run_dir",
           "point_name", "run_files"]

#: what ``hpclb train`` writes into a run directory (``checkpoints/``: the generations;
#: ``tb/``: TensorBoard events); any of them present means the directory holds a run
RUN_FILES = ("summary.json", "metrics.jsonl", "config.json", "checkpoint.pt",
             "checkpoint.pt.sha256", "checkpoints", "tb")


def point_name(scheme: str, batch: int) -> str:
    """``<scheme>-b<B>``: the directory name of the run of one (scheme, global batch)."""
    return f"{scheme}-b{batch}"


def default_run_dir(experiment: str, scheme: str, batch: int, root: str = "runs") -> str:
    """``<root>/<experiment>/<scheme>-b<B>``: ``hpclb train``'s default ``--out``."""
    return f"{root}/{experiment}/{point_name(scheme, batch)}"


def run_files(out: str | Path) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``out`` (empty when it holds no run)."""
    out = Path(out)
    return [name for name in RUN_FILES if (out / name).exists()] if out.is_dir() else []


def check_run_dir(out: str | Path, *, resume: bool, overwrite: bool, flag: str = "--out",
                  resumable: bool = True) -> list[str]:
    """Check that a run may write into ``out``; returns the run files already there.

    Raises ConfigError (naming ``flag``) when ``out`` exists but is not a directory, when both
    ``resume`` and ``overwrite`` are asked, or when ``out`` holds a run (:func:`run_files`) and
    neither is: the message names ``--resume`` (unless not ``resumable``) and ``--overwrite``.
    """
    out = Path(out)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: choose one (--resume continues the run in "
                          f"{flag} {out}, --overwrite deletes it and starts afresh)")
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(f"{flag} {out}: {blocker} is a file, not a directory; a run directory "
                          f"is a folder (choose another {flag})")
    found = run_files(out)
    if found and not (resume or overwrite):
        state = "a finished run" if "summary.json" in found else "an unfinished run"
        checkpointed = any(f.startswith("checkpoint") for f in found)
        if not checkpointed and "summary.json" not in found:  # stopped before its first one
            state += " without a checkpoint"
        resume_it = "add --resume to continue it, " if resumable and checkpointed else "add "
        raise ConfigError(f"{flag} {out} already holds {state}; {resume_it}--overwrite to "
                          f"delete it ({', '.join(found)}) and start afresh, or choose another "
                          f"{flag}")
    return found


def clear_run(out: str | Path) -> None:
    """Delete the run files (:data:`RUN_FILES`) in ``out``; other files there are kept."""
    for name in RUN_FILES:
        path = Path(out) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def check_output_file(path: str | Path, *, overwrite: bool, flag: str = "--out") -> Path:
    """``path`` as a Path, when a command may write the file there. Raises ConfigError (naming
    ``flag``) when it is a directory, or exists and ``overwrite`` is False (the message names
    ``--overwrite``)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    if path.exists() and not overwrite:
        raise ConfigError(f"{flag} {path}: the file exists; add --overwrite to replace it, or "
                          f"choose another {flag}")
    return path
