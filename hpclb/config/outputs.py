"""Where commands write, and the one check that nothing is overwritten without asking.

A run directory is named by its experiment, scaling scheme and global batch
(``runs/<experiment>/<scheme>-b<B>``, as ``hpclb sweep`` names its points), so runs of one recipe
at different batches or schemes never share a directory. A directory that already holds a run
(:data:`RUN_FILES`) is refused unless the command is told what to do with it: ``--resume``
(continue it) or ``--overwrite`` (delete its run files and start afresh). An output file
(``hpclb scale``'s recipe and job script, ``hpclb plot``'s PNG) that exists is refused unless
``--overwrite``. Every refusal is a :class:`~hpclb.errors.ConfigError` (exit 2) naming the flags.

hpclb deletes only what it wrote. A run records the entries of :data:`RUN_FILES` it writes in
the directory's marker, :data:`RUN_MARKER` (JSON, rewritten atomically; written before any of
them: :func:`start_run`, :func:`mark_run`); inside its directories (``checkpoints/``, ``tb/``,
``profile/``) hpclb's own file names (:func:`foreign_files`) tell its files from others. A
directory without a marker (a run of hpclb before the marker) is hpclb's when its
``config.json`` is one hpclb wrote and every other run entry has hpclb's names. A run entry that
is not hpclb's (another tool's ``config.json``, ``checkpoints/epoch=9-step=1000.ckpt``, ``tb/``
logs) is never called a run, never deleted or replaced: every command refuses that directory,
naming those files (:func:`refuse_foreign`). Files that are not run entries (``notes.txt``) are
never touched.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from hpclb._io import file_in_the_way, write_json
from hpclb.errors import ConfigError

__all__ = ["ALWAYS_WRITTEN", "RUN_FILES", "RUN_KEPT", "RUN_MARKER", "check_output_file",
           "check_run_dir",
           "clear_run", "default_run_dir", "foreign_files", "mark_run", "point_name",
           "refuse_foreign", "run_files", "start_run"]

#: what every ``hpclb train`` writes into its run directory (``checkpoints/``: the generations),
#: claimed in the marker when the run starts
ALWAYS_WRITTEN = ("summary.json", "metrics.jsonl", "config.json", "checkpoint.pt",
                  "checkpoint.pt.sha256", "checkpoints")
#: every entry a run may write (``tb/``: TensorBoard events, ``profile/``: ``--profile`` traces,
#: each claimed when it is created); any of them present means the directory holds a run
RUN_FILES = ALWAYS_WRITTEN + ("tb", "profile")
#: the marker of a run directory: the entries of RUN_FILES hpclb wrote there
RUN_MARKER = ".hpclb-run"
#: what is still valid when a write into a run directory finds the disk full (DiskFull)
RUN_KEPT = ("the run's other files are whole and its last checkpoint, if any, is valid: "
            "--resume continues from it")

# hpclb's names inside its directories (a checkpoint's temporary file: ".<name>.tmp<pid>")
_INSIDE = {
    "checkpoints": re.compile(r"gen-\d{6,}(?:-step-\d+)?\.pt(?:\.sha256)?"
                              r"|\.gen-\d{6,}(?:-step-\d+)?\.pt(?:\.sha256)?\.tmp\d+"),
    "tb": re.compile(r"events\.out\.tfevents\.[^/]+"),
    "profile": re.compile(r"rank\d+"),  # one directory per rank, of traces
}
_TRACE = re.compile(r"[^/]+\.pt\.trace\.json(?:\.gz)?")
# keys every config.json / summary.json of hpclb train holds (a run of an earlier version)
_JSON_KEYS = {"config.json": {"experiment", "recipe", "global_batch_size", "scaling"},
              "summary.json": {"experiment", "global_batch_size", "scaling"}}
_SHOWN = 8  # foreign files named in a refusal


def point_name(scheme: str, batch: int) -> str:
    """``<scheme>-b<B>``: the directory name of the run of one (scheme, global batch)."""
    return f"{scheme}-b{batch}"


def default_run_dir(experiment: str, scheme: str, batch: int, root: str = "runs") -> str:
    """``<root>/<experiment>/<scheme>-b<B>``: ``hpclb train``'s default ``--out``."""
    return f"{root}/{experiment}/{point_name(scheme, batch)}"


def run_files(out: str | Path) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``out`` (empty when it holds no run)."""
    out = Path(out)
    return [name for name in RUN_FILES if _exists(out / name)] if out.is_dir() else []


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _claimed(out: Path) -> set[str] | None:
    """The entries ``out``'s marker says hpclb wrote; None without a (readable) marker."""
    try:
        written = json.loads((out / RUN_MARKER).read_text())["written"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {w for w in written if w in RUN_FILES} if isinstance(written, list) else None


def mark_run(out: str | Path, *names: str) -> None:
    """Record in ``out``'s :data:`RUN_MARKER` that hpclb writes the entries ``names`` (of
    :data:`RUN_FILES`) there; call it before writing them. Creates ``out`` and the marker; the
    marker is rewritten (atomically) only when a name is new. OSError propagates."""
    out = Path(out)
    claimed = _claimed(out)
    if claimed is not None and claimed.issuperset(names):
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / RUN_MARKER, {
        "about": "hpclb's run directory: the entries hpclb wrote here, the only ones "
                 "`hpclb train --overwrite` deletes",
        "written": sorted((claimed or set()) | set(names))}, RUN_KEPT)


def start_run(out: str | Path) -> None:
    """Mark ``out`` as the directory of a run starting now (rank 0, after
    :func:`check_run_dir`): it claims :data:`ALWAYS_WRITTEN` and the run entries already there
    (checked to be hpclb's: a resumed run, perhaps of an earlier version without a marker)."""
    mark_run(out, *ALWAYS_WRITTEN, *run_files(out))


def _listing(out: Path, name: str) -> list[str]:
    """``name`` (a file) or the entries of directory ``name`` (``tb/x``, ``tb/sub/``)."""
    path = out / name
    if not path.is_dir() or path.is_symlink():
        return [name]
    return [f"{name}/{p.name}" + ("/" if p.is_dir() else "") for p in sorted(path.iterdir())] \
        or [f"{name}/"]


def _foreign_inside(out: Path, name: str) -> list[str]:
    """The entries of hpclb's directory ``out/name`` that do not have hpclb's names."""
    path = out / name
    if not path.is_dir() or path.is_symlink():
        return [name]  # a file where hpclb makes a directory
    found = []
    for p in sorted(path.iterdir()):
        rel = f"{name}/{p.name}"
        if not _INSIDE[name].fullmatch(p.name) or p.is_dir() != (name == "profile"):
            found.append(rel + ("/" if p.is_dir() else ""))
        elif p.is_dir():
            found += [f"{rel}/{f.name}" for f in sorted(p.iterdir())
                      if not (f.is_file() and _TRACE.fullmatch(f.name))]
    return found


def _hpclb_json(path: Path) -> bool:
    """Whether ``path`` (config.json, summary.json, metrics.jsonl) reads as hpclb's."""
    try:
        with open(path, errors="replace") as f:
            text = f.readline() if path.suffix == ".jsonl" else f.read()
        if path.suffix == ".jsonl" and not text.strip():
            return True
        row = json.loads(text)
    except (OSError, ValueError):
        return False
    if not isinstance(row, dict):
        return False
    if path.suffix == ".jsonl":  # a step or epoch line (epoch lines of old runs have no kind)
        return "kind" in row or "epoch" in row
    return _JSON_KEYS[path.name].issubset(row)


def foreign_files(out: str | Path) -> list[str]:
    """The run entries in ``out`` hpclb did not write (paths relative to ``out``; a foreign
    directory inside one of hpclb's ends with ``/``): an entry the marker does not claim, a
    file in ``checkpoints/``, ``tb/`` or ``profile/`` without hpclb's name; in a directory
    without a marker every run entry unless its ``config.json`` is hpclb's (then: those
    without hpclb's names or content). Empty when every run entry there is hpclb's."""
    out = Path(out)
    present = run_files(out)
    claimed = _claimed(out) if present else None
    if present and claimed is None and not _hpclb_json(out / "config.json"):
        return [f for name in present for f in _listing(out, name)]
    found = []
    for name in present:
        if claimed is not None and name not in claimed:
            found += _listing(out, name)
        elif name in _INSIDE:
            found += _foreign_inside(out, name)
        elif claimed is None and name.endswith((".json", ".jsonl")) and not \
                _hpclb_json(out / name):
            found.append(name)
    return found


def refuse_foreign(out: str | Path, flag: str = "--out") -> None:
    """Raise ConfigError naming the files of :func:`foreign_files` (when there are any) and
    the fix: another ``flag``, or moving them out."""
    found = foreign_files(out)
    if found:
        shown = ", ".join(found[:_SHOWN]) + (f" and {len(found) - _SHOWN} more"
                                             if len(found) > _SHOWN else "")
        what = ("checkpoints with no run's config.json beside them (as hpclb.Checkpointer "
                "writes for a library loop: hpclb train resumes only the runs it started)"
                if _only_checkpoints(found) else "files hpclb did not write")
        raise ConfigError(f"{flag} {out} holds {what} where a run writes its own ({shown}); "
                          f"hpclb never deletes or replaces them, not even with --overwrite: "
                          f"choose another {flag}, or move them out of {out}")


def _only_checkpoints(found: list[str]) -> bool:
    """Whether the foreign entries ``found`` all have a checkpoint's names (a directory of a
    library loop's :class:`hpclb.Checkpointer`)."""
    return all(f in ("checkpoint.pt", "checkpoint.pt.sha256") or
               (f.startswith("checkpoints/") and
                _INSIDE["checkpoints"].fullmatch(f[len("checkpoints/"):])) for f in found)


def check_run_dir(out: str | Path, *, resume: bool, overwrite: bool, flag: str = "--out",
                  resumable: bool = True) -> list[str]:
    """Check that a run may write into ``out``; returns the run files already there.

    Raises ConfigError (naming ``flag``) when ``out`` exists but is not a directory, when both
    ``resume`` and ``overwrite`` are asked, when ``out`` holds run entries hpclb did not write
    (:func:`refuse_foreign`, whatever the flags), or when ``out`` holds a run
    (:func:`run_files`) and neither flag is given: the message names ``--resume`` (unless not
    ``resumable``) and ``--overwrite``.
    """
    out = Path(out)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: choose one (--resume continues the run in "
                          f"{flag} {out}, --overwrite deletes it and starts afresh)")
    blocker = out if out.exists() and not out.is_dir() else file_in_the_way(out)
    if blocker is not None:
        raise ConfigError(f"{flag} {out}: {blocker} is a file, not a directory; a run directory "
                          f"is a folder (choose another {flag})")
    refuse_foreign(out, flag)
    found = run_files(out)
    if found and not (resume or overwrite):
        state = "a finished run" if "summary.json" in found else "an unfinished run"
        checkpointed = any(f.startswith("checkpoint") for f in found)
        if not checkpointed and "summary.json" not in found:  # stopped before its first one
            state += " without a checkpoint"
        if not (resumable and checkpointed):
            resume_it = "add "
        elif "summary.json" in found:  # --resume trains nothing more
            resume_it = "add --resume to keep it (reported, nothing trained), "
        else:
            resume_it = "add --resume to continue it, "
        raise ConfigError(f"{flag} {out} already holds {state}; {resume_it}--overwrite to "
                          f"delete it ({', '.join(found)}) and start afresh, or choose another "
                          f"{flag}")
    return found


def clear_run(out: str | Path, flag: str = "--out") -> None:
    """Delete the run in ``out``: the run entries hpclb wrote (:data:`RUN_FILES`), then the
    marker; every other file there is kept. Raises ConfigError, deleting nothing, when a run
    entry is not hpclb's (:func:`refuse_foreign`)."""
    out = Path(out)
    refuse_foreign(out, flag)
    for name in run_files(out):
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    (out / RUN_MARKER).unlink(missing_ok=True)


def check_output_file(path: str | Path, *, overwrite: bool, flag: str = "--out") -> Path:
    """``path`` as a Path, when a command may write the file there. Raises ConfigError (naming
    ``flag``) when it is a directory, or exists and ``overwrite`` is False (the message names
    ``--overwrite``), or when a folder of the path is a file."""
    path = Path(path)
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise ConfigError(f"{flag} {path}: {blocker} is a file, not a directory, so nothing can "
                          f"be written under it; choose another {flag}")
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    if path.exists() and not overwrite:
        raise ConfigError(f"{flag} {path}: the file exists; add --overwrite to replace it, or "
                          f"choose another {flag}")
    return path
