"""Image loader benchmark (``make bench-loader``, issue 28: ">= 800 images/s per core for the
train transform", against the path before it).

``hpclb bench loader`` writes ``--images`` synthetic ImageNet-sized JPEGs (``500x375`` to
``800x600``, 4:3, a colour gradient plus Gaussian noise of a per-image strength, quality 90:
about ImageNet's 110 KB mean file size; the JSON records the mean) into a temporary ImageFolder
and times, in this one process with one torch thread, each transform over all of them, round
by round in rotated order (rates per CPU second of this process: per core, also while other jobs
share the machine; ``wall_images_per_s`` per wall second):

* ``current``: the path before issue 28, kept here as :func:`reference_sample`: PIL decodes the
  whole JPEG, crops and resizes it, converts to float32 and normalises on the CPU;
* ``fast_pil``, ``fast_simplejpeg`` (where simplejpeg, the ``jpeg`` extra, is installed),
  ``fast_libjpeg`` (where hpclb's region decoder was built):
  :func:`hpclb.data.transforms.decode_train` / ``decode_eval`` with that JPEG decoder: decoded
  only at the resolution the crop needs (DCT scaling; ``libjpeg``: only the crop's region),
  uint8, normalised later on the device; ``fast`` in the JSON names the one a run uses
  (:func:`~hpclb.data.transforms.default_decoder`);
* ``fast_shards``: the samples a run reads from tar shards
  (:class:`hpclb.data.shards.TarShards`, written from that folder; the default decoder);
* ``fast_libjpeg_restarts``, ``fast_shards_restarts`` (where the region decoder was built):
  the same with every JPEG given a restart marker after each MCU
  (:func:`hpclb.data.transforms.add_restart_markers`, a lossless transcode: the same pixels;
  ``hpclb data shards --restart-markers`` writes shards so): the region decoder enters a
  file at the crop's MCUs and Huffman-decodes only them. ``fast_shards_restarts`` is the path
  for a GPU node (``gpu_node_path``); ``train_meets_target`` is its train rate against the
  target (``fast_shards`` where the region decoder was not built);
* ``full_decode_pil``, ``full_decode_simplejpeg``, ``full_decode_libjpeg``: that decoder's
  decode of the whole image and nothing else, the floor of any path that decodes every pixel
  with it (a ``fast_`` path beats it where DCT scaling applies, or by decoding only a region).

``train`` is the augmenting transform (random-resized crop 224 + flip, the same seeded crop
boxes in every variant), ``eval`` the resize-256 + centre-crop-224 one. Rates are medians over
rounds of images/s; ``speedup`` the median of the per-round ratios of each ``fast_`` variant to
``current``; ``simplejpeg_over_pil``, ``libjpeg_over_simplejpeg`` and
``libjpeg_restarts_over_libjpeg`` those of ``fast_simplejpeg`` to ``fast_pil``,
``fast_libjpeg`` to ``fast_simplejpeg`` and ``fast_libjpeg_restarts`` to ``fast_libjpeg``
(where both ran). ``setup.restart_markers``: the transcode's CPU ms per image and the files'
size against the originals. ``batch_bytes``: one ``--batch-size`` batch's ``x`` and ``y`` as
each path hands it to the host-to-device copy. Writes ``results/bench_loader.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hpclb.bench.launch import save
from hpclb.bench.measure import round_order
from hpclb.extras import installed_version

__all__ = ["SIZES", "TARGET_IMAGES_PER_S", "add_run_arguments", "driver", "measure",
           "reference_sample", "synthetic_jpegs"]

TARGET_IMAGES_PER_S = 800.0  # per core, train transform (issue 28)
SIZES = ((500, 375), (800, 600))  # the smallest and largest synthetic image, 4:3
NOISE = (6.0, 16.0)  # Gaussian noise std (grey levels): files of about ImageNet's 110 KB mean
QUALITY = 90


def synthetic_jpegs(root: Path, n: int, seed: int = 0, classes: int = 2) -> Path:
    """``root/<class>/<i>.jpg``: ``n`` JPEGs (quality 90) of widths uniform in 500-800 (4:3), a
    random-direction colour gradient plus Gaussian noise (std uniform in 6-16 grey levels),
    dealt round-robin to ``classes`` classes; the same files for the same ``seed``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        w = int(rng.integers(SIZES[0][0], SIZES[1][0] + 1))
        h = round(w * 3 / 4)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        a, b = rng.uniform(-1, 1, (2, 3))
        base = 127.5 + 127.5 * np.sin((a * xx[..., None] / w + b * yy[..., None] / h) * np.pi)
        img = base + rng.normal(0, rng.uniform(*NOISE), (h, w, 3))
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
            root / f"c{i % classes}" / f"{i:06d}.jpg", quality=QUALITY)
    return root


def reference_sample(path: Path, size: int, resize: int, augment: bool, seed: int, epoch: int,
                     index: int):
    """The ImageFolder sample before issue 28: float32 ``[3, size, size]``, normalised. PIL
    decodes the whole image; ``augment``: the :func:`~hpclb.data.images.train_crop` box is cut
    out, resized (PIL bilinear) and flipped; else shorter side ``resize``, centre crop."""
    import numpy as np
    import torch
    from PIL import Image

    from hpclb.data.images import IMAGENET_MEAN, IMAGENET_STD, train_crop

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        if augment:
            (left, top, cw, ch), flip = train_crop(w, h, seed, epoch, index)
            im = im.crop((left, top, left + cw, top + ch)).resize((size, size), Image.BILINEAR)
            if flip:
                im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            scale = resize / min(w, h)
            im = im.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - size) // 2, (h - size) // 2
            im = im.crop((left, top, left + size, top + size))
        arr = np.asarray(im, dtype=np.float32) / 255.0
    t = torch.from_numpy(arr).permute(2, 0, 1)
    return (t - torch.tensor(IMAGENET_MEAN)[:, None, None]) / \
        torch.tensor(IMAGENET_STD)[:, None, None]


def _variants(root: Path, shards: Path, size: int, resize: int,
              restarts: tuple[Path, Path] | None = None) -> dict:
    """{transform: {variant: fn(index, epoch) -> x}} over the folder's samples (the
    simplejpeg and libjpeg variants where they are installed; ``restarts``: the folder and
    the shard set with restart markers, timed as ``fast_libjpeg_restarts`` and
    ``fast_shards_restarts``)."""
    from PIL import Image

    from hpclb.data import transforms
    from hpclb.data.images import ImageFolder
    from hpclb.data.shards import TarShards
    from hpclb.extras import require

    files = [path for path, _ in ImageFolder(root).files]
    marked = None if restarts is None else [path for path, _ in ImageFolder(restarts[0]).files]
    decoders = (["pil"] + (["simplejpeg"] if transforms._simplejpeg() is not None else [])
                + (["libjpeg"] if transforms._jpeg_region() is not None else []))

    def full_decode_pil(i, e):
        with Image.open(files[i]) as im:
            im.load()

    def full_decode_simplejpeg(i, e):
        require("simplejpeg", "the benchmark").decode_jpeg(
            files[i].read_bytes(), "RGB", fastdct=False, fastupsample=False)

    def full_decode_libjpeg(i, e):
        data = files[i].read_bytes()
        lib = transforms._jpeg_region()
        lib.decode_region(data, 1, (0, 0, *lib.image_size(data)))

    out = {}
    for transform, augment in (("train", True), ("eval", False)):
        tars = TarShards(shards, size, resize, augment=augment)

        def current(i, e, augment=augment):
            return reference_sample(files[i], size, resize, augment, 0, e, i)

        def fast(decoder, augment=augment):
            if augment:
                return lambda i, e: transforms.decode_train(files[i], size, 0, e, i, decoder)
            return lambda i, e: transforms.decode_eval(files[i], size, resize, decoder)
        out[transform] = {"current": current,
                          **{f"fast_{d}": fast(d) for d in decoders},
                          "fast_shards": lambda i, e, s=tars: s.sample(i, e)[0],
                          "full_decode_pil": full_decode_pil}
        if "simplejpeg" in decoders:
            out[transform]["full_decode_simplejpeg"] = full_decode_simplejpeg
        if "libjpeg" in decoders:
            out[transform]["full_decode_libjpeg"] = full_decode_libjpeg
        if marked is not None:
            marked_tars = TarShards(restarts[1], size, resize, augment=augment)
            out[transform]["fast_libjpeg_restarts"] = (
                (lambda i, e: transforms.decode_train(marked[i], size, 0, e, i, "libjpeg"))
                if augment else
                (lambda i, e: transforms.decode_eval(marked[i], size, resize, "libjpeg")))
            out[transform]["fast_shards_restarts"] = lambda i, e, s=marked_tars: s.sample(i, e)[0]
    return out


def measure(root: Path, shards: Path, n: int, rounds: int, size: int = 224,
            resize: int = 256, restarts: tuple[Path, Path] | None = None) -> tuple[dict, dict]:
    """Images per CPU second and per wall second of every transform and variant (``restarts``:
    :func:`_variants`'s):
    ``({transform: {variant: [per round]}}, the same for wall time)``. This process's CPU time
    (one torch thread, PIL decodes in this thread) is what "per core" means on a machine shared
    with other jobs; wall time counts the time slices they took too."""
    cpu: dict = {}
    wall: dict = {}
    for transform, fns in _variants(root, shards, size, resize, restarts).items():
        names = list(fns)
        cpu[transform], wall[transform] = {v: [] for v in names}, {v: [] for v in names}
        for r in range(rounds):
            for v in round_order(names, r):
                c0, w0 = time.process_time(), time.perf_counter()
                for i in range(n):
                    fns[v](i, r)
                cpu[transform][v].append(n / max(time.process_time() - c0, 1e-9))
                wall[transform][v].append(n / (time.perf_counter() - w0))
    return cpu, wall


def _batch_bytes(root: Path, batch: int, size: int) -> dict:
    """Bytes of one batch's ``x`` and ``y`` as each path hands it over (float32 / uint8)."""
    import torch

    from hpclb.data.images import ImageFolder

    folder = ImageFolder(root, size, augment=True)
    x, y = folder.batch(torch.arange(min(batch, len(folder))))
    per_sample = x[0].numel() * x.element_size() + y.element_size()
    return {"batch_size": batch, "current": batch * (x[0].numel() * 4 + y.element_size()),
            "fast": batch * per_sample, "x_dtype": {"current": "float32", "fast": str(x.dtype)}}


def _scaled_fraction(root: Path, n: int, rounds: int, size: int) -> float:
    """Fraction of the train crops at least ``2 * size`` pixels on both sides: those decoded
    at a DCT scale of 1/2 or smaller."""
    from PIL import Image

    from hpclb.data.images import ImageFolder, train_crop

    folder, scaled = ImageFolder(root, size, augment=True), 0
    for r in range(rounds):
        for i in range(n):
            with Image.open(folder.files[i][0]) as im:
                (_, _, w, h), _ = train_crop(*im.size, 0, r, i)
                scaled += min(w, h) >= 2 * size
    return scaled / (n * rounds)


def report(rates: tuple[dict, dict], setup: dict, batch_bytes: dict, scaled: float,
           load: tuple) -> dict:
    """The JSON document of a run (``rates``: :func:`measure`'s)."""
    from hpclb.data.transforms import default_decoder

    rates, wall = rates
    fast = f"fast_{default_decoder()}"
    med = {t: {v: statistics.median(x) for v, x in vs.items()} for t, vs in rates.items()}
    gpu_node = "fast_shards_restarts" if "fast_shards_restarts" in med["train"] else "fast_shards"
    speedup = {t: {v: statistics.median(f / c for f, c in zip(x, vs["current"]))
                   for v, x in vs.items() if v.startswith("fast_")} for t, vs in rates.items()}
    return {
        "benchmark": "hpclb bench loader", "target_images_per_s_per_core": TARGET_IMAGES_PER_S,
        "fast": fast, "gpu_node_path": gpu_node,
        "train_meets_target": med["train"][gpu_node] >= TARGET_IMAGES_PER_S,
        "images_per_s_per_core": med, "speedup": speedup, "batch_bytes": batch_bytes,
        **{f"{a}_over_{b}": {t: statistics.median(x / y for x, y in zip(
            vs[f"fast_{a}"], vs[f"fast_{b}"])) for t, vs in rates.items()
            if f"fast_{a}" in vs and f"fast_{b}" in vs}
           for a, b in (("simplejpeg", "pil"), ("libjpeg", "simplejpeg"),
                        ("libjpeg_restarts", "libjpeg"))},
        "wall_images_per_s": {t: {v: statistics.median(x) for v, x in vs.items()}
                              for t, vs in wall.items()},
        "train_crops_dct_scaled_fraction": scaled, "per_round": rates, "setup": setup,
        "conditions": {"cpus": os.cpu_count(), "loadavg_start": load[0],
                       "loadavg_end": os.getloadavg(), "python": sys.version.split()[0]}}


def _libjpeg_version() -> str | None:
    """The libjpeg-turbo version whose headers the region decoder was built with ("2.1.5"),
    None where it was not built."""
    from hpclb.data import transforms

    lib = transforms._jpeg_region()
    number = getattr(lib, "LIBJPEG_TURBO_VERSION", None)
    if number is None:
        return None if lib is None else "not libjpeg-turbo"
    return f"{number // 1000000}.{number // 1000 % 1000}.{number % 1000}"


def _restart_marked_copies(root: Path, tmp: Path, files: list[Path],
                           n: int) -> tuple[tuple[Path, Path], dict]:
    """``root``'s JPEGs with restart markers (the same names under ``tmp/train_restarts``) and
    a shard set written from them with ``hpclb data shards --restart-markers``'s
    :func:`~hpclb.data.shard_writer.write_shards`; returns ``((folder, shards), setup)``, the
    transcode's CPU ms per image (median over the files) and size against the originals."""
    from hpclb.data.shard_writer import write_shards
    from hpclb.data.transforms import add_restart_markers

    folder, cpu_ms, sizes = tmp / "train_restarts", [], [0, 0]
    for path in files:
        data = path.read_bytes()
        c0 = time.process_time()
        marked = add_restart_markers(data)
        cpu_ms.append(1e3 * (time.process_time() - c0))
        dest = folder / path.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(marked)
        sizes[0], sizes[1] = sizes[0] + len(data), sizes[1] + len(marked)
    shards = tmp / "shards_restarts"
    write_shards(root, shards, samples_per_shard=max(1, n // 4), restart_markers=True)
    return (folder, shards), {"transcode_cpu_ms_per_image": statistics.median(cpu_ms),
                              "bytes_over_original": sizes[1] / sizes[0]}


def driver(args) -> int:
    """``hpclb bench loader``: generate the JPEGs, time the variants, write the JSON."""
    import numpy as np
    import PIL
    import torch
    from PIL import features

    from hpclb.data import transforms
    from hpclb.data.shard_writer import write_shards
    from hpclb.data.transforms import default_decoder

    torch.set_num_threads(1)
    load = (os.getloadavg(),)
    with tempfile.TemporaryDirectory(prefix="hpclb-bench-loader-") as tmp:
        root = synthetic_jpegs(Path(tmp) / "train", args.images)
        shards = Path(tmp) / "shards"
        write_shards(root, shards, samples_per_shard=max(1, args.images // 4))
        files = sorted(root.glob("*/*.jpg"))
        file_bytes = [p.stat().st_size for p in files]
        restarts, marked = None, None
        if transforms._jpeg_region() is not None:
            restarts, marked = _restart_marked_copies(root, Path(tmp), files, args.images)
        rates = measure(root, shards, args.images, args.rounds, restarts=restarts)
        batch_bytes = _batch_bytes(root, args.batch_size, 224)
        scaled = _scaled_fraction(root, args.images, args.rounds, 224)
    setup = {"images": args.images, "rounds": args.rounds, "sizes": "500x375 to 800x600 (4:3)",
             "jpeg_quality": QUALITY, "mean_file_bytes": float(np.mean(file_bytes)),
             "image_size": 224, "resize": 256, "torch_threads": 1, "torch": torch.__version__,
             "pillow": PIL.__version__, "libjpeg_turbo": bool(features.check("libjpeg_turbo")),
             "simplejpeg": installed_version("simplejpeg"), "default_decoder": default_decoder(),
             "libjpeg_region": _libjpeg_version(), "restart_markers": marked,
             "note": args.note}
    doc = report(rates, setup, batch_bytes, scaled, load)
    wrote = save(args.out, doc, indent=2)
    med = doc["images_per_s_per_core"]
    for t in med:
        print(f"{t}: " + ", ".join(f"{v} {x:.0f}/s" for v, x in med[t].items()) +
              f" per core; {doc['fast']}/current {doc['speedup'][t][doc['fast']]:.2f}x")
    print(f"batch of {args.batch_size}: {batch_bytes['current']} -> {batch_bytes['fast']} bytes;"
          f" {wrote}")
    return 0


def _count(raw: str) -> int:
    """An integer >= 1 (argparse names the flag and exits 2 otherwise)."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {raw!r}")
    return value


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hpclb bench loader``."""
    p.add_argument("--images", type=_count, default=200, help="synthetic JPEGs (default 200)")
    p.add_argument("--rounds", type=_count, default=5,
                   help="rounds; each times every variant once (default 5)")
    p.add_argument("--batch-size", type=_count, default=256,
                   help="batch for batch_bytes (default 256)")
    p.add_argument("--note", default="", help="free text kept in the JSON (the machine, its load)")
    p.add_argument("--out", default="results/bench_loader.json",
                   help="the JSON file to write (default results/bench_loader.json)")
