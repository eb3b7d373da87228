"""What ``hpclb data fetch`` verified, recorded beside the data, and checked again by every rank
when a run starts, so that a file changed after staging (overwritten in place at the same size,
truncated, replaced) is caught before any training.

The record is ``<data set dir>/.verified``, JSON: ``{"version": 1, "files": {name: {...}}}``
with each file's ``size`` (bytes) and ``mtime_ns``, and either its ``sha256`` (sets up to
:data:`FULL_HASH_LIMIT_BYTES` in all: every byte is checked, about 0.1 s per 50 MB) or, for
larger sets, a stamp: the SHA-256 of its first and last :data:`STAMP_BLOCK_BYTES` (``head``,
``tail``) plus size and mtime, which costs two reads per file whatever its size (a change in the
middle that keeps size and mtime is not seen). An empty ``.verified`` (staged by an older
hpclb) records nothing and is not checked.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hpclb._io import sha256_file, write_text_atomic
from hpclb.errors import DataError

__all__ = ["MANIFEST", "FULL_HASH_LIMIT_BYTES", "STAMP_BLOCK_BYTES", "write_manifest",
           "check_manifest"]

MANIFEST = ".verified"
FULL_HASH_LIMIT_BYTES = 2 * 2 ** 30
STAMP_BLOCK_BYTES = 2 ** 20


def _block_sha256(path: Path, size: int) -> tuple[str, str]:
    """SHA-256 of the first and of the last :data:`STAMP_BLOCK_BYTES` of ``path``."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(STAMP_BLOCK_BYTES)).hexdigest()
        f.seek(max(0, size - STAMP_BLOCK_BYTES))
        tail = hashlib.sha256(f.read(STAMP_BLOCK_BYTES)).hexdigest()
    return head, tail


def _record(path: Path, full: bool) -> dict:
    st = path.stat()
    entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if full:
        entry["sha256"] = sha256_file(path)
    else:
        entry["head"], entry["tail"] = _block_sha256(path, st.st_size)
    return entry


def write_manifest(directory: Path, names: list[str], *,
                   full_hash_limit_bytes: int = FULL_HASH_LIMIT_BYTES) -> Path:
    """Record ``names`` (files in ``directory``, just verified) in ``directory/.verified``:
    SHA-256 of every file when their total size is at most ``full_hash_limit_bytes``, else each
    file's stamp. Returns the record's path."""
    total = sum((directory / n).stat().st_size for n in names)
    full = total <= full_hash_limit_bytes
    files = {n: _record(directory / n, full) for n in sorted(names)}
    path = directory / MANIFEST
    write_text_atomic(path, json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    return path


def _changed(path: Path, entry: dict) -> str | None:
    """Why ``path`` no longer matches its record ``entry``, or None."""
    if not path.is_file():
        return "missing"
    st = path.stat()
    if st.st_size != entry["size"]:
        return f"{st.st_size} bytes, {entry['size']} when verified"
    if "sha256" in entry:
        got = sha256_file(path)
        return None if got == entry["sha256"] else \
            f"SHA-256 {got[:16]}..., {entry['sha256'][:16]}... when verified (same size)"
    if st.st_mtime_ns != entry["mtime_ns"]:
        return "modified after it was verified (mtime differs)"
    if _block_sha256(path, st.st_size) != (entry["head"], entry["tail"]):
        return "its first or last MiB differs from when it was verified (same size and mtime)"
    return None


def check_manifest(directory: Path) -> int:
    """Check every file ``directory/.verified`` records; returns how many were checked (0: no
    record). Raises DataError naming the first file that changed, how, and the fix."""
    path = directory / MANIFEST
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a record of `hpclb data fetch` ({e!r}); fetch the data "
                        f"set again") from e
    for name, entry in files.items():
        why = _changed(directory / name, entry)
        if why is not None:
            raise DataError(f"{directory / name}: {why}; the staged data changed after `hpclb "
                            f"data fetch` verified it: fetch it again (delete {path} first) or "
                            f"restore the file")
    return len(files)
