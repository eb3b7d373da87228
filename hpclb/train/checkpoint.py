"""Atomic, verified, resumable checkpoints, and generations of them.

A checkpoint is written to a temporary file in the same directory while its SHA-256 is computed,
flushed to disk (fsync), and renamed over the old one, so a crash or kill mid-write leaves the
previous checkpoint intact. The digest goes to a sidecar ``<name>.sha256`` in ``sha256sum``
format (``sha256sum -c checkpoint.pt.sha256`` checks it by hand); loading verifies it, so a
truncated or damaged file is detected instead of half-read. Resuming restores model, optimizer,
scheduler step, RNG state and the position in the epoch, so the run continues bit-for-bit the
same trajectory as an uninterrupted one (same seed and world size).

:class:`CheckpointStore` keeps the last ``keep`` *generations* under ``out/checkpoints/`` and
``out/checkpoint.pt`` as the newest (a hard link to it, a copy where links are not supported);
:meth:`CheckpointStore.latest` falls back to an older generation, with a warning, when the
newest is damaged, and a full disk during a write leaves the previous generation valid.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpclb._io import fsync_dir, sha256_file, write_atomic
from hpclb.errors import DISK_FULL_ERRNOS, CheckpointError, DiskFull, disk_full_message

__all__ = ["SIDECAR_SUFFIX", "LATEST_NAME", "GENERATIONS_DIR", "sidecar_path",
           "save_checkpoint", "verify_checkpoint", "load_checkpoint", "Loaded", "CheckpointStore"]

log = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".sha256"
LATEST_NAME = "checkpoint.pt"
GENERATIONS_DIR = "checkpoints"
_GENERATION = re.compile(r"^gen-(\d{6,})(?:-step-(\d+))?\.pt$")
_DISK_FULL = DISK_FULL_ERRNOS


class _HashingWriter:
    """File-like wrapper that hashes (SHA-256) every byte written through it and remembers the
    first OSError of a write (torch.save's zip writer masks it with a RuntimeError on exit)."""

    def __init__(self, f):
        self._f, self.sha256, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def sidecar_path(path: str | Path) -> Path:
    """``<path>.sha256``: where the checksum of checkpoint ``path`` is kept."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _read_digests(path: Path) -> list[str]:
    """The SHA-256 digests (lower-case hex) listed in ``path``'s sidecar; [] if it has none."""
    side = sidecar_path(path)
    if not side.is_file():
        return []
    try:
        return [line.split()[0].lower() for line in side.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{side}: unreadable checksum file ({e})") from e


def _write_sidecar(path: Path, *digests: str) -> None:
    text = "".join(f"{d}  {path.name}\n" for d in digests).encode()
    write_atomic(sidecar_path(path), lambda f: f.write(text))


def _replace_verified(tmp: Path, path: Path, digest: str) -> None:
    """Rename ``tmp`` (whose SHA-256 is ``digest``) over ``path`` so that ``path`` verifies at
    every instant: the sidecar lists the old and the new digest during the rename."""
    old = [d for d in _read_digests(path) if d != digest][:1] if path.is_file() else []
    _write_sidecar(path, digest, *old)
    os.replace(tmp, path)
    if old:
        _write_sidecar(path, digest)


def _save_verified(path: Path, state: dict[str, Any]) -> str:
    """Write ``state`` to ``path`` with its sidecar, atomically; return the SHA-256 hex digest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            try:
                torch.save(state, writer)
            except Exception as e:
                if writer.error is not None and writer.error is not e:
                    raise writer.error from e  # e.g. ENOSPC, not torch's "unexpected pos"
                raise
            f.flush()
            os.fsync(f.fileno())
        digest = writer.sha256.hexdigest()
        _replace_verified(tmp, path, digest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return digest


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors, numbers, strings, containers) to ``path`` atomically, with its
    SHA-256 in ``<path>.sha256``. Raises CheckpointError on a full disk (ENOSPC/EDQUOT): the
    file previously at ``path`` is then left as it was; other OSErrors propagate."""
    path = Path(path)
    try:
        _save_verified(path, state)
    except OSError as e:
        if e.errno in _DISK_FULL:
            raise CheckpointError(disk_full_message(
                path, _original(e), "the checkpoint",
                "the previous checkpoint there is left as it was")) from e
        raise
    return path


def _original(e: OSError) -> OSError:
    """The OSError a :class:`DiskFull` (of a sidecar's write) was made from; else ``e``."""
    return e.__cause__ if isinstance(e, DiskFull) and isinstance(e.__cause__, OSError) else e


def verify_checkpoint(path: str | Path) -> bool | None:
    """Check ``path`` against the SHA-256 in its sidecar: True (matches), None (no sidecar: a
    checkpoint from before checksums), or raise CheckpointError saying what does not match."""
    path = Path(path)
    expected = _read_digests(path)
    if not expected:
        return None
    actual = sha256_file(path)
    if actual not in expected:
        raise CheckpointError(f"{path}: damaged or partial checkpoint (its SHA-256 does not "
                              f"match its .sha256 file; {path.stat().st_size} bytes)")
    return True


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (or :class:`CheckpointStore`),
    verifying its SHA-256 when it has a sidecar.

    Raises CheckpointError naming the file when it is missing, damaged or unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint to resume from; drop --resume to start "
                              f"afresh or point --out at the run's directory")
    try:
        verify_checkpoint(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # torch raises several types for a damaged file
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(e).__name__}: {first})") \
            from e


@dataclass
class Loaded:
    """What :meth:`CheckpointStore.latest` read: ``state``, the file ``path`` it came from, its
    ``generation`` number and ``step`` (None where unknown), and ``skipped``: (path, reason) of
    each newer checkpoint that failed verification or could not be read."""

    state: dict[str, Any]
    path: Path
    generation: int | None = None
    step: int | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


class CheckpointStore:
    """The last ``keep`` checkpoints of a run, each verified by its SHA-256.

    Layout under ``out_dir``: generations ``checkpoints/gen-<NNNNNN>[-step-<S>].pt`` (``N``
    counts saves, ``S`` is the global step when known), each with a ``.sha256`` sidecar, and
    ``checkpoint.pt`` (+ sidecar), the newest generation (hard link, or a copy). Disk use:
    ``keep`` checkpoints (``keep + 1`` where hard links are not supported).

    Args:
        out_dir: the run directory (created on the first save).
        keep: generations kept, an int >= 1 (default 2: the newest and one to fall back to).

    Raises ValueError naming ``keep`` when it is not an int >= 1. Only one process (rank 0)
    saves; any may load.
    """

    def __init__(self, out_dir: str | Path, keep: int = 2):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint keep must be an int >= 1 (generations kept), got "
                             f"{keep!r}; use 2 to keep one to fall back to")
        self.out_dir, self.keep = Path(out_dir), keep
        self.latest_path = self.out_dir / LATEST_NAME
        self.generations_dir = self.out_dir / GENERATIONS_DIR

    def generations(self) -> list[tuple[int, int | None, Path]]:
        """``(generation, step, path)`` of the generation files on disk, oldest first."""
        if not self.generations_dir.is_dir():
            return []
        found = []
        for p in self.generations_dir.iterdir():
            m = _GENERATION.match(p.name)
            if m:
                found.append((int(m[1]), int(m[2]) if m[2] is not None else None, p))
        return sorted(found, key=lambda g: g[0])

    def exists(self) -> bool:
        """Whether any checkpoint (a generation or ``checkpoint.pt``) is on disk (unverified)."""
        return self.latest_path.is_file() or bool(self.generations())

    def save(self, state: dict[str, Any], step: int | None = None) -> Path:
        """Write ``state`` as a new generation, make it ``checkpoint.pt``, drop generations
        beyond ``keep``; return the generation's path.

        ``step``: the global step, for the file name (default ``state["global_step"]`` when an
        int). Raises CheckpointError when the disk is full (ENOSPC/EDQUOT) or another OSError
        stops the write; the previous generation and ``checkpoint.pt`` are then still valid."""
        if step is None and isinstance(state.get("global_step"), int):
            step = state["global_step"]
        gens = self.generations()
        number = gens[-1][0] + 1 if gens else 1
        name = f"gen-{number:06d}" + (f"-step-{step}" if step is not None else "") + ".pt"
        path = self.generations_dir / name
        try:
            _save_verified(path, state)
            self._point_latest_at(path)
        except OSError as e:
            raise self._write_error(path, e) from e
        self._prune()
        return path

    def _write_error(self, path: Path, e: OSError) -> CheckpointError:
        previous = self.latest_path if self.latest_path.is_file() else None
        kept = (f"the previous checkpoint {previous} is still valid and --resume will use it"
                if previous else "no earlier checkpoint exists")
        if e.errno in _DISK_FULL:
            return CheckpointError(disk_full_message(path, _original(e), "the checkpoint", kept))
        return CheckpointError(f"{path}: {type(e).__name__} while writing the checkpoint ({e}); "
                               f"{kept}; check the file system")

    def _point_latest_at(self, path: Path) -> None:
        """Make ``checkpoint.pt`` (and its sidecar) the generation ``path``, atomically each."""
        tmp = self.latest_path.with_name(f".{LATEST_NAME}.link{os.getpid()}")
        tmp.unlink(missing_ok=True)
        try:
            try:
                os.link(path, tmp)
            except OSError as e:
                if e.errno in _DISK_FULL:
                    raise
                shutil.copyfile(path, tmp)  # no hard links here (some network file systems)
            _replace_verified(tmp, self.latest_path, _read_digests(path)[0])
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.out_dir)

    def _prune(self) -> None:
        for _, _, p in self.generations()[:-self.keep]:
            p.unlink(missing_ok=True)
            sidecar_path(p).unlink(missing_ok=True)

    def _candidates(self) -> list[tuple[int | None, int | None, Path]]:
        """Newest first: the generations, and ``checkpoint.pt`` where it is not one of them (a
        copy, or its generation was deleted) placed by modification time among them."""
        gens = self.generations()[::-1]
        latest = self.latest_path
        if not latest.is_file() or any(latest.samefile(p) for _, _, p in gens):
            return gens
        t = latest.stat().st_mtime_ns
        at = next((k for k, (_, _, p) in enumerate(gens) if p.stat().st_mtime_ns <= t), len(gens))
        return gens[:at] + [(None, None, latest)] + gens[at:]

    def latest(self) -> Loaded | None:
        """The newest checkpoint that verifies and loads, or None when there is none on disk.

        A damaged or partial newer one is skipped with a logged warning and listed in
        :attr:`Loaded.skipped`. Raises CheckpointError, listing every file and why, when
        checkpoints exist but none is usable."""
        skipped: list[tuple[Path, str]] = []
        candidates = self._candidates()
        for k, (gen, step, path) in enumerate(candidates):
            try:
                state = load_checkpoint(path)
            except CheckpointError as e:
                reason = str(e).removeprefix(f"{path}: ")
                log.warning("checkpoint %s is unusable (%s)%s", path, reason,
                            "; trying the previous one" if k + 1 < len(candidates) else "")
                skipped.append((path, reason))
                continue
            if skipped:
                log.warning("reading %s: %d newer checkpoint(s) were damaged (%s)", path,
                            len(skipped), "; ".join(str(p) for p, _ in skipped))
            return Loaded(state, path, gen, step, skipped)
        if skipped:
            why = "; ".join(f"{p}: {r}" for p, r in skipped)
            raise CheckpointError(
                f"{self.out_dir}: no usable checkpoint ({why}); to start this run afresh, run "
                f"it again with --overwrite (it deletes hpclb's files there) or choose another "
                f"--out")
        return None
