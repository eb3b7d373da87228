"""Image data sets for the CNN experiments: Fashion-MNIST (gzipped IDX), an ImageFolder reader
(the user's own ImageNet), and synthetic images (throughput runs, no data needed).

Every split has ``len()``, ``subset(n)`` and ``batch(indices) -> (x, y)``: ``x`` float32
``[b, C, H, W]`` normalised per channel, ``y`` int64 ``[b]`` class ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import DataError, data_dir
from .idx import read_idx

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
        x = read_idx(root / FASHION_FILES[images][0], ndim=3)
        y = read_idx(root / FASHION_FILES[labels][0], ndim=1)
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


class ImageFolder:
    """``root/<class>/<image>`` (ImageNet's ``train``/``val`` layout): classes are the sorted
    sub-directory names, images their files with an image suffix, sorted. A batch is read with
    PIL, converted to RGB, resized (shorter side ``resize``), centre-cropped to ``image_size`` and
    normalised with the ImageNet statistics: float32 ``[b, 3, image_size, image_size]``.
    (No random augmentation: add it here for a full ImageNet reproduction.)
    Raises DataError for a missing directory, no classes, or an unreadable image.
    """

    def __init__(self, root: str | Path, image_size: int = 224, resize: int = 256,
                 files: list[tuple[Path, int]] | None = None, classes: list[str] | None = None):
        self.root, self.image_size, self.resize = Path(root), image_size, resize
        if files is None:
            if not self.root.is_dir():
                raise DataError(f"{self.root}: no such directory (expected <class>/<image> "
                                f"sub-directories, ImageNet layout)")
            classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
            if not classes:
                raise DataError(f"{self.root}: no class sub-directories")
            files = [(f, c) for c, name in enumerate(classes)
                     for f in sorted((self.root / name).iterdir())
                     if f.suffix.lower() in IMAGE_SUFFIXES]
            if not files:
                raise DataError(f"{self.root}: no images ({', '.join(IMAGE_SUFFIXES)})")
        self.files, self.classes = files, classes

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, n: int) -> "ImageFolder":
        return ImageFolder(self.root, self.image_size, self.resize, self.files[:n], self.classes)

    def _load(self, path: Path) -> torch.Tensor:
        from PIL import Image

        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                w, h = im.size
                scale = self.resize / min(w, h)
                im = im.resize((max(1, round(w * scale)), max(1, round(h * scale))),
                               Image.BILINEAR)
                w, h = im.size
                left, top = (w - self.image_size) // 2, (h - self.image_size) // 2
                im = im.crop((left, top, left + self.image_size, top + self.image_size))
                arr = np.asarray(im, dtype=np.float32) / 255.0
        except OSError as e:
            raise DataError(f"{path}: cannot read image ({e})") from e
        t = torch.from_numpy(arr).permute(2, 0, 1)
        return (t - torch.tensor(IMAGENET_MEAN)[:, None, None]) / \
            torch.tensor(IMAGENET_STD)[:, None, None]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.files[int(i)] for i in indices]
        return (torch.stack([self._load(p) for p, _ in items]),
                torch.tensor([c for _, c in items], dtype=torch.int64))


def load_imagenet(root: str | Path | None = None, image_size: int = 224):
    """(train, val) ImageFolders from ``<data dir>/imagenet/{train,val}`` (or ``root`` holding
    ``train`` and ``val``); the user provides the images. Raises DataError when absent."""
    base = data_dir(root)
    root = base / "imagenet" if (base / "imagenet").is_dir() else base
    return ImageFolder(root / "train", image_size), ImageFolder(root / "val", image_size)
