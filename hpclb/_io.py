"""Files that survive a kill: atomic writes, digests, JSON lines.

Every file hpclb writes that a later run reads (checkpoints and their sidecars, ``config.json``,
``summary.json``, ``metrics.jsonl`` rewrites, data indexes) goes through :func:`write_atomic`:
written to a temporary file next to the target, flushed to disk, renamed over the target, so a
reader sees the old file or the new one, never a torn one. A full disk stops such a write with
:class:`~hpclb.errors.DiskFull`: the file, what is still valid and the fix, in one line.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from hpclb.errors import DISK_FULL_ERRNOS, DiskFull

__all__ = ["file_in_the_way", "fsync_dir", "write_atomic", "write_text_atomic", "write_json",
           "sha256_file", "json_lines", "json_lines_numbered", "read_text_utf8", "read_json"]


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The first existing ancestor of ``path`` that is not a directory (a file where a folder
    of the path must be: nothing can be written there), else None."""
    return next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any], kept: str | None = None) -> None:
    """Call ``write(f)`` on a temporary binary file next to ``path``, fsync it and rename it
    over ``path``; the temporary file is removed on any failure. Raises DiskFull on a full disk,
    its message naming ``path`` and ``kept`` (what is still valid; default: the file there
    before, as it was); other OSErrors propagate."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS and not isinstance(e, DiskFull):
            raise DiskFull(path, e, kept or f"the {path.name} there before, if any, is left as "
                                            f"it was") from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str, kept: str | None = None) -> None:
    """Replace ``path`` by ``text`` (UTF-8) atomically (:func:`write_atomic`)."""
    data = text.encode()
    write_atomic(path, lambda f: f.write(data), kept)


def write_json(path: Path, obj: Any, kept: str | None = None) -> None:
    """Replace ``path`` by ``obj`` as indented JSON with a final newline, atomically
    (:func:`write_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n", kept)


def sha256_file(path: Path) -> str:
    """SHA-256 of the file at ``path``, lower-case hex (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def json_lines_numbered(path: Path) -> Iterator[tuple[int, str, Any, bool]]:
    """``(line number, line, row, last)`` for each non-empty line of a JSONL file (numbers from
    1, ``last``: no non-empty line follows); ``row`` is None for a line that is not JSON (a torn
    line). Never raises for the content; OSError when the file cannot be read."""
    lines = path.read_text(errors="replace").splitlines()
    filled = [i for i, line in enumerate(lines) if line.strip()]
    for i in filled:
        try:
            row = json.loads(lines[i])
        except json.JSONDecodeError:
            row = None
        yield i + 1, lines[i], row, i == filled[-1]


def json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """``(line, row)`` for each non-empty line of a JSONL file; a torn last line (a killed
    writer) is yielded as ``(line, None)``. Raises ValueError naming another line that is not
    JSON."""
    for number, line, row, last in json_lines_numbered(path):
        if row is None and not last:
            raise ValueError(f"{path}:{number}: not a JSON line; repair or delete the file")
        yield line, row


def read_text_utf8(path: Path, what: str) -> str:
    """The text of the user's file ``path`` (a byte-order mark dropped). ``what``: what such
    files are, for the message (``"recipes"``). Raises ValueError naming the file, the first
    byte that is not UTF-8 (offset from 0, line and column from 1) and the fix; OSError when it
    cannot be read."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}: byte {e.start} (0x{data[e.start]:02x}, line {line}, column "
                         f"{column}) is not UTF-8; {what} are UTF-8 text: save the file as UTF-8 "
                         f"(e.g. `iconv -f latin1 -t utf-8`)") from None


def read_json(path: Path, what: str) -> Any:
    """:func:`read_text_utf8`, parsed as JSON. Raises ValueError naming the file (and the
    place) for text that is not UTF-8 or not JSON; OSError when it cannot be read."""
    text = read_text_utf8(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}); {what} are JSON") from None
