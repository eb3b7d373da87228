"""Encoded images (JPEG, PNG, ...) to uint8 tensors: the ImageNet path's per-sample transforms.

Training (:func:`decode_train`): the sample's seeded crop box is drawn in the original image's
pixels first (:func:`train_crop`, torchvision's ``RandomResizedCrop`` draws); then the decoder
is asked for the smallest version of the image in which that box still covers at least
``size`` x ``size`` pixels (libjpeg-turbo's DCT scaling by 1/2, 1/4 or 1/8, :func:`dct_scale`; other
formats decode at full size), the box is mapped to the decoded image (divided by the scale,
rounded to whole pixels: exact when nothing was scaled), cut out and resized to ``size`` x
``size`` (bilinear with antialiasing, ``torch.nn.functional.interpolate`` on uint8, as
torchvision's tensor transforms resize), then flipped when the sample's draw says so.
Evaluation (:func:`decode_eval`): shorter side to ``resize`` (the decoder scales down by at most
as much), centre crop ``size``.

JPEGs are decoded by one of three decoders, all libjpeg-turbo with its accurate DCT and
upsampling at the same scale (tests/test_transforms.py compares their pixels), the first
available being the default (:func:`default_decoder`):

* ``"libjpeg"``: ``hpclb.data._jpeg_region``, a C extension built with hpclb where a compiler
  and libjpeg-turbo's headers were there (Debian's ``libjpeg-dev``; ``setup.py``). It decodes
  only the rows down to the crop's last one and inverse-transforms only the crop's columns
  (``jpeg_crop_scanline``, ``jpeg_skip_scanlines``): the same pixels as a whole-image decode,
  which is what a train crop pays for elsewhere. A JPEG with a restart marker after every MCU
  (:func:`add_restart_markers`; ``hpclb data shards --restart-markers``) is entered at the
  crop's MCUs: only they are Huffman-decoded, not every row above the crop and every column
  beside it;
* ``"simplejpeg"`` (the ``jpeg`` extra): the whole image into a numpy array, cut as a view;
* ``"pil"``: PIL's decoder, which also decodes every other format and the JPEGs the other two
  refuse (CMYK, corrupt), so the same pixels up to the libjpeg-turbo versions.

Both return uint8 ``[3, size, size]``: a batch is 4x smaller than float32 to stack, pin and copy
to the device, where :func:`normalize_images` turns it into the model's float32 input.
"""
from __future__ import annotations

import functools
import io
import math

import torch
import torch.nn.functional as F

__all__ = ["CROP_RATIO", "CROP_SCALE", "CROP_TRIES", "DECODERS", "IMAGENET_MEAN",
           "IMAGENET_STD", "EncodedImages", "add_restart_markers", "dct_scale", "decode_eval",
           "decode_train", "default_decoder", "normalize_images", "random_resized_crop_box",
           "sample_seed", "train_crop"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# RandomResizedCrop's bounds in the common reference (torchvision.transforms.RandomResizedCrop,
# the ImageNet training transform of Goyal et al. 2017 and You et al.'s LARS runs): crop area a
# fraction U[0.08, 1] of the image, aspect ratio w/h log-uniform in [3/4, 4/3], 10 tries.
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
DECODERS = ("pil", "simplejpeg", "libjpeg")  # JPEG decoders; PIL decodes other formats
_MASK64 = (1 << 64) - 1


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
    (:func:`random_resized_crop_box`, pixels of the original ``width`` x ``height`` image) and
    whether it is flipped left-right (p = 0.5), both from a ``torch.Generator`` seeded with
    :func:`sample_seed` ``(seed, epoch, index)``, so the same on whichever rank reads the sample
    and after a resumption."""
    gen = torch.Generator().manual_seed(sample_seed(seed, epoch, index))
    box = random_resized_crop_box(width, height, gen)
    return box, bool(torch.rand(1, generator=gen).item() < 0.5)


def dct_scale(width: int, height: int, min_width: int, min_height: int) -> int:
    """The JPEG DCT scale (1, 2, 4 or 8 original pixels per decoded pixel) at which a
    ``width`` x ``height`` image still decodes to at least ``min_width`` x ``min_height``
    pixels: the largest with ``scale <= min(width // min_width, height // min_height)``, as
    PIL's ``draft`` chooses it (so both decoders see the same pixels' grid). Decoded size:
    ``ceil(width / scale)`` x ``ceil(height / scale)``."""
    most = min(width // max(1, min_width), height // max(1, min_height))
    return next(s for s in (8, 4, 2, 1) if s <= max(1, most))


def _draft(im, width: int, height: int) -> int:
    """Ask ``im``'s decoder for its smallest version of at least ``width`` x ``height`` pixels
    (JPEG: DCT scaling by 1/2, 1/4 or 1/8, :func:`dct_scale`; PIL's ``draft``). Returns the
    scale (original pixels per decoded pixel): 1 when the image decodes at full size."""
    full_width = im.size[0]
    drafted = im.draft("RGB", (max(1, width), max(1, height)))
    return 1 if drafted is None else max(1, round(full_width / drafted[1][2]))


def _scaled_box(box, s: int, dw: int, dh: int) -> tuple[int, int, int, int]:
    """``box`` (left, top, w, h; original pixels) in an image decoded at scale ``s`` to
    ``dw`` x ``dh``: (left, top, right, bottom), rounded to whole pixels, at least one pixel,
    inside the image (exactly ``box`` when ``s`` is 1)."""
    left, top, w, h = box
    x0, y0 = min(round(left / s), dw - 1), min(round(top / s), dh - 1)
    return (x0, y0, max(x0 + 1, min(round((left + w) / s), dw)),
            max(y0 + 1, min(round((top + h) / s), dh)))


def _pixels(im, box: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The decoded ``im`` (or its ``box``: left, top, right, bottom) as uint8 ``[1, 3, h, w]``
    (channels-last memory, what the uint8 resize is fastest on), in memory of its own."""
    if im.mode != "RGB":
        im = im.convert("RGB")
    if box is not None:
        im = im.crop(box)
    width, height = im.size
    pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1).unsqueeze(0)


def _resize(x: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """uint8 ``[1, 3, h, w]`` to uint8 ``[1, 3, height, width]``, bilinear with antialiasing."""
    if x.shape[-2:] == (height, width):
        return x
    return F.interpolate(x, size=(height, width), mode="bilinear", antialias=True,
                         align_corners=False)


@functools.lru_cache(maxsize=None)
def _simplejpeg():
    """The ``simplejpeg`` module (the ``jpeg`` extra), or None where it is not installed."""
    from hpclb.errors import MissingExtraError
    from hpclb.extras import require

    try:
        return require("simplejpeg", "decoding JPEGs with libjpeg-turbo")
    except MissingExtraError:
        return None


@functools.lru_cache(maxsize=None)
def _jpeg_region():
    """The ``hpclb.data._jpeg_region`` C extension, or None where it was not built."""
    import importlib

    try:
        return importlib.import_module("hpclb.data._jpeg_region")
    except ImportError:
        return None


def _region_decoder(purpose: str = "decoder='libjpeg'", instead: str | None = None):
    """The region decoder module; MissingExtraError naming the fix where it was not built:
    ``purpose`` needs it; ``instead``, what to do without it (default: use simplejpeg)."""
    lib = _jpeg_region()
    if lib is None:
        from hpclb.errors import MissingExtraError
        if instead is None:
            instead = "use decoder='simplejpeg' (pip install 'hpclb[jpeg]'), the same pixels"
        raise MissingExtraError(
            f"{purpose} needs hpclb's region decoder (hpclb.data._jpeg_region), which was not "
            "built: install a C compiler and libjpeg-turbo's headers (Debian: apt-get install "
            f"gcc libjpeg-dev), then reinstall hpclb (pip install -e .); or {instead}")
    return lib


def add_restart_markers(data: bytes) -> bytes:
    """The JPEG ``data`` with a restart marker after every MCU (16 x 16 pixels for 4:2:0),
    losslessly: its DCT coefficients are copied, not re-encoded, so every decoder gives the
    same pixels (``jpegtran -restart 1B -copy all``, libjpeg's transcoding API); sequential
    Huffman coding with optimised tables (a progressive file comes out sequential); APPn and
    COM segments kept. Each MCU costs a marker, the byte alignment before it and its DC
    coefficients coded afresh: a few bytes per MCU (files written with standard tables, which
    the transcode optimises, can come out smaller; docs/recipes.md). The region decoder
    (``"libjpeg"``) then decodes a train crop's MCUs alone. About 5 ms per ImageNet-sized
    image on one core (``hpclb data shards --restart-markers`` does it while packing). Raises
    ValueError for a JPEG libjpeg cannot read (corrupt, truncated) or one other than YCbCr or
    grey (CMYK: keep such a file as it is), MissingExtraError where the region decoder was
    not built."""
    return _region_decoder("add_restart_markers", "keep the file as it is").add_restart_markers(
        data)


def default_decoder() -> str:
    """The JPEG decoder a sample uses unless told: ``"libjpeg"`` where hpclb's region decoder
    was built, else ``"simplejpeg"`` where that package (the ``jpeg`` extra, part of ``all``)
    is installed, else ``"pil"``."""
    if _jpeg_region() is not None:
        return "libjpeg"
    return "pil" if _simplejpeg() is None else "simplejpeg"


def _decode_pil(src, plan):
    """``plan`` (:func:`_decode`) carried out with PIL; ``(x uint8 [1, 3, h, w], extra)``."""
    from hpclb.extras import require

    Image = require("PIL.Image", "reading ImageFolder images")
    with Image.open(src) as im:
        width, height = im.size
        min_width, min_height, box, extra = plan(width, height)
        s = _draft(im, min_width, min_height)
        return _pixels(im, None if box is None else _scaled_box(box, s, *im.size)), extra


def _decode_simplejpeg(data: bytes, plan):
    """``plan`` (:func:`_decode`) carried out with simplejpeg (libjpeg-turbo: the accurate DCT
    and upsampling, PIL's; the scale of :func:`dct_scale`). Raises ValueError where it does not
    decode ``data``: a JPEG other than YCbCr or grey (CMYK: PIL converts it), a corrupt or
    truncated one."""
    sj = _simplejpeg()
    height, width, colorspace, _ = sj.decode_jpeg_header(data)
    if colorspace not in ("YCbCr", "Gray"):  # CMYK, YCCK, RGB: PIL's conversions, as before
        raise ValueError(f"a {colorspace} JPEG")
    min_width, min_height, box, extra = plan(width, height)
    s = dct_scale(width, height, min_width, min_height)
    x = torch.from_numpy(sj.decode_jpeg(data, "RGB", fastdct=False, fastupsample=False,
                                        min_height=-(-height // s), min_width=-(-width // s)))
    if box is not None:
        x0, y0, x1, y1 = _scaled_box(box, s, x.shape[1], x.shape[0])
        x = x[y0:y1, x0:x1]
    return x.permute(2, 0, 1).unsqueeze(0), extra


def _decode_libjpeg(data: bytes, plan):
    """``plan`` (:func:`_decode`) carried out by the region decoder (the accurate DCT and
    upsampling; the scale of :func:`dct_scale`; only the box's pixels inverse-transformed).
    Raises ValueError where it does not decode ``data``: a JPEG other than YCbCr or grey, a
    corrupt or truncated one."""
    lib = _jpeg_region()
    width, height = lib.image_size(data)
    min_width, min_height, box, extra = plan(width, height)
    s = dct_scale(width, height, min_width, min_height)
    decoded = -(-width // s), -(-height // s)  # libjpeg's size at 1/s: rounded up
    region = (0, 0, *decoded) if box is None else _scaled_box(box, s, *decoded)
    x0, y0, x1, y1 = region
    pixels = torch.frombuffer(lib.decode_region(data, s, region), dtype=torch.uint8)
    return pixels.view(y1 - y0, x1 - x0, 3).permute(2, 0, 1).unsqueeze(0), extra


def _decode(src, plan, decoder: str | None):
    """Decode the encoded image ``src`` (a path or a binary file object) as ``plan(width,
    height) -> (min_width, min_height, box, extra)`` asks, given its size: at the smallest DCT
    scale that keeps ``min_width`` x ``min_height`` pixels, cut to ``box`` (left, top, w, h in
    original pixels; None: the whole image). Returns ``(x uint8 [1, 3, h, w], extra)``.
    ``decoder``: ``"libjpeg"`` or ``"simplejpeg"`` (JPEGs it can decode; PIL the rest),
    ``"pil"``, or None (:func:`default_decoder`). Raises OSError (PIL's) for an unreadable
    image, ValueError for another decoder name, MissingExtraError for one not installed."""
    decoder = default_decoder() if decoder is None else decoder
    if decoder not in DECODERS:
        raise ValueError(f"decoder: {decoder!r} is not one of {', '.join(DECODERS)}")
    if decoder == "pil":
        return _decode_pil(src, plan)
    if decoder == "libjpeg":
        _region_decoder()  # raises MissingExtraError naming the fix where it was not built
    if decoder == "simplejpeg" and _simplejpeg() is None:
        from hpclb.extras import require
        require("simplejpeg", "decoder='simplejpeg'")  # raises MissingExtraError naming the fix
    if hasattr(src, "read"):
        data = src.read()
    else:
        with open(src, "rb") as f:
            data = f.read()
    if data[:3] == b"\xff\xd8\xff":  # a JPEG's start-of-image marker
        try:
            if decoder == "libjpeg":
                return _decode_libjpeg(data, plan)
            return _decode_simplejpeg(data, plan)
        except ValueError:
            pass  # CMYK, or corrupt: PIL decodes or rejects it, as without these decoders
    return _decode_pil(io.BytesIO(data), plan)


def decode_train(src, size: int, seed: int, epoch: int, index: int,
                 decoder: str | None = None) -> torch.Tensor:
    """Sample ``index``'s training view in ``epoch`` (module docstring): the encoded image
    ``src`` (a path or a binary file object) cropped by :func:`train_crop` ``(width, height,
    seed, epoch, index)``, resized and maybe flipped: uint8 ``[3, size, size]``. ``decoder``:
    ``"libjpeg"``, ``"simplejpeg"``, ``"pil"`` or None (:func:`default_decoder`). Raises
    OSError (PIL's) for an unreadable image, ValueError for another decoder name."""
    def plan(width, height):
        box, flip = train_crop(width, height, seed, epoch, index)
        return -(-width * size // box[2]), -(-height * size // box[3]), box, flip

    x, flip = _decode(src, plan, decoder)
    x = _resize(x, size, size)[0]
    return x.flip(-1) if flip else x


def decode_eval(src, size: int, resize: int, decoder: str | None = None) -> torch.Tensor:
    """The evaluation view of the encoded image ``src`` (a path or a binary file object):
    shorter side to ``resize``, centre ``size`` x ``size`` crop (``resize >= size``): uint8
    ``[3, size, size]``. ``decoder`` as for :func:`decode_train`. Raises OSError (PIL's) for
    an unreadable image, ValueError for another decoder name."""
    def plan(width, height):
        scale = resize / min(width, height)
        rw, rh = max(size, round(width * scale)), max(size, round(height * scale))
        return rw, rh, None, (rw, rh)

    x, (rw, rh) = _decode(src, plan, decoder)
    x = _resize(x, rw, rh)[0]
    left, top = (rw - size) // 2, (rh - size) // 2
    return x[:, top:top + size, left:left + size]


@functools.lru_cache(maxsize=None)
def _statistics(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``255 * mean`` and ``255 * std`` as float32 ``[1, 3, 1, 1]`` on ``device``, made once."""
    def stat(values):
        return torch.tensor(values, dtype=torch.float32).mul_(255).view(1, 3, 1, 1).to(device)
    return stat(IMAGENET_MEAN), stat(IMAGENET_STD)


def normalize_images(x: torch.Tensor) -> torch.Tensor:
    """uint8 images ``[b, 3, H, W]`` (on any device) to the model's float32 input on the same
    device: ``(x / 255 - mean) / std`` per channel with the ImageNet statistics. No host read;
    the statistics are copied to a device once. Raises TypeError for another dtype."""
    if x.dtype != torch.uint8:
        raise TypeError(f"normalize_images: expected uint8 images [b, 3, H, W], got {x.dtype}")
    mean, std = _statistics(x.device)
    return (x.to(torch.float32) - mean) / std


def _unreadable(e: Exception) -> bool:
    """Whether ``e`` says an image cannot be read: OSError (PIL's, a file's), or PIL's refusal of
    an image of more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (not an OSError)."""
    if isinstance(e, OSError):
        return True
    try:
        from PIL.Image import DecompressionBombError
    except ImportError:  # without PIL (the experiments extra) no decoder raises it
        return False
    return isinstance(e, DecompressionBombError)


class EncodedImages:
    """Base of the splits that decode one encoded image per sample (an ImageFolder, tar
    shards): ``sample``, ``batch``, ``set_epoch``, ``normalize``. A subclass defines ``len()``,
    ``subset(n)`` and ``_source(index) -> (src, label, name)``: the encoded image (a path or a
    binary file object), its class id and its name for errors.

    ``augment`` True: :func:`decode_train` with the draws of ``(seed, epoch, index)``; False:
    :func:`decode_eval` (shorter side ``resize``, centre crop ``image_size``). Batches are uint8
    ``[b, 3, image_size, image_size]``; :meth:`normalize` makes the model's float32 input on the
    device (the task calls it once the batch is there).
    """

    def __init__(self, image_size: int, resize: int, augment: bool, seed: int):
        self.image_size, self.resize = int(image_size), int(resize)
        self.augment, self.seed, self.epoch = bool(augment), int(seed), 0

    normalize = staticmethod(normalize_images)

    def _source(self, index: int):
        raise NotImplementedError

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        """Draw the augmentation of ``epoch`` (and of run seed ``seed``, if given) from now on."""
        self.epoch = int(epoch)
        if seed is not None:
            self.seed = int(seed)

    def sample(self, index: int, epoch: int | None = None) -> tuple[torch.Tensor, int]:
        """Sample ``index``: ``(x, y)``, x uint8 ``[3, image_size, image_size]``, y its class
        id; augmented as in ``epoch`` (default the epoch of :meth:`set_epoch`). A DataLoader
        worker passes the epoch with the index (its copy of the split never sees set_epoch).
        Raises DataError naming the image when it cannot be read."""
        from hpclb.errors import DataError

        index = int(index)
        epoch = self.epoch if epoch is None else int(epoch)
        src, label, name = self._source(index)
        try:
            if self.augment:
                x = decode_train(src, self.image_size, self.seed, epoch, index)
            else:
                x = decode_eval(src, self.image_size, self.resize)
        except Exception as e:
            if not _unreadable(e):
                raise
            raise DataError(f"{name}: cannot read image ({e})") from e
        return x, int(label)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices``: x uint8 ``[b, 3, image_size, image_size]``, y int64 ``[b]``."""
        items = [self.sample(int(i)) for i in indices]
        if not items:  # an empty share (a short last step)
            size = self.image_size
            return (torch.zeros(0, 3, size, size, dtype=torch.uint8),
                    torch.zeros(0, dtype=torch.int64))
        return (torch.stack([x for x, _ in items]),
                torch.tensor([c for _, c in items], dtype=torch.int64))
