"""The ImageNet path's fast transforms (hpclb/data/transforms.py): a JPEG is decoded at the
smallest DCT scale that still covers its crop at the target resolution, the crop box is the
same one drawn in the original image's pixels, batches are uint8 and normalised on the device
by the task."""
from __future__ import annotations

import io

import pytest
import torch
from helpers import noisy_jpeg

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


def test_dct_scale_is_the_scale_pil_draft_chooses():
    from PIL import Image

    data = noisy_jpeg(757, 568)
    for mw, mh in ((757, 568), (378, 1), (379, 10), (190, 142), (189, 143), (95, 71), (94, 70),
                   (40, 30), (1, 1), (1000, 1000)):
        with Image.open(io.BytesIO(data)) as im:
            assert transforms._draft(im, mw, mh) == transforms.dct_scale(757, 568, mw, mh), (mw, mh)


def _simplejpeg_or_skip():
    if transforms._simplejpeg() is None:
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
        data = noisy_jpeg(width, height, seed=k)
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
    grey, cmyk = noisy_jpeg(300, 200, mode="L"), noisy_jpeg(300, 200, mode="CMYK")
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

    data = noisy_jpeg(80, 60)
    with pytest.raises(ValueError, match="decoder: 'turbo' is not one of pil, simplejpeg, libjpeg"):
        decode_train(io.BytesIO(data), 32, 0, 0, 0, decoder="turbo")
    monkeypatch.setitem(sys.modules, "hpclb.data._jpeg_region", None)  # as where it was not built
    transforms._jpeg_region.cache_clear()
    try:
        assert transforms.default_decoder() == ("pil" if transforms._simplejpeg() is None
                                                else "simplejpeg")
        with pytest.raises(MissingExtraError, match="apt-get install gcc libjpeg-dev"):
            decode_train(io.BytesIO(data), 32, 0, 0, 0, decoder="libjpeg")
    finally:
        monkeypatch.undo()
        transforms._jpeg_region.cache_clear()
    monkeypatch.setitem(sys.modules, "hpclb.data._jpeg_region", None)
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import simplejpeg -> ModuleNotFoundError
    transforms._jpeg_region.cache_clear()
    transforms._simplejpeg.cache_clear()
    try:
        assert transforms.default_decoder() == "pil"
        assert decode_eval(io.BytesIO(data), 32, 40).shape == (3, 32, 32)  # PIL decodes
        with pytest.raises(MissingExtraError, match=r"pip install 'hpclb\[jpeg\]'"):
            decode_eval(io.BytesIO(data), 32, 40, decoder="simplejpeg")
    finally:
        monkeypatch.undo()
        transforms._simplejpeg.cache_clear()
        transforms._jpeg_region.cache_clear()


def _region_decoder_or_skip():
    """hpclb's region decoder (a C extension, built where a compiler and libjpeg-dev were
    there) and simplejpeg, whose whole-image decode it is compared with."""
    if transforms._jpeg_region() is None:
        pytest.skip("hpclb.data._jpeg_region was not built: apt-get install gcc libjpeg-dev, "
                    "then pip install -e . (setup.py)")
    _simplejpeg_or_skip()


REGION_CASES = {  # name: (width, height, PIL save options)
    "4:2:0": (640, 480, {}),
    "4:4:4": (501, 377, {"subsampling": 0}),
    "4:2:2": (333, 251, {"subsampling": 1}),
    "progressive": (480, 360, {"progressive": True}),
    "restart markers": (417, 313, {"restart_marker_rows": 1}),
    "grey": (350, 263, {"mode": "L"}),
}


@pytest.mark.parametrize("case", list(REGION_CASES))
def test_the_region_decoder_reads_the_pixels_of_the_whole_image_decode(case):
    """The region decoder (rows below the box not decoded, columns beside it not
    inverse-transformed) gives exactly the pixels simplejpeg's whole-image decode gives, both
    libjpeg-turbo at the same DCT scale: for seeded train crops at full size and DCT-scaled,
    for boxes at every edge and of one pixel, and for the eval transform."""
    import simplejpeg

    _region_decoder_or_skip()
    width, height, save = REGION_CASES[case]
    data = noisy_jpeg(width, height, seed=len(case), **save)
    lib = transforms._jpeg_region()
    assert lib.image_size(data) == (width, height)
    scales = set()
    for index in range(24):
        size = (32, 64, 224)[index % 3]
        a = decode_train(io.BytesIO(data), size, 7, 2, index, decoder="libjpeg")
        b = decode_train(io.BytesIO(data), size, 7, 2, index, decoder="simplejpeg")
        assert a.shape == (3, size, size) and torch.equal(a, b), (case, index, size)
        (_, _, w, h), _ = train_crop(width, height, 7, 2, index)
        scales.add(transforms.dct_scale(width, height, -(-width * size // w),
                                        -(-height * size // h)))
    assert {1, 2} <= scales, scales
    for resize, size in ((256, 224), (80, 64), (40, 32)):
        assert torch.equal(decode_eval(io.BytesIO(data), size, resize, decoder="libjpeg"),
                           decode_eval(io.BytesIO(data), size, resize, decoder="simplejpeg"))
    for s in (1, 2, 4, 8):
        whole = simplejpeg.decode_jpeg(data, "RGB", fastdct=False, fastupsample=False,
                                       min_height=-(-height // s), min_width=-(-width // s))
        dh, dw = whole.shape[:2]
        assert (dw, dh) == (-(-width // s), -(-height // s))
        for x0, y0, x1, y1 in ((0, 0, dw, dh), (0, 0, 1, 1), (dw - 1, dh - 1, dw, dh),
                               (dw // 3, dh // 2, dw - 1, dh), (1, 1, 2, dh), (0, dh // 3, dw, dh // 3 + 1),
                               (dw // 2 - 7, 5, dw // 2 + 9, 6), (dw - 17, 0, dw, dh // 2)):
            got = lib.decode_region(data, s, (x0, y0, x1, y1))
            want = whole[y0:y1, x0:x1]
            assert bytes(got) == want.tobytes(), (case, s, (x0, y0, x1, y1))


def _whole(lib, data: bytes, scale: int):
    """The region decoder's decode of the whole image at ``1/scale``: uint8 numpy (h, w, 3)."""
    import numpy as np

    width, height = lib.image_size(data)
    dw, dh = -(-width // scale), -(-height // scale)
    return np.frombuffer(lib.decode_region(data, scale, (0, 0, dw, dh)), np.uint8).reshape(
        dh, dw, 3)


def test_the_region_decoder_is_right_at_the_last_column_and_for_unusual_sampling():
    """A box of the image's last columns (the crop would be one chroma sample wide: libjpeg
    upsamples that differently), for 4:4:4, 4:2:2 and 4:2:0 at widths 16-47 and every scale,
    against simplejpeg; and JPEGs that PIL cannot write (tests/images): 4:1:1 and 4:4:0
    (cropped by column) against simplejpeg, 4 x 2 and 2 x 4 (libjpeg-turbo 2.1 crops their
    columns wrongly, so they decode at full width) against their own whole-image decode and
    PIL's train crops."""
    import numpy as np
    import simplejpeg
    from conftest import REPO
    from PIL import Image

    _region_decoder_or_skip()
    lib = transforms._jpeg_region()
    checked = 0
    for width in range(16, 48):
        img = np.random.default_rng(width).integers(0, 256, (24, width, 3), dtype=np.uint8)
        for subsampling in (0, 1, 2):
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, "JPEG", quality=90, subsampling=subsampling)
            data = buf.getvalue()
            for s in (1, 2, 4, 8):
                whole = simplejpeg.decode_jpeg(data, "RGB", fastdct=False, fastupsample=False,
                                               min_width=-(-width // s), min_height=-(-24 // s))
                dh, dw = whole.shape[:2]
                for x0 in range(max(0, dw - 18), dw):
                    got = lib.decode_region(data, s, (x0, 0, dw, dh))
                    assert bytes(got) == whole[:, x0:].tobytes(), (width, subsampling, s, x0)
                    checked += 1
    assert checked > 3000
    rng = np.random.default_rng(0)
    for name, size in (("sampling-4x1.jpg", (161, 121)), ("sampling-1x2.jpg", (161, 121)),
                       ("sampling-4x2.jpg", (160, 120)), ("sampling-2x4.jpg", (160, 120))):
        data = (REPO / "tests" / "images" / name).read_bytes()
        assert lib.image_size(data) == size
        usual = name in ("sampling-4x1.jpg", "sampling-1x2.jpg")  # 4:1:1, 4:4:0: simplejpeg's
        for s in (1, 2, 4):
            whole = _whole(lib, data, s)
            if usual:
                assert whole.tobytes() == simplejpeg.decode_jpeg(
                    data, "RGB", fastdct=False, fastupsample=False, min_width=whole.shape[1],
                    min_height=whole.shape[0]).tobytes(), (name, s)
            dh, dw = whole.shape[:2]
            boxes = [(x0, 0, dw, dh) for x0 in range(dw - 8, dw)]  # the last columns
            for _ in range(60):
                x0, y0 = int(rng.integers(0, dw)), int(rng.integers(0, dh))
                boxes.append((x0, y0, int(rng.integers(x0 + 1, dw + 1)),
                              int(rng.integers(y0 + 1, dh + 1))))
            for x0, y0, x1, y1 in boxes:
                got = lib.decode_region(data, s, (x0, y0, x1, y1))
                assert bytes(got) == whole[y0:y1, x0:x1].tobytes(), (name, s, (x0, y0, x1, y1))
        for index in range(6):  # the train transform against simplejpeg's, or PIL's
            a = decode_train(io.BytesIO(data), 32, 0, 0, index, decoder="libjpeg")
            b = decode_train(io.BytesIO(data), 32, 0, 0, index,
                             decoder="simplejpeg" if usual else "pil")
            assert torch.equal(a, b) if usual else (
                (a.float() - b.float()).abs().mean().item() <= 2), (name, index)


def test_the_region_decoder_refuses_a_truncated_file_whatever_the_crop():
    """The rows below a crop are not decoded, so a file cut short there must still be refused
    (its end-of-image marker is looked for, as a whole-image decode reads it): every train
    crop of a JPEG cut to 50 %, 90 %, 99.9 % or missing only its end marker raises, baseline
    and progressive; the whole file decodes."""
    _region_decoder_or_skip()
    lib = transforms._jpeg_region()
    for progressive in (False, True):
        data = noisy_jpeg(480, 360, seed=3, progressive=progressive)
        assert len(lib.decode_region(data, 1, (0, 0, 10, 10))) == 300
        for cut in (data[:len(data) // 2], data[:len(data) * 9 // 10],
                    data[:len(data) * 999 // 1000], data[:-2]):
            for index in range(20):
                def plan(width, height, index=index):  # decode_train's: a 64 x 64 train crop
                    box, _ = train_crop(width, height, 0, 0, index)
                    return -(-width * 64 // box[2]), -(-height * 64 // box[3]), box, None
                with pytest.raises(ValueError, match="JPEG: "):
                    transforms._decode_libjpeg(cut, plan)
            with pytest.raises(ValueError, match="JPEG: "):
                lib.decode_region(cut, 1, (0, 0, 8, 8))


def test_the_region_decoder_leaves_cmyk_corrupt_and_non_jpeg_files_to_pil(tmp_path):
    """CMYK JPEGs and PNGs named .jpg are decoded by PIL, as without the region decoder; a
    truncated or corrupt JPEG raises ValueError in the decoder and is then rejected by PIL,
    naming the file; boxes outside the image and other scales are refused, naming them."""
    from PIL import Image

    from hpclb.errors import DataError

    _region_decoder_or_skip()
    lib = transforms._jpeg_region()
    cmyk, grey = noisy_jpeg(300, 200, mode="CMYK"), noisy_jpeg(300, 200, mode="L")
    png = io.BytesIO()
    Image.open(io.BytesIO(grey)).save(png, "PNG")
    with pytest.raises(ValueError, match="other than YCbCr or grey"):
        lib.image_size(cmyk)
    for data in (cmyk, png.getvalue()):
        for index in range(3):
            assert torch.equal(decode_train(io.BytesIO(data), 32, 0, 0, index, decoder="libjpeg"),
                               decode_train(io.BytesIO(data), 32, 0, 0, index, decoder="pil"))
    cut = grey[:len(grey) // 2]
    with pytest.raises(ValueError, match="JPEG: "):
        lib.decode_region(cut, 1, (0, 0, 300, 200))
    for bad in (b"\xff\xd8\xff", grey[:20], b"\xff\xd8\xff" + bytes(500)):
        with pytest.raises(ValueError, match="JPEG: "):
            lib.image_size(bad)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cut.jpg").write_bytes(cut)
    folder = ImageFolder(tmp_path, image_size=32, augment=True)
    assert transforms.default_decoder() == "libjpeg"
    with pytest.raises(DataError, match="cut.jpg: cannot read image"):
        folder.sample(0)
    for scale, box in ((1, (0, 0, 301, 200)), (2, (0, 0, 150, 101)), (3, (0, 0, 10, 10)),
                       (1, (5, 5, 5, 9)), (1, (-1, 0, 4, 4)), (1, (0, 0, 2**31 - 1, 2**31 - 1)),
                       (1, (0, 0, 100_000, 100_000))):  # checked before anything is allocated
        with pytest.raises(ValueError, match="decode_region"):
            lib.decode_region(grey, scale, box)


def test_an_image_pil_refuses_as_too_large_is_a_data_error_naming_it(tmp_path, monkeypatch):
    """PIL's DecompressionBombError (an image of more than MAX_IMAGE_PIXELS pixels: not an
    OSError) is unreadable like any other image: DataError naming the file, whichever
    decoder."""
    from PIL import Image

    from hpclb.errors import DataError

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "big.png").write_bytes(_png(300, 200))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)  # 300 x 200 > 2 x 20,000: an error
    for augment in (True, False):
        folder = ImageFolder(tmp_path, image_size=32, augment=augment)
        with pytest.raises(DataError, match="big.png: cannot read image"):
            folder.sample(0)


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(noisy_jpeg(width, height))).save(buf, "PNG")
    return buf.getvalue()


def test_the_region_decoder_gives_the_same_pixels_from_several_threads():
    """It releases the GIL while it decodes (a thread pool of loader threads decodes in
    parallel): 4 threads decoding 32 crops at once give the serial pixels."""
    from concurrent.futures import ThreadPoolExecutor

    _region_decoder_or_skip()
    datas = [noisy_jpeg(320 + 16 * k, 240 + 12 * k, seed=k) for k in range(4)]

    def sample(i):
        return decode_train(io.BytesIO(datas[i % 4]), 64, 1, 0, i, decoder="libjpeg")
    serial = [sample(i) for i in range(32)]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(sample, range(32)))
    assert all(torch.equal(a, b) for a, b in zip(serial, threaded))
