"""Image data sets for the CNN experiments: Fashion-MNIST (gzipped IDX), an ImageFolder reader
(the user's own ImageNet, with the standard training augmentation on its training split), and
synthetic images (throughput runs, no data needed).

Every split has ``len()``, ``subset(n)`` and ``batch(indices) -> (x, y)``: ``x`` float32
``[b, C, H, W]`` normalised per channel, ``y`` int64 ``[b]`` class ids. A split that draws
random augmentation also has ``set_epoch(epoch, seed)`` (called by the task at each epoch).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpclb.data.idx import read_idx
from hpclb.data.paths import data_dir
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
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")
# RandomResizedCrop's bounds in the common reference (torchvision.transforms.RandomResizedCrop,
# the ImageNet training transform of Goyal et al. 2017 and You et al.'s LARS runs): crop area a
# fraction U[0.08, 1] of the image, aspect ratio w/h log-uniform in [3/4, 4/3], 10 tries.
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
_MASK64 = (1 << 64) - 1
# ImageFolder's file index, cached next to the images (or in the user's cache when the data
# directory is read-only) so that it is listed once, not by every rank of every run.
INDEX_NAME = ".hpclb-index.json"
INDEX_VERSION = 1
INDEX_WAIT_S = 600.0   # how long a rank waits for another process that is building the index
log = logging.getLogger(__name__)


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al. 2014) on a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s augmentation in ``epoch`` of a run seeded ``seed``: a
    SplitMix64 mix of the three integers (no ``hash()``, so the same in every process and
    Python), 63 bits (a valid ``torch.Generator.manual_seed`` everywhere)."""
    h = 0x1A6E_C0FF_EE5E_ED00  # a fixed start, so that (0, 0, 0) is not seed 0
    for v in (seed, epoch, index):
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1


def random_resized_crop_box(width: int, height: int, gen: torch.Generator,
                            scale: tuple[float, float] = CROP_SCALE,
                            ratio: tuple[float, float] = CROP_RATIO,
                            tries: int = CROP_TRIES) -> tuple[int, int, int, int]:
    """A random crop ``(left, top, w, h)`` (pixels, inside ``width`` x ``height``), drawn from
    ``gen`` as torchvision's ``RandomResizedCrop.get_params`` draws it (same draws in the same
    order): up to ``tries`` times, area ``U[scale] * width * height`` and aspect ratio ``w / h``
    ``exp(U[log ratio])``, ``w, h`` rounded; the first that fits gets a uniform position. If none
    fits, the centre crop of the whole image with its aspect ratio clamped to ``ratio``."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(tries):
        target = area * torch.empty(1).uniform_(scale[0], scale[1], generator=gen).item()
        aspect = math.exp(torch.empty(1).uniform_(log_lo, log_hi, generator=gen).item())
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=gen).item())
            left = int(torch.randint(0, width - w + 1, (1,), generator=gen).item())
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def train_crop(width: int, height: int, seed: int, epoch: int,
               index: int) -> tuple[tuple[int, int, int, int], bool]:
    """The augmentation of sample ``index`` in ``epoch``: its crop box ``(left, top, w, h)``
    (:func:`random_resized_crop_box`) and whether it is flipped left-right (p = 0.5), both from
    a ``torch.Generator`` seeded with :func:`sample_seed` ``(seed, epoch, index)``, so the same
    on whichever rank reads the sample and after a resumption."""
    gen = torch.Generator().manual_seed(sample_seed(seed, epoch, index))
    box = random_resized_crop_box(width, height, gen)
    return box, bool(torch.rand(1, generator=gen).item() < 0.5)


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


def _scan(root: Path) -> dict:
    """List ``root`` (classes, their image files, sorted); the index as written to disk."""
    classes = _class_dirs(root)
    if not classes:
        raise DataError(f"{root}: no class sub-directories")
    files = {c: sorted(e.name for e in os.scandir(root / c)
                       if e.is_file() and Path(e.name).suffix.lower() in IMAGE_SUFFIXES)
             for c in classes}
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
    class). Raises DataError for a missing directory, no classes or no images.
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
    return classes, [(root / c / name, k) for k, c in enumerate(classes)
                     for name in index["files"][c]]


class ImageFolder:
    """``root/<class>/<image>`` (ImageNet's ``train``/``val`` layout): classes are the sorted
    sub-directory names, images their files with an image suffix, sorted. A batch is read with
    PIL and converted to RGB, then

    - ``augment=False`` (evaluation): resized (shorter side ``resize``, bilinear) and
      centre-cropped to ``image_size``;
    - ``augment=True`` (the training split): the standard ImageNet training augmentation of the
      large-batch ResNet-50 recipes (Goyal et al. 2017; You et al.), as torchvision's
      ``RandomResizedCrop(image_size)`` + ``RandomHorizontalFlip()``: a random crop of the
      decoded image (area 8-100 %, aspect ratio 3/4-4/3, :func:`random_resized_crop_box`)
      resized to ``image_size`` x ``image_size`` (PIL bilinear), flipped left-right with
      p = 0.5. The draws for sample ``i`` come from :func:`train_crop` ``(seed, epoch, i)``
      (``set_epoch`` sets both; ``i`` is the index into this split), so they do not depend on
      the world size, the batch or the order, and a resumed run reads bit-identical images;

    and normalised with the ImageNet statistics: float32 ``[b, 3, image_size, image_size]``.
    Raises DataError for a missing directory, no classes, or an unreadable image.
    """

    def __init__(self, root: str | Path, image_size: int = 224, resize: int = 256,
                 files: list[tuple[Path, int]] | None = None, classes: list[str] | None = None,
                 *, augment: bool = False, seed: int = 0):
        self.root, self.image_size, self.resize = Path(root), image_size, resize
        self.augment, self.seed, self.epoch = bool(augment), int(seed), 0
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

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        """Draw the augmentation of ``epoch`` (and of run seed ``seed``, if given) from now on."""
        self.epoch = int(epoch)
        if seed is not None:
            self.seed = int(seed)

    def sample(self, index: int, epoch: int | None = None) -> tuple[torch.Tensor, int]:
        """Sample ``index``: ``(x, y)``, x float32 ``[3, image_size, image_size]``, y its class
        id; augmented as in ``epoch`` (default the epoch of :meth:`set_epoch`). A DataLoader
        worker passes the epoch with the index (its copy of the split never sees set_epoch)."""
        path, label = self.files[int(index)]
        return self._load(path, int(index), self.epoch if epoch is None else int(epoch)), label

    def _load(self, path: Path, index: int, epoch: int) -> torch.Tensor:
        """Sample ``index`` (file ``path``) of ``epoch``: float32 ``[3, image_size,
        image_size]``."""
        from hpclb.extras import require

        Image = require("PIL.Image", "reading ImageFolder images")
        size = self.image_size
        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                w, h = im.size
                if self.augment:
                    (left, top, cw, ch), flip = train_crop(w, h, self.seed, epoch, index)
                    im = im.crop((left, top, left + cw, top + ch)).resize((size, size),
                                                                          Image.BILINEAR)
                    if flip:
                        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
                else:
                    scale = self.resize / min(w, h)
                    im = im.resize((max(1, round(w * scale)), max(1, round(h * scale))),
                                   Image.BILINEAR)
                    w, h = im.size
                    left, top = (w - size) // 2, (h - size) // 2
                    im = im.crop((left, top, left + size, top + size))
                arr = np.asarray(im, dtype=np.float32) / 255.0
        except OSError as e:
            raise DataError(f"{path}: cannot read image ({e})") from e
        t = torch.from_numpy(arr).permute(2, 0, 1)
        return (t - torch.tensor(IMAGENET_MEAN)[:, None, None]) / \
            torch.tensor(IMAGENET_STD)[:, None, None]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.sample(int(i)) for i in indices]
        if not items:  # an empty share (a short last step)
            size = self.image_size
            return torch.zeros(0, 3, size, size), torch.zeros(0, dtype=torch.int64)
        return (torch.stack([x for x, _ in items]),
                torch.tensor([c for _, c in items], dtype=torch.int64))


def load_imagenet(root: str | Path | None = None, image_size: int = 224, *,
                  augment: bool = True):
    """(train, val) ImageFolders from ``<data dir>/imagenet/{train,val}`` (or ``root`` holding
    ``train`` and ``val``); the user provides the images. The train split augments (random-
    resized crop + flip) unless ``augment`` is False; val is always resize 256 + centre crop.
    Raises DataError when absent."""
    base = data_dir(root)
    root = base / "imagenet" if (base / "imagenet").is_dir() else base
    return (ImageFolder(root / "train", image_size, augment=augment),
            ImageFolder(root / "val", image_size))
