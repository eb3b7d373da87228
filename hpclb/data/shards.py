"""Tar shards of an ImageFolder (the WebDataset layout), for parallel file systems.

Reading ImageNet's 1.28 M files costs a metadata operation (open, close) per image per epoch,
which is what a parallel file system does worst. :func:`~hpclb.data.shard_writer.write_shards`
(``hpclb data shards SRC OUT``) packs a folder into ``shard-000000.tar``, ``shard-000001.tar``,
... of ``samples_per_shard`` consecutive samples each: ``<key>.jpg`` (the image file's bytes,
unchanged, or with ``--restart-markers`` a JPEG with a restart marker after every MCU: the same
pixels, and the region decoder reads a train crop's MCUs alone; another format keeps its
suffix) and ``<key>.cls`` (the class id, decimal ASCII),
``key`` the sample's index in the folder (9 digits), as WebDataset reads them; and last
``index.npz`` (every sample's shard, byte offset, size and class, the class names, the shard
names and how many JPEGs were given restart markers; a set without it was not finished).

:class:`TarShards` reads sample ``i`` with one ``pread`` from its shard, kept open (at most
:data:`MAX_OPEN_SHARDS` per process), so samples are still read by index: the global-batch
sampler's guarantees hold unchanged (every sample once per epoch, the same global batches at
any world size), and sample ``i`` is the folder's sample ``i``, the same pixels and crops.
"""
from __future__ import annotations

import io
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from hpclb.data.transforms import EncodedImages
from hpclb.errors import DataError

__all__ = ["COLUMNS", "INDEX", "INDEX_VERSION", "MAX_OPEN_SHARDS", "SAMPLES_PER_SHARD", "TarShards",
           "read_index"]

INDEX = "index.npz"
INDEX_VERSION = 1
SAMPLES_PER_SHARD = 5000  # ImageNet's train split: 257 shards of about 550 MB
MAX_OPEN_SHARDS = 256     # file descriptors a process keeps open (least recently used closed)
COLUMNS = ("shard", "offset", "size", "label")


def read_index(root: str | Path) -> dict:
    """The index of the shard set ``root``: ``shard``, ``offset``, ``size``, ``label`` (int64
    ``[N]``), ``classes`` and ``shards`` (lists of str), ``restart_markers`` (int: the JPEGs
    stored with restart markers; 0 for a set written before they could be). Raises DataError
    when it is missing, unreadable or of another version."""
    path = Path(root) / INDEX
    try:
        with np.load(path, allow_pickle=False) as z:
            index = {k: z[k] for k in ("version", "classes", "shards", *COLUMNS)}
            index["restart_markers"] = int(z["restart_markers"]) if "restart_markers" in z \
                else 0
    except FileNotFoundError:
        raise DataError(f"{root}: no {INDEX}; write the shards with `hpclb data shards "
                        f"IMAGEFOLDER {root}` (a set without it was not finished)") from None
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: unreadable shard index ({e}); write the shards again") from e
    if int(index["version"]) != INDEX_VERSION:
        raise DataError(f"{path}: shard index version {int(index['version'])}, this hpclb reads "
                        f"{INDEX_VERSION}; write the shards again")
    index["classes"], index["shards"] = index["classes"].tolist(), index["shards"].tolist()
    return index


class TarShards(EncodedImages):
    """The samples of the shard set ``root`` (:func:`~hpclb.data.shard_writer.write_shards`),
    sample ``i`` being the folder's sample ``i``: the same ``len()``, ``subset``, ``sample``,
    ``batch`` (uint8), ``set_epoch`` and ``normalize`` as
    :class:`~hpclb.data.images.ImageFolder`, decoded by :mod:`hpclb.data.transforms`. Raises
    DataError for a missing or old index, a missing shard or a short read."""

    def __init__(self, root: str | Path, image_size: int = 224, resize: int = 256, *,
                 augment: bool = False, seed: int = 0, index: dict | None = None):
        super().__init__(image_size, resize, augment, seed)
        self.root = Path(root)
        self.index = read_index(self.root) if index is None else index
        self.classes = self.index["classes"]
        self._open: OrderedDict[int, int] = OrderedDict()  # shard -> file descriptor

    def __len__(self) -> int:
        return len(self.index["label"])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # descriptors stay in their process

    def subset(self, n: int) -> "TarShards":
        index = {k: (v[:n] if k in COLUMNS else v) for k, v in self.index.items()}
        sub = TarShards(self.root, self.image_size, self.resize, augment=self.augment,
                        seed=self.seed, index=index)
        sub.epoch = self.epoch
        return sub

    def _fd(self, shard: int) -> int:
        fd = self._open.pop(shard, None)
        if fd is None:
            path = self.root / self.index["shards"][shard]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise DataError(f"{path}: cannot open shard ({e})") from e
            if len(self._open) >= MAX_OPEN_SHARDS:
                os.close(self._open.popitem(last=False)[1])
        self._open[shard] = fd
        return fd

    def _source(self, index: int) -> tuple[io.BytesIO, int, str]:
        shard, offset, size = (int(self.index[k][index]) for k in ("shard", "offset", "size"))
        name = f"{self.root / self.index['shards'][shard]}:{index:09d}"
        data = os.pread(self._fd(shard), size, offset)
        if len(data) != size:
            raise DataError(f"{name}: {len(data)} of {size} bytes (a truncated shard); write the "
                            f"shards again")
        return io.BytesIO(data), int(self.index["label"][index]), name
