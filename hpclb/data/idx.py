"""Reader for the IDX format (LeCun's MNIST files; Fashion-MNIST uses it gzipped).

Layout: 2 zero bytes, a dtype code, the number of dims ``d``, ``d`` big-endian uint32 sizes, then
the data in row-major order, big-endian.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from hpclb.errors import DataError

__all__ = ["read_idx"]

_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
           0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | Path, *, ndim: int | None = None, dataset: str | None = None
             ) -> np.ndarray:
    """Read an IDX file (plain or ``.gz``) into a native-endian array.

    Args: ``path``; ``ndim``, the expected number of dimensions (None: any); ``dataset``, the
    data set it belongs to (``mnist``, ``fashion-mnist``), named in the fix
    (``hpclb data fetch <dataset>``).
    Returns an array of the file's shape and dtype (uint8 for MNIST).
    Raises DataError naming the file when it is missing, has a bad magic number or the wrong
    number of dimensions, or is truncated / has trailing bytes.
    """
    path = Path(path)
    fetch = f"`hpclb data fetch {dataset}`" if dataset else "`hpclb data fetch`"
    if not path.is_file():
        raise DataError(f"{path}: no such file; stage it with {fetch} or point "
                        f"--data-dir at a directory that holds it")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e}); re-stage it with {fetch}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise DataError(f"{path}: not an IDX file (magic bytes {raw[:4].hex() or 'missing'}); "
                        f"re-stage it with {fetch}")
    dtype, dims = _DTYPES[raw[2]], raw[3]
    if ndim is not None and dims != ndim:
        raise DataError(f"{path}: IDX file has {dims} dimensions, expected {ndim}")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"{path}: IDX header says shape {shape} ({expected} bytes) but the file "
                        f"has {len(raw)} bytes (truncated or corrupt); re-stage it with "
                        f"{fetch}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(
        dtype.newbyteorder("="), copy=False)
