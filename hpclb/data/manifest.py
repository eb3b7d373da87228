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

:func:`fingerprint_files` is what the ranks compare before training and ``--resume`` compares
with the checkpoint's (the data fingerprint, docs/plugins.md): the files a data set's registry
entry names (``DataSet.files``), each with its size and a digest of its content: ``sha256``
(every byte), ``stamp`` (the SHA-256 of its first and last :data:`FINGERPRINT_BLOCK_BYTES`) or
``size`` (its size only). A file's SHA-256 is computed once per process for a given size,
mtime, ctime and inode (``check_manifest`` and the fingerprint share it).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping

from hpclb._io import sha256_file, write_text_atomic
from hpclb.errors import DataError

__all__ = ["MANIFEST", "FULL_HASH_LIMIT_BYTES", "STAMP_BLOCK_BYTES", "FINGERPRINT_BLOCK_BYTES",
           "LISTED_FILES", "write_manifest", "check_manifest", "fingerprint_files"]

MANIFEST = ".verified"
FULL_HASH_LIMIT_BYTES = 2 * 2 ** 30
STAMP_BLOCK_BYTES = 2 ** 20
FINGERPRINT_BLOCK_BYTES = 2 ** 16
#: files a fingerprint lists one by one; above, one entry per directory (ImageNet's classes)
LISTED_FILES = 1000
_SHA256: dict[tuple, str] = {}  # (path, size, m/ctime_ns, inode) -> SHA-256, this process's


def _block_sha256(path: Path, size: int, block: int = STAMP_BLOCK_BYTES) -> tuple[str, str]:
    """SHA-256 of the first and of the last ``block`` bytes of ``path``."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(block)).hexdigest()
        f.seek(max(0, size - block))
        tail = hashlib.sha256(f.read(block)).hexdigest()
    return head, tail


def _sha256(path: Path, st: os.stat_result) -> str:
    """SHA-256 of ``path`` (whose stat is ``st``), read once per process per size, mtime, ctime
    and inode: a file replaced or written since (even with its mtime put back: that sets the
    ctime) is read again."""
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    if key not in _SHA256:
        _SHA256[key] = sha256_file(path)
    return _SHA256[key]


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
        got = _sha256(path, st)
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
                            f"restore the file; to train on the changed files on purpose, "
                            f"delete {path} (a resumed run then needs --resume-changed data)")
    return len(files)


def _digest(path: Path, how: str) -> str:
    """``path``'s size and digest ``how`` (``sha256``, ``stamp``, ``size``), as one string."""
    st = path.stat()
    if how == "size":
        return f"{st.st_size} bytes"
    if how == "stamp":
        head, tail = _block_sha256(path, st.st_size, FINGERPRINT_BLOCK_BYTES)
        both = hashlib.sha256(f"{head}{tail}".encode()).hexdigest()
        return f"{st.st_size} bytes, first+last 64 KiB SHA-256 {both}"
    return f"{st.st_size} bytes, SHA-256 {_sha256(path, st)}"


def fingerprint_files(directory: Path, patterns: Mapping[str, str], limit: int | None = None,
                      exclude: tuple = ()) -> dict[str, str]:
    """The content of the files under ``directory`` that ``patterns`` (glob pattern relative to
    it -> how each is digested: ``sha256``, ``stamp`` or ``size``, the first pattern that
    matches a file wins) match: relative name -> its size and digest, sorted; hidden files and
    folders (``.verified``, indexes, locks) and those under ``exclude`` (a run directory inside
    the data directory) are left out. Above :data:`LISTED_FILES` files, one
    entry per folder (``train/n01440764/``: its files' count and the SHA-256 of their names,
    sizes and digests). More than ``limit`` files: none digested, one entry saying so. Raises
    OSError where a file cannot be read."""
    found: dict[str, tuple[Path, str]] = {}
    skip = [Path(os.path.abspath(d)) for d in exclude]
    for pattern, how in patterns.items():
        for path in directory.glob(pattern):
            name = path.relative_to(directory).as_posix()
            if name not in found and not any(p.startswith(".") for p in name.split("/")) \
                    and path.is_file() and \
                    not any(Path(os.path.abspath(path)).is_relative_to(d) for d in skip):
                found[name] = (path, how)
                if limit is not None and len(found) > limit:
                    return {"*": f"more than {limit} files: not fingerprinted"}
    files = {name: _digest(path, how) for name, (path, how) in sorted(found.items())}
    if len(files) <= LISTED_FILES:
        return files
    folders: dict[str, list[str]] = {}
    for name, entry in files.items():
        folder, _, base = name.rpartition("/")
        folders.setdefault(f"{folder}/", []).append(f"{base}: {entry}")
    return {folder: f"{len(lines)} files, SHA-256 of their names, sizes and digests "
                    f"{hashlib.sha256(chr(10).join(lines).encode()).hexdigest()}"
            for folder, lines in folders.items()}
