"""Probe: the train transform with the JPEG decoded only in the crop's region (libjpeg-turbo 3's
``tj3SetCroppingRegion``), against :func:`hpclb.data.transforms.decode_train` (simplejpeg),
measured in the same run (docs/recipes.md, "Decoding only the crop's region").

No binding of the TurboJPEG 3 API installs from PyPI within this repository's rules, so this is
a probe, not a decoder of the package: pass a libturbojpeg >= 3.0 shared library you have::

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python dev/crop_decode_probe.py \\
        --libturbojpeg /path/to/libturbojpeg.so.0 --images 200 --rounds 6

It writes the benchmark's synthetic JPEGs, checks that both paths give identical samples, then
times them in interleaved rounds (images per CPU second) and prints medians, ranges and the
median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hpclb.bench.loader import synthetic_jpegs
from hpclb.data import transforms as T

# TurboJPEG 3 (turbojpeg.h): TJINIT_DECOMPRESS, TJPARAM_SUBSAMP / JPEGWIDTH / JPEGHEIGHT, TJPF_RGB
INIT_DECOMPRESS, SUBSAMP, WIDTH, HEIGHT, PF_RGB = 1, 4, 5, 6, 0
IMCU_WIDTH = {0: 8, 1: 16, 2: 16, 3: 8, 4: 8, 5: 32, 6: 8}  # by TJSAMP_*


class _Scaling(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int),
                ("h", ctypes.c_int)]


class CropDecoder:
    """A TurboJPEG 3 decompressor (one handle) from the shared library at ``path``."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        lib.tj3Init.restype = ctypes.c_void_p
        lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.tj3SetScalingFactor.argtypes = [ctypes.c_void_p, _Scaling]
        lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
        lib.tj3Decompress8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.tj3GetErrorStr.restype = ctypes.c_char_p
        lib.tj3GetErrorStr.argtypes = [ctypes.c_void_p]
        self.lib, self.handle = lib, lib.tj3Init(INIT_DECOMPRESS)

    def _check(self, status: int) -> None:
        if status != 0:
            raise ValueError(self.lib.tj3GetErrorStr(self.handle).decode())

    def header(self, data: bytes) -> tuple[int, int, int]:
        """``(width, height, subsampling)`` of the JPEG ``data``."""
        self._check(self.lib.tj3DecompressHeader(self.handle, data, len(data)))
        return tuple(self.lib.tj3Get(self.handle, p) for p in (WIDTH, HEIGHT, SUBSAMP))

    def decode(self, data: bytes, s: int, box: tuple[int, int, int, int]) -> np.ndarray:
        """``box`` (left, top, right, bottom; pixels of the 1/``s`` decode) as uint8 HWC. The
        region decoded is widened to the iMCU boundary at least one pixel left of the box, one
        iMCU right of it and 16 rows below it, so that fancy upsampling sees the same
        neighbours as in a whole decode."""
        width, height, subsamp = self.header(data)
        sw, sh = -(-width // s), -(-height // s)
        step = max(1, -(-IMCU_WIDTH.get(subsamp, 8) // s))
        x0, y0, x1, y1 = box
        left = max(0, (x0 - 1) // step * step)
        region = _Region(left, 0, min(sw, x1 + step) - left, min(sh, y1 + 16))
        self._check(self.lib.tj3SetScalingFactor(self.handle, _Scaling(1, s)))
        self._check(self.lib.tj3SetCroppingRegion(self.handle, region))
        out = np.empty((region.h, region.w, 3), np.uint8)
        self._check(self.lib.tj3Decompress8(self.handle, data, len(data), out.ctypes.data,
                                            region.w * 3, PF_RGB))
        return out[y0:y1, x0 - left:x1 - left]


def crop_sample(dec: CropDecoder, path: Path, size: int, epoch: int,
                index: int) -> torch.Tensor:
    """:func:`~hpclb.data.transforms.decode_train` (seed 0) with the region decode."""
    data = path.read_bytes()
    width, height, _ = dec.header(data)
    box, flip = T.train_crop(width, height, 0, epoch, index)
    s = T.dct_scale(width, height, -(-width * size // box[2]), -(-height * size // box[3]))
    scaled = T._scaled_box(box, s, -(-width // s), -(-height // s))
    x = torch.from_numpy(dec.decode(data, s, scaled)).permute(2, 0, 1).unsqueeze(0)
    x = T._resize(x, size, size)[0]
    return x.flip(-1) if flip else x


def main(argv=None) -> int:
    """Write the JPEGs, compare the two paths' samples, time them; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--libturbojpeg", required=True, help="a libturbojpeg >= 3.0 shared library")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dec = CropDecoder(args.libturbojpeg)
    with tempfile.TemporaryDirectory() as tmp:
        files = sorted(synthetic_jpegs(Path(tmp), args.images).glob("*/*.jpg"))
        paths = {"fast_simplejpeg": lambda f, e, i: T.decode_train(f, 224, 0, e, i),
                 "crop_region": lambda f, e, i: crop_sample(dec, f, 224, e, i)}
        differ = sum(not torch.equal(*(fn(f, 0, i) for fn in paths.values()))
                     for i, f in enumerate(files))
        print(f"samples that differ: {differ} of {len(files)}; load {os.getloadavg()}")
        rates = {name: [] for name in paths}
        for r in range(args.rounds):
            for name in list(paths)[r % 2:] + list(paths)[:r % 2]:  # alternate the order
                c0 = time.process_time()
                for i, f in enumerate(files):
                    paths[name](f, r, i)
                rates[name].append(len(files) / (time.process_time() - c0))
    for name, x in rates.items():
        print(f"{name}: {statistics.median(x):.0f}/s per core [{min(x):.0f}-{max(x):.0f}]")
    ratios = [c / f for c, f in zip(rates["crop_region"], rates["fast_simplejpeg"])]
    print(f"crop_region / fast_simplejpeg: {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]; load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
