"""Atomic, resumable checkpoints.

A checkpoint is written to a temporary file in the same directory, flushed to disk, and renamed
over the old one, so a crash or kill mid-write leaves the previous checkpoint intact. Resuming
restores model, optimizer, scheduler step, RNG state and the position in the epoch, so the run
continues bit-for-bit the same trajectory as an uninterrupted one (same seed and world size).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not belong to this run."""


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors, numbers, strings, containers) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises CheckpointError naming the file when it is missing or unreadable.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint to resume from; drop --resume to start "
                              f"afresh or point --out at the run's directory")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged file
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(e).__name__}: {e}); "
                              f"delete it to start afresh") from e
