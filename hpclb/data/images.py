"""Image data sets for the CNN experiments: Fashion-MNIST (gzipped IDX), an ImageFolder reader
(the user's own ImageNet, with the standard training augmentation on its training split), and
synthetic images (throughput runs, no data needed).

Every split has ``len()``, ``subset(n)`` and ``batch(indices) -> (x, y)``: ``x`` float32
``[b, C, H, W]`` normalised per channel (an ImageFolder: uint8, and a ``normalize(x)`` that the
task applies on the device), ``y`` int64 ``[b]`` class ids. A split that draws
random augmentation also has ``set_epoch(epoch, seed)`` (called by the task at each epoch).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hpclb.data.idx import read_idx
from hpclb.data.paths import data_dir
from hpclb.data.transforms import (
    CROP_RATIO,
    CROP_SCALE,
    CROP_TRIES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    EncodedImages,
    random_resized_crop_box,
    sample_seed,
    train_crop,
)
from hpclb.errors import DataError

__all__ = ["CROP_RATIO", "CROP_SCALE", "CROP_TRIES", "FASHION_FILES", "IMAGENET_MEAN",
           "IMAGENET_STD", "IMAGE_SUFFIXES", "INDEX_NAME", "INDEX_VERSION", "INDEX_WAIT_S",
           "GreySplit", "ImageFolder", "SyntheticImages", "folder_index", "load_fashion_mnist",
           "load_imagenet", "random_resized_crop_box", "sample_seed", "train_crop"]

# Debian dataset-fashion-mnist 0.0~git20200523.55506a9-1, /usr/share/datasets/fashion-mnist
# (Xiao et al. 2017): 60,000 train / 10,000 test 28x28 grey images, 10 classes.
FASHION_FILES = {
    "train-images": ("train-images-idx3-ubyte.gz", "cf8536b0aa1a6ac5fa3f23001093305c"),
    "train-labels": ("train-labels-idx1-ubyte.gz", "10bea18fdb374794d4bb42e356e600c9"),
    "test-images": ("t10k-images-idx3-ubyte.gz", "f78720b4224f21cce2f2ccf2d7a94c9a"),
    "test-labels": ("t10k-labels-idx1-ubyte.gz", "0d30e22e447f3c33dab9ed536400ac01"),
}
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # training-set pixel statistics on [0, 1]
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")
# ImageFolder's file index, cached next to the images (or in the user's cache when the data
# directory is read-only) so that it is listed once, not by every rank of every run.
INDEX_NAME = ".hpclb-index.json"
INDEX_VERSION = 1
INDEX_WAIT_S = 600.0   # how long a rank waits for another process that is building the index
log = logging.getLogger(__name__)


@dataclass
class GreySplit:
    """Grey images in memory: ``images`` uint8 ``[N, H, W]``, ``labels`` int64 ``[N]``;
    batches are ``[b, 1, H, W]`` float32, ``(x/255 - mean) / std``."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: float = FASHION_MEAN
    std: float = FASHION_STD

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, n: int) -> "GreySplit":
        return GreySplit(self.images[:n], self.labels[:n], self.mean, self.std)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[indices].to(torch.float32).div_(255.0).sub_(self.mean).div_(self.std)
        return x.unsqueeze(1), self.labels[indices]


def load_fashion_mnist(root: str | Path | None = None) -> tuple[GreySplit, GreySplit]:
    """(train, test) from the four gzipped IDX files in ``root`` (default
    ``$HPCLB_DATA/fashion-mnist``). Raises DataError naming a missing/corrupt file."""
    base = data_dir(root)
    root = base / "fashion-mnist" if (base / "fashion-mnist").is_dir() else base

    def split(images: str, labels: str) -> GreySplit:
        x = read_idx(root / FASHION_FILES[images][0], ndim=3, dataset="fashion-mnist")
        y = read_idx(root / FASHION_FILES[labels][0], ndim=1, dataset="fashion-mnist")
        if len(x) != len(y) or (y.size and int(y.max()) > 9):
            raise DataError(f"{root}: {len(x)} images / {len(y)} labels (max label "
                            f"{int(y.max()) if y.size else None}) in the {images} split")
        return GreySplit(torch.from_numpy(x.copy()), torch.from_numpy(y.astype("int64")))

    return split("train-images", "train-labels"), split("test-images", "test-labels")


class SyntheticImages:
    """``num_samples`` random RGB images (``[3, size, size]``, standard normal) with random labels
    in ``[0, num_classes)``; sample ``i`` is the same on every rank and every call (seeded by
    ``seed`` and ``i``). For throughput measurements: nothing to learn."""

    def __init__(self, num_samples: int = 1281167, image_size: int = 224, num_classes: int = 1000,
                 seed: int = 0):
        self.n, self.size, self.num_classes, self.seed = num_samples, image_size, num_classes, seed

    def __len__(self) -> int:
        return self.n

    def subset(self, n: int) -> "SyntheticImages":
        return SyntheticImages(min(n, self.n), self.size, self.num_classes, self.seed)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(indices[0]) if len(indices)
                                            else self.seed)
        x = torch.randn(len(indices), 3, self.size, self.size, generator=gen)
        y = torch.remainder(indices.to(torch.int64) * 7919 + self.seed, self.num_classes)
        return x, y


def _class_dirs(root: Path) -> list[str]:
    if not root.is_dir():
        raise DataError(f"{root}: no such directory (expected <class>/<image> sub-directories, "
                        f"ImageNet layout)")
    return sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))


def _stamps(root: Path, classes: list[str]) -> list[list[int]]:
    """``[mtime_ns, size]`` of each class directory: adding, removing or renaming an image
    changes its directory's mtime, so a stale index is detected with one stat per class."""
    return [[(st := os.stat(root / c)).st_mtime_ns, st.st_size] for c in classes]


def _is_image(entry: os.DirEntry) -> bool:
    """True for a file (or a link to one) named as an image; DataError naming the entry for a
    broken link or a directory so named: skipping it would train on fewer images than the folder
    seems to hold, without a word."""
    if Path(entry.name).suffix.lower() not in IMAGE_SUFFIXES:
        return False
    if entry.is_file():
        return True
    path = Path(entry.path)
    if entry.is_symlink():
        raise DataError(f"{path}: a broken symbolic link (to {os.readlink(path)}); fix or "
                        f"remove it")
    raise DataError(f"{path}: not a file (a directory or a device named as an image); rename "
                    f"or remove it")


def _scan(root: Path) -> dict:
    """List ``root`` (classes, their image files, sorted); the index as written to disk."""
    classes = _class_dirs(root)
    if not classes:
        raise DataError(f"{root}: no class sub-directories")
    files = {c: sorted(e.name for e in os.scandir(root / c) if _is_image(e)) for c in classes}
    if not any(files.values()):
        raise DataError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)})")
    return {"version": INDEX_VERSION, "root": str(root.resolve()), "classes": classes,
            "stamps": _stamps(root, classes), "files": files}


def _index_paths(root: Path) -> list[Path]:
    """Where the index of ``root`` may live: next to the images, else the user's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpclb"
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return [root / INDEX_NAME, cache / f"imagefolder-{key}.json"]


def _read_index(path: Path, root: Path) -> dict | None:
    """The index at ``path`` if it is readable and still describes ``root``, else None."""
    try:
        index = json.loads(path.read_text())
        classes = index["classes"]
        if index.get("version") != INDEX_VERSION or index.get("root") != str(root.resolve()) \
                or _class_dirs(root) != classes or _stamps(root, classes) != index["stamps"]:
            return None
        return index
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_index(path: Path, index: dict) -> None:
    """Write atomically (temporary file + rename): readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, separators=(",", ":")))
    os.replace(tmp, path)


def _build_or_wait(path: Path, root: Path, wait_s: float) -> dict | None:
    """Build the index into ``path`` if this process claims it (an O_EXCL lock file next to
    it), else wait for the process that did. None: ``path`` is not writable here."""
    lock = path.with_name(path.name + ".building")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and lock.exists():
            time.sleep(0.2)
        index = _read_index(path, root)
        if index is None:  # the builder died or is stuck: list the folder here
            log.warning("%s: no index after waiting %.0f s for %s; listing it here", root,
                        wait_s, lock)
            index = _scan(root)
        return index
    except OSError:  # read-only or missing directory
        return None
    try:
        os.close(fd)
        index = _scan(root)
        _write_index(path, index)
        return index
    finally:
        lock.unlink(missing_ok=True)


def folder_index(root: str | Path, *, wait_s: float = INDEX_WAIT_S
                 ) -> tuple[list[str], list[tuple[Path, int]]]:
    """``(classes, files)`` of an ImageFolder ``root``: the sorted class sub-directories and
    ``(path, class id)`` of their images (sorted by name within a class, classes in order).

    Listing ImageNet's 1.28 M files takes minutes on a parallel file system, and every rank of
    every run would repeat it; so the first process that needs it lists the folder and writes
    the index atomically to ``root/.hpclb-index.json`` (or, when ``root`` is read-only,
    ``~/.cache/hpclb/imagefolder-<hash>.json``), claiming the job with an O_EXCL lock file
    so that the others wait for it (up to ``wait_s`` seconds) instead of listing too. The index
    is valid while the class directories and their mtimes and sizes are unchanged (one stat per
    class). Raises DataError for a missing directory, no classes, no images or a class
    directory without images.
    """
    root = Path(root)
    _class_dirs(root)  # DataError for a missing directory, before any cache is looked at
    paths = _index_paths(root)
    index = next((i for i in (_read_index(p, root) for p in paths) if i is not None), None)
    for path in paths:
        if index is not None:
            break
        index = _build_or_wait(path, root, wait_s)
    if index is None:
        log.warning("%s: cannot write its index to %s; every process lists the folder", root,
                    " or ".join(map(str, paths)))
        index = _scan(root)
    classes = index["classes"]
    empty = [c for c in classes if not index["files"][c]]
    if empty:  # a label is a class's position: an empty class shifts every label after it
        raise DataError(f"{', '.join(str(root / c) for c in empty)}: a class directory "
                        f"without images ({', '.join(IMAGE_SUFFIXES)}); remove it or add "
                        f"images (every sub-directory of {root} is a class)")
    return classes, [(root / c / name, k) for k, c in enumerate(classes)
                     for name in index["files"][c]]


class ImageFolder(EncodedImages):
    """``root/<class>/<image>`` (ImageNet's ``train``/``val`` layout): classes are the sorted
    sub-directory names, images their files with an image suffix, sorted. A sample is decoded
    as :mod:`hpclb.data.transforms` describes:

    - ``augment=False`` (evaluation): resized (shorter side ``resize``, bilinear) and
      centre-cropped to ``image_size``;
    - ``augment=True`` (the training split): the standard ImageNet training augmentation of the
      large-batch ResNet-50 recipes (Goyal et al. 2017; You et al.), as torchvision's
      ``RandomResizedCrop(image_size)`` + ``RandomHorizontalFlip()``: a random crop of the
      image (area 8-100 %, aspect ratio 3/4-4/3, :func:`random_resized_crop_box`) resized to
      ``image_size`` x ``image_size`` (bilinear, antialiased), flipped left-right with p = 0.5.
      The draws for sample ``i`` come from :func:`train_crop` ``(seed, epoch, i)``
      (``set_epoch`` sets both; ``i`` is the index into this split), so they do not depend on
      the world size, the batch or the order, and a resumed run reads bit-identical images.
      A JPEG is decoded only at the resolution its crop needs (DCT scaling).

    Batches are uint8 ``[b, 3, image_size, image_size]``; :meth:`normalize` (the task calls it
    on the device) makes them float32, normalised with the ImageNet statistics.
    Raises DataError for a missing directory, no classes, or an unreadable image.
    """

    def __init__(self, root: str | Path, image_size: int = 224, resize: int = 256,
                 files: list[tuple[Path, int]] | None = None, classes: list[str] | None = None,
                 *, augment: bool = False, seed: int = 0):
        super().__init__(image_size, resize, augment, seed)
        self.root = Path(root)
        if files is None:
            classes, files = folder_index(self.root)
        self.files, self.classes = files, classes

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, n: int) -> "ImageFolder":
        sub = ImageFolder(self.root, self.image_size, self.resize, self.files[:n], self.classes,
                          augment=self.augment, seed=self.seed)
        sub.epoch = self.epoch
        return sub

    def _source(self, index: int) -> tuple[Path, int, Path]:
        path, label = self.files[index]
        return path, label, path


def load_imagenet(root: str | Path | None = None, image_size: int = 224, *,
                  augment: bool = True, shards: bool = False):
    """(train, val) ImageFolders from ``<data dir>/imagenet/{train,val}`` (or ``root`` holding
    ``train`` and ``val``); the user provides the images. ``shards``: read the tar shards
    ``shards/train`` and ``shards/val`` there instead (:mod:`hpclb.data.shards`, written by
    ``hpclb data shards``; the same samples). The train split augments (random-resized crop +
    flip) unless ``augment`` is False; val is always resize 256 + centre crop. Raises DataError
    when absent, or when train and val have different classes (naming those in one only)."""
    base = data_dir(root)
    root = base / "imagenet" if (base / "imagenet").is_dir() else base
    if shards:
        from hpclb.data.shards import TarShards

        splits = (TarShards(root / "shards" / "train", image_size, augment=augment),
                  TarShards(root / "shards" / "val", image_size))
    else:
        splits = (ImageFolder(root / "train", image_size, augment=augment),
                  ImageFolder(root / "val", image_size))
    _same_classes(*splits)
    return splits


def _same_classes(train, val) -> None:
    """DataError unless the two splits have the same class list (a label is a class's position
    in it, so a class in one split only shifts the labels of the other)."""
    if train.classes == val.classes:
        return
    only = [sorted(set(a.classes) - set(b.classes)) for a, b in ((train, val), (val, train))]
    detail = "; ".join(f"only in {s.root}: {', '.join(o)}" for s, o in zip((train, val), only)
                       if o) or "the same classes in another order"
    raise DataError(f"{train.root} and {val.root} have different classes ({detail}); give both "
                    f"splits the same class directories")
