"""``hpclb data shards SRC OUT``: pack an ImageFolder into tar shards (:mod:`hpclb.data.shards`
has the layout and the reader)."""
from __future__ import annotations

import io
import os
import re
import tarfile
from pathlib import Path

import numpy as np

from hpclb.data.images import folder_index
from hpclb.data.shards import COLUMNS, INDEX, INDEX_VERSION, SAMPLES_PER_SHARD
from hpclb.errors import EXIT_USAGE, DataError

__all__ = ["write_shards"]

_SHARD = re.compile(r"shard-\d{6}\.tar")  # a shard's name in an index hpclb wrote


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    tar.addfile(info, io.BytesIO(data))


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    return ".jpg" if suffix == ".jpeg" else suffix


def _readable(image: Path) -> bytes:
    """The bytes of ``image`` after a check that they decode (at 1/8 scale for JPEG: PIL's
    draft mode, so the whole entropy-coded stream is read at a fraction of the full cost).
    Raises DataError naming the file when it is empty, truncated or not an image."""
    from PIL import Image

    data = image.read_bytes()
    try:
        if not data:
            raise OSError("the file is empty")
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except Exception as e:  # noqa: BLE001 (PIL raises OSError, SyntaxError, ValueError, ...)
        raise DataError(f"{image}: not a readable image ({e}); nothing was packed from it: "
                        f"remove or replace the file and run hpclb data shards again") from e
    return data


def _with_restart_markers(data: bytes) -> tuple[bytes, bool]:
    """``(data with a restart marker after every MCU, True)`` for a JPEG libjpeg transcodes
    (:func:`~hpclb.data.transforms.add_restart_markers`: the same pixels); ``(data, False)``
    for anything else (another format, CMYK, a JPEG only PIL reads), kept as it is."""
    from hpclb.data.transforms import add_restart_markers

    if data[:3] != b"\xff\xd8\xff":
        return data, False
    try:
        return add_restart_markers(data), True
    except ValueError:
        return data, False


def _write_shard(path: Path, files: list[tuple[Path, int]], first: int,
                 restart_markers: bool) -> tuple[list[tuple[int, int]], int]:
    """One shard of ``files`` (samples ``first``, ``first + 1``, ...): ``(offset, size)`` of
    each image's bytes in it, as a reader of the tar finds them, and how many JPEGs were given
    restart markers (``restart_markers``: :func:`_with_restart_markers`). Raises DataError for
    an image that does not decode (:func:`_readable`)."""
    marked = 0
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, (image, label) in enumerate(files, first):
            data = _readable(image)
            if restart_markers:
                data, done = _with_restart_markers(data)
                marked += done
            _add(tar, f"{key:09d}{_suffix(image)}", data)
            _add(tar, f"{key:09d}.cls", str(label).encode())
    with tarfile.open(path) as tar:
        return [(m.offset_data, m.size) for m in tar.getmembers()
                if not m.name.endswith(".cls")], marked


def _bad_out(message: str) -> DataError:
    """A DataError for a bad OUT path: bad input, so the command line exits 2."""
    error = DataError(message)
    error.exit_code = EXIT_USAGE
    return error


def _own_files(out: Path) -> list[Path]:
    """The files a shard set of hpclb holds in ``out``: its index and the shards the index
    lists (present ones). Raises DataError (exit 2) when the index is not one hpclb wrote."""
    index = out / INDEX
    if not index.exists():
        return []
    try:
        with np.load(index) as z:
            names = [str(n) for n in z["shards"]]
    except (OSError, ValueError, KeyError) as e:
        raise _bad_out(f"{index}: not an index hpclb data shards wrote ({e}); move it away or "
                       f"choose another OUT") from e
    return [index] + sorted(out / n for n in names
                            if _SHARD.fullmatch(n) and (out / n).exists())


def _clear_old(out: Path, n_shards: int, overwrite: bool) -> None:
    """Delete the shard set hpclb wrote in ``out`` (:func:`_own_files`) when ``overwrite``;
    DataError naming it (and the other ``.tar`` files, which are kept) otherwise, and always
    when a file the index does not list has one of the ``n_shards`` new shards' names."""
    old = _own_files(out)
    planned = {f"shard-{k:06d}.tar" for k in range(n_shards)}
    others = sorted(p.name for p in out.glob("*.tar") if p not in old) if out.is_dir() else []
    kept = f"; the other files there are not hpclb's and are kept ({', '.join(others)})" \
        if others else ""
    clash = sorted(planned.intersection(others))
    if clash:
        raise _bad_out(f"{out}: holds {', '.join(clash)}, which hpclb's index does not list "
                       f"(not written by hpclb data shards) and the new shards would replace; "
                       f"move them away or choose another OUT{kept}")
    if old and not overwrite:
        raise DataError(f"{out}: holds tar shards already ({len(old)} files: "
                        f"{', '.join(p.name for p in old)}); choose another directory or pass "
                        f"--overwrite to replace them{kept}")
    for path in old:
        path.unlink()


def write_shards(src: str | Path, out: str | Path, *, samples_per_shard: int = SAMPLES_PER_SHARD,
                 overwrite: bool = False, restart_markers: bool = False) -> Path:
    """Pack the ImageFolder ``src`` into tar shards in ``out`` (module docstring); returns
    ``out``. ``restart_markers``: each JPEG is stored with a restart marker after every MCU
    (:func:`~hpclb.data.transforms.add_restart_markers`: the same pixels, and the region
    decoder reads a train crop's MCUs alone; about 5 ms per ImageNet-sized image more); other
    files, and JPEGs libjpeg does not transcode (CMYK), are stored unchanged; the index's
    ``restart_markers`` counts those given them. It raises MissingExtraError (before anything
    is written) where hpclb's region decoder was not built. Every image is checked to decode
    while it is packed: one that does not (empty, truncated, not an image) raises DataError
    naming it, and the shards written so far are removed. Raises DataError when ``out``
    already holds a shard set (unless ``overwrite``: its index and the shards the index lists
    are deleted first; other files there are kept), when a file the index does not list has
    the name of a new shard, when ``out`` is inside ``src``, is not a directory or cannot be
    created (these with ``exit_code`` 2: the command line's bad input), or ``src`` is not an
    ImageFolder; ValueError for ``samples_per_shard`` < 1."""
    if samples_per_shard < 1:
        raise ValueError(f"write_shards: samples_per_shard must be >= 1, got {samples_per_shard}")
    if restart_markers:
        from hpclb.data.transforms import _region_decoder
        # MissingExtraError naming the fix, before anything is written
        _region_decoder("restart markers (hpclb data shards --restart-markers)",
                        "pack without them")
    src, out = Path(src), Path(out)
    if out.resolve().is_relative_to(src.resolve()):
        raise _bad_out(f"{out}: inside the ImageFolder {src} (its shards would become a class "
                       f"of it); choose an OUT outside SRC")
    if out.exists() and not out.is_dir():
        raise _bad_out(f"{out}: exists and is not a directory; choose another OUT")
    classes, files = folder_index(src)
    _clear_old(out, -(-len(files) // samples_per_shard), overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent is a file, or not writable
        raise _bad_out(f"{out}: cannot create the shard directory ({e}); choose another OUT") \
            from e
    names, columns, marked = [], {k: [] for k in COLUMNS}, 0
    try:
        for k, first in enumerate(range(0, len(files), samples_per_shard)):
            names.append(f"shard-{k:06d}.tar")
            chunk = files[first:first + samples_per_shard]
            spans, n = _write_shard(out / names[-1], chunk, first, restart_markers)
            marked += n
            for (offset, size), (_, label) in zip(spans, chunk):
                for key, value in zip(COLUMNS, (k, offset, size, label)):
                    columns[key].append(value)
    except DataError:
        for name in names:  # no half-packed set is left behind
            (out / name).unlink(missing_ok=True)
        raise
    tmp = out / f".{INDEX}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, version=np.int64(INDEX_VERSION), classes=np.array(classes),
                 shards=np.array(names), restart_markers=np.int64(marked),
                 **{k: np.array(v, dtype=np.int64) for k, v in columns.items()})
    os.replace(tmp, out / INDEX)
    return out
