"""The ImageNet path's fast transforms (hpclb/data/transforms.py): a JPEG is decoded at the
smallest DCT scale that still covers its crop at the target resolution, the crop box is the
same one drawn in the original image's pixels, batches are uint8 and normalised on the device
by the task."""
from __future__ import annotations

import io

import pytest
import torch

from hpclb.data import transforms
from hpclb.data.images import IMAGENET_MEAN, IMAGENET_STD, ImageFolder
from hpclb.data.transforms import decode_eval, decode_train, normalize_images, train_crop
from hpclb.tasks import ClassificationTask

pytestmark = pytest.mark.timeout(120)


def _smooth_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A smooth random RGB JPEG (quality 90): low-resolution noise upsampled bicubically, so
    that a shifted crop looks different and a DCT-scaled decode looks the same."""
    import numpy as np
    from PIL import Image

    small = np.random.default_rng(seed).integers(0, 256, (height // 40, width // 40, 3),
                                                 dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _full_decode_reference(data: bytes, box, size: int) -> torch.Tensor:
    """The crop ``box`` (left, top, w, h) of the full-resolution decode, resized: uint8."""
    from PIL import Image

    from hpclb.data.transforms import _pixels, _resize

    left, top, w, h = box
    with Image.open(io.BytesIO(data)) as im:
        return _resize(_pixels(im, (left, top, left + w, top + h)), size, size)[0]


def test_a_jpeg_is_decoded_at_the_smallest_scale_that_covers_its_crop(monkeypatch):
    data = _smooth_jpeg(800, 600)
    calls = []
    real = transforms._draft

    def spy(im, width, height):
        s = real(im, width, height)
        calls.append((s, im.size))
        return s
    monkeypatch.setattr(transforms, "_draft", spy)
    size, scales = 48, set()
    for index in range(60):
        calls.clear()
        x = decode_train(io.BytesIO(data), size, 3, 0, index, decoder="pil")
        assert x.shape == (3, size, size) and x.dtype == torch.uint8
        (left, top, w, h), _ = train_crop(800, 600, 3, 0, index)
        [(s, decoded)] = calls
        assert decoded == (-(-800 // s), -(-600 // s))
        assert w / s >= size and h / s >= size, (index, s)  # still >= the target resolution
        assert s == 8 or w / (2 * s) < size or h / (2 * s) < size  # and no larger than that
        scales.add(s)
    assert len(scales) >= 3, scales  # full-size and scaled decodes both occur


def test_a_drafted_crop_is_the_same_box_as_the_full_decode():
    """Same seed and sample, same crop box as before DCT scaling: the scaled decode is closer
    to the full decode of that box than to the boxes shifted by 8 pixels (one decoded pixel at
    scale 1/8) in any direction, and within a few grey levels of it."""
    data = _smooth_jpeg(800, 600, seed=1)
    size, checked = 32, 0
    for index in range(40):
        (left, top, w, h), flip = train_crop(800, 600, 7, 2, index)
        if min(w, h) < 2 * size or left < 8 or top < 8 or left + w > 792 or top + h > 592:
            continue  # decoded at full size (the box exactly: test_images.py), or at an edge
        got = decode_train(io.BytesIO(data), size, 7, 2, index).float()
        got = got.flip(-1) if flip else got

        def diff(dx, dy):
            ref = _full_decode_reference(data, (left + dx, top + dy, w, h), size)
            return (got - ref.float()).abs().mean().item()
        here = diff(0, 0)
        assert here < 8, (index, here)
        assert all(here < diff(dx, dy) for dx, dy in ((-8, 0), (8, 0), (0, -8), (0, 8))), index
        checked += 1
    assert checked >= 5


def test_eval_view_of_a_large_jpeg_is_scaled_resize_and_centre_crop():
    from PIL import Image

    from hpclb.data.transforms import _pixels, _resize

    data = _smooth_jpeg(800, 600, seed=2)
    got = decode_eval(io.BytesIO(data), 56, 64)  # 85 x 64 after resize: decoded at 1/8 (100 x 75)
    with Image.open(io.BytesIO(data)) as im:
        want = _resize(_pixels(im), 85, 64)[0][:, 4:60, 14:70]
    assert got.shape == (3, 56, 56) and got.dtype == torch.uint8
    assert (got.float() - want.float()).abs().mean() < 3


def test_normalize_images_is_the_imagenet_normalisation_on_any_device():
    x = torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8)
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    want = (x.float() / 255 - mean[:, None, None]) / std[:, None, None]
    got = normalize_images(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    meta = normalize_images(torch.empty(2, 3, 4, 4, dtype=torch.uint8, device="meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.float32  # no host read
    with pytest.raises(TypeError, match="expected uint8"):
        normalize_images(x.float())


class _Recorder(torch.nn.Module):
    """A linear classifier that keeps its last input."""

    def __init__(self, size: int):
        super().__init__()
        self.fc = torch.nn.Linear(3 * size * size, 2)
        self.seen: torch.Tensor | None = None

    def forward(self, x):
        self.seen = x
        return self.fc(x.flatten(1))


def test_the_task_normalises_uint8_batches_where_they_reach_the_device(tmp_path):
    from helpers import noise_image_folder

    from hpclb.comm.local import SelfCommunicator

    root = noise_image_folder(tmp_path, ((30, 20), (20, 30)))
    task = ClassificationTask(ImageFolder(root, image_size=8, augment=True),
                              ImageFolder(root, image_size=8), num_workers=0)
    task.setup(per_rank_batch=4, global_batch=4, rank=0, world_size=1, seed=0, steps_per_epoch=1)
    task.start_epoch(0)
    x, y = task.batch(0)
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 8, 8)
    model = _Recorder(8)
    loss, stats = task.loss(model, (x, y))
    assert model.seen.dtype == torch.float32 and torch.equal(model.seen, normalize_images(x))
    assert loss.ndim == 0 and stats[2].item() == 4
    metrics = task.evaluate(model, SelfCommunicator())
    assert model.seen.dtype == torch.float32 and 0 <= metrics["test_accuracy"] <= 1


def _noisy_jpeg(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    """A JPEG (quality 90) of a gradient plus noise, like the loader benchmark's images: a
    crop shifted by a pixel or two reads clearly different pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = 127.5 + 100 * np.sin((xx[..., None] / width + 2 * yy[..., None] / height) * np.pi
                                + np.arange(3))
    img = np.clip(base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).convert(mode).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_dct_scale_is_the_scale_pil_draft_chooses():
    from PIL import Image

    data = _noisy_jpeg(757, 568)
    for mw, mh in ((757, 568), (378, 1), (379, 10), (190, 142), (189, 143), (95, 71), (94, 70),
                   (40, 30), (1, 1), (1000, 1000)):
        with Image.open(io.BytesIO(data)) as im:
            assert transforms._draft(im, mw, mh) == transforms.dct_scale(757, 568, mw, mh), (mw, mh)


def _simplejpeg_or_skip():
    if transforms.default_decoder() != "simplejpeg":
        pytest.skip("simplejpeg (the jpeg extra, part of 'all') is not installed: "
                    "pip install 'hpclb[jpeg]'")


def _crop(data: bytes, box, size: int, decoder: str) -> torch.Tensor:
    """``box`` (left, top, w, h) of the JPEG ``data`` decoded by ``decoder`` at the DCT scale
    that keeps ``size`` pixels, resized to ``size`` x ``size``: float32, unflipped."""
    def plan(width, height):
        return -(-width * size // box[2]), -(-height * size // box[3]), box, None
    return transforms._resize(transforms._decode(io.BytesIO(data), plan, decoder)[0], size,
                              size)[0].float()


def test_simplejpeg_reads_the_pil_pixels_of_the_same_crop_boxes():
    """Both decoders (libjpeg-turbo's accurate DCT, the same DCT scale and box): at most 2 grey
    levels apart on average, for scaled and full-size decodes, train and eval, and closer than
    PIL's decode of the box moved by 16 pixels (2 at scale 1/8) in any direction."""
    _simplejpeg_or_skip()
    scales = set()
    for k, (width, height) in enumerate(((800, 600), (501, 376), (640, 480))):
        data = _noisy_jpeg(width, height, seed=k)
        for index, size in enumerate((64, 224) * 5):
            pil = decode_train(io.BytesIO(data), size, 5, 1, index, decoder="pil").float()
            sj = decode_train(io.BytesIO(data), size, 5, 1, index, decoder="simplejpeg").float()
            assert sj.shape == pil.shape == (3, size, size)
            here = (sj - pil).abs().mean().item()
            assert here <= 2, (width, index, here)
            (left, top, w, h), flip = train_crop(width, height, 5, 1, index)
            sj = sj.flip(-1) if flip else sj
            for dx, dy in ((-16, 0), (16, 0), (0, -16), (0, 16)):
                x, y = left + dx, top + dy
                if 0 <= x <= width - w and 0 <= y <= height - h:
                    moved = _crop(data, (x, y, w, h), size, "pil")
                    assert here < (sj - moved).abs().mean().item(), (width, index, dx, dy)
            scales.add(transforms.dct_scale(width, height, -(-width * size // w),
                                            -(-height * size // h)))
        for resize, size in ((256, 224), (72, 64)):  # full size, and a DCT-scaled decode
            pil = decode_eval(io.BytesIO(data), size, resize, decoder="pil").float()
            sj = decode_eval(io.BytesIO(data), size, resize, decoder="simplejpeg").float()
            assert sj.shape == pil.shape == (3, size, size)
            assert (sj - pil).abs().mean().item() <= 2
    assert {1, 2} <= scales, scales  # scaled and full-size crops both compared


def test_simplejpeg_leaves_grey_cmyk_corrupt_and_non_jpeg_files_to_pil(tmp_path):
    """Grey JPEGs: the same pixels; CMYK ones and PNGs (even named .jpg) are PIL's; a truncated
    JPEG is rejected, naming the file, with either decoder."""
    from PIL import Image

    from hpclb.errors import DataError

    _simplejpeg_or_skip()
    grey, cmyk = _noisy_jpeg(300, 200, mode="L"), _noisy_jpeg(300, 200, mode="CMYK")
    png = io.BytesIO()
    Image.open(io.BytesIO(grey)).save(png, "PNG")
    for data, bound in ((grey, 2), (cmyk, 0), (png.getvalue(), 0)):
        for index in range(4):
            a = decode_train(io.BytesIO(data), 32, 0, 0, index, decoder="pil").float()
            b = decode_train(io.BytesIO(data), 32, 0, 0, index, decoder="simplejpeg").float()
            assert (a - b).abs().mean().item() <= bound
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cut.jpg").write_bytes(grey[:len(grey) // 2])
    folder = ImageFolder(tmp_path, image_size=32, augment=True)
    with pytest.raises(DataError, match="cut.jpg: cannot read image"):
        folder.sample(0)


def test_a_decoder_is_named_or_its_extra_is_asked_for(monkeypatch):
    import sys

    from hpclb.errors import MissingExtraError

    data = _noisy_jpeg(80, 60)
    with pytest.raises(ValueError, match="decoder: 'turbo' is not one of pil, simplejpeg"):
        decode_train(io.BytesIO(data), 32, 0, 0, 0, decoder="turbo")
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import simplejpeg -> ModuleNotFoundError
    transforms._simplejpeg.cache_clear()
    try:
        assert transforms.default_decoder() == "pil"
        assert decode_eval(io.BytesIO(data), 32, 40).shape == (3, 32, 32)  # PIL decodes
        with pytest.raises(MissingExtraError, match=r"pip install 'hpclb\[jpeg\]'"):
            decode_eval(io.BytesIO(data), 32, 40, decoder="simplejpeg")
    finally:
        monkeypatch.undo()
        transforms._simplejpeg.cache_clear()
