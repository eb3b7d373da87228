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
        x = decode_train(io.BytesIO(data), size, 3, 0, index)
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
