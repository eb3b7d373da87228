"""CNN workloads: Fashion-MNIST (real staged files), ImageFolder, synthetic images, ResNets, and
a short real LARS run through the training loop."""
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO
from helpers import noise_image_folder

from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.data import load_dataset
from hpclb.data.images import (
    CROP_RATIO,
    CROP_SCALE,
    ImageFolder,
    SyntheticImages,
    load_fashion_mnist,
    load_imagenet,
    random_resized_crop_box,
    sample_seed,
    train_crop,
)
from hpclb.errors import ConfigError, DataError
from hpclb.models import ResNet50, SmallResNet
from hpclb.tasks import ClassificationTask, build_task
from hpclb.train import loop as train_mod


@pytest.fixture(scope="session")
def fashion_root() -> Path:
    base = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (base / "fashion-mnist" / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"Fashion-MNIST not staged in {base}; run `make data` "
                    f"(hpclb data fetch fashion-mnist)")
    return base


def test_fashion_mnist_real_files(fashion_root):
    train, test = load_fashion_mnist(fashion_root)
    assert (len(train), len(test)) == (60_000, 10_000)
    x, y = train.batch(torch.arange(8))
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert abs(train.images.float().div(255).mean().item() - 0.2860) < 1e-3


def test_missing_fashion_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="hpclb data fetch"):
        load_fashion_mnist(tmp_path)


def test_resnets_shapes_and_size():
    m = ResNet50()
    assert sum(p.numel() for p in m.parameters()) == 25_557_032
    assert m.eval()(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    s = SmallResNet(depth=20)
    assert s(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in s.parameters()) == 272_186
    with pytest.raises(ValueError, match="6n\\+2"):
        SmallResNet(depth=21)


def test_synthetic_images_are_deterministic():
    a = SyntheticImages(100, image_size=32, num_classes=10)
    x1, y1 = a.batch(torch.arange(4, 8))
    x2, y2 = a.batch(torch.arange(4, 8))
    assert x1.shape == (4, 3, 32, 32) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert len(a.subset(10)) == 10 and int(y1.max()) < 10


def test_image_folder_reads_classes_and_pixels(tmp_path):
    from PIL import Image
    for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (40, 30), colour).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    ds = ImageFolder(tmp_path, image_size=16, resize=20)
    assert len(ds) == 4 and ds.classes == ["cat", "dog"]
    x, y = ds.batch(torch.tensor([0, 3]))
    assert x.shape == (2, 3, 16, 16) and x.dtype == torch.uint8 and y.tolist() == [0, 1]
    x = ds.normalize(x)
    assert x.dtype == torch.float32
    assert x[0, 0].mean() > 2 and x[1, 2].mean() > 2  # red cat, blue dog after normalisation
    with pytest.raises(DataError, match="no class"):
        ImageFolder(tmp_path / "cat")


# Odd sizes: landscape, portrait, wide (3.2:1, beyond the 4/3 ratio) and near-square.
ODD_SIZES = ((37, 23), (23, 37), (64, 20), (29, 31))


def _pixels(im) -> torch.Tensor:
    """A PIL RGB image as uint8 ``[3, H, W]``."""
    import numpy as np
    return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)


def _resized(x: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """uint8 ``[3, h, w]`` resized as the reader resizes (bilinear, antialiased, uint8)."""
    return torch.nn.functional.interpolate(x[None], size=(height, width), mode="bilinear",
                                           antialias=True, align_corners=False)[0]


def _close_to_pil(x: torch.Tensor, im) -> None:
    """``x`` (uint8 ``[3, h, w]``) is PIL's bilinear resize ``im`` to one grey level."""
    assert (x.int() - _pixels(im).int()).abs().max() <= 1


def test_image_folder_eval_split_is_resize_and_centre_crop(tmp_path):
    """augment=False (the default, val/test): shorter side to ``resize``, centre crop, exactly;
    within one grey level of PIL's bilinear resize (the reader's path before issue 28)."""
    from PIL import Image
    ds = ImageFolder(noise_image_folder(tmp_path, ODD_SIZES), image_size=16, resize=20)
    assert not ds.augment
    x, _ = ds.batch(torch.arange(len(ds)))
    assert x.dtype == torch.uint8
    for k, (path, _) in enumerate(ds.files):
        with Image.open(path) as im:
            w, h = im.size
            s = 20 / min(w, h)
            size = (round(w * s), round(h * s))
            left, top = (size[0] - 16) // 2, (size[1] - 16) // 2
            want = _resized(_pixels(im), *size)[:, top:top + 16, left:left + 16]
            pil = im.convert("RGB").resize(size, Image.BILINEAR)
            _close_to_pil(x[k], pil.crop((left, top, left + 16, top + 16)))
        assert torch.equal(x[k], want), path
    ds.set_epoch(3, seed=9)  # no effect without augmentation
    assert torch.equal(ds.batch(torch.arange(len(ds)))[0], x)


def test_image_folder_train_augmentation_is_deterministic_per_sample(tmp_path):
    root = noise_image_folder(tmp_path, ODD_SIZES)
    ds = ImageFolder(root, image_size=16, augment=True, seed=5)
    n = len(ds)
    ds.set_epoch(2)
    x, y = ds.batch(torch.arange(n))
    assert x.shape == (n, 3, 16, 16) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert y.tolist() == [0] * 4 + [1] * 4
    assert torch.equal(ds.batch(torch.arange(n))[0], x)
    # another reader (another rank, a resumed run): other order, other batches, same samples
    other = ImageFolder(root, image_size=16, augment=True)
    other.set_epoch(2, seed=5)
    perm = torch.tensor([6, 1, 7, 3, 0, 5, 2, 4])
    got = torch.cat([other.batch(perm[:3])[0], other.batch(perm[3:])[0]])
    assert torch.equal(got, x[perm])
    assert torch.equal(ds.subset(3).batch(torch.arange(3))[0], x[:3])
    ds.set_epoch(3)
    x3 = ds.batch(torch.arange(n))[0]
    assert not any(torch.equal(x3[k], x[k]) for k in range(n))  # new crops every epoch
    ds.set_epoch(2, seed=6)
    assert not any(torch.equal(ds.batch(torch.arange(n))[0][k], x[k]) for k in range(n))


def test_image_folder_train_augmentation_is_crop_resize_flip(tmp_path):
    """Each sample is its train_crop box of the decoded image, resized bilinearly to
    image_size, mirrored when its flip draw says so (PNGs: no DCT scaling, the box exactly);
    within one grey level of PIL's crop + bilinear resize. Both flip cases occur."""
    from PIL import Image
    ds = ImageFolder(noise_image_folder(tmp_path, ODD_SIZES), image_size=12, augment=True, seed=1)
    flips = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        x, _ = ds.batch(torch.arange(len(ds)))
        for k, (path, _) in enumerate(ds.files):
            with Image.open(path) as im:
                im = im.convert("RGB")
                (left, top, w, h), flip = train_crop(*im.size, 1, epoch, k)
                crop = _resized(_pixels(im)[:, top:top + h, left:left + w], 12, 12)
                pil = im.crop((left, top, left + w, top + h)).resize((12, 12), Image.BILINEAR)
            got = x[k].flip(-1) if flip else x[k]
            assert torch.equal(got, crop), (epoch, path)
            _close_to_pil(got, pil)
            flips.append(flip)
    assert 0 < sum(flips) < len(flips)
    share = sum(train_crop(37, 23, 0, 0, i)[1] for i in range(4000)) / 4000
    assert abs(share - 0.5) < 0.03  # p = 0.5


def test_random_resized_crop_box_bounds():
    lo, hi = CROP_RATIO
    for width, height in ((37, 23), (23, 37), (29, 31), (300, 300), (1, 1), (2, 3)):
        gen = torch.Generator().manual_seed(width * 1000 + height)
        areas, ratios, lefts = [], [], set()
        for _ in range(400):
            left, top, w, h = random_resized_crop_box(width, height, gen)
            assert 1 <= w and 1 <= h and 0 <= left and 0 <= top
            assert left + w <= width and top + h <= height
            # w, h are sqrt(area * r), sqrt(area / r) rounded: bounds up to half a pixel
            assert (w - 0.5) / (h + 0.5) <= hi and (w + 0.5) / max(h - 0.5, 1e-9) >= lo
            assert (w + 0.5) * (h + 0.5) >= CROP_SCALE[0] * width * height
            areas.append(w * h / (width * height))
            ratios.append(w / h)
            lefts.add(left)
        if width == height == 300:  # the whole range is drawn, at varied positions
            assert min(areas) < 0.1 and max(areas) > 0.9 and len(lefts) > 50
            assert min(ratios) < 0.77 and max(ratios) > 1.3
    # no try fits a 5 x 200 strip: centre crop of the whole width, ratio clamped to 3/4
    gen = torch.Generator().manual_seed(0)
    assert random_resized_crop_box(5, 200, gen) == (0, 96, 5, 7)
    assert random_resized_crop_box(200, 5, gen) == (96, 0, 7, 5)
    # the draws come from the generator only
    a = [random_resized_crop_box(37, 23, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [random_resized_crop_box(37, 23, torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b and len(set(a)) > 15


def test_sample_seed_is_a_fixed_integer_mix():
    assert sample_seed(0, 0, 0) == 3469100030397278074  # no hash(): every process, every run
    assert sample_seed(1, 2, 3) == 8887846339082047141
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 450 and all(0 <= v < 2 ** 63 for v in seeds)
    assert train_crop(37, 23, 4, 1, 7) == train_crop(37, 23, 4, 1, 7)


def test_only_imagenet_train_split_augments(tmp_path):
    for split in ("train", "val"):
        noise_image_folder(tmp_path / "imagenet" / split, ODD_SIZES)
    train, val = load_imagenet(tmp_path, image_size=16)
    assert train.augment and not val.augment
    assert not load_imagenet(tmp_path, augment=False)[0].augment
    assert load_dataset("imagenet", tmp_path, train_samples=3)[0].augment
    recipe = {"data": {"name": "imagenet", "augment": False}}
    assert not build_task(recipe, tmp_path).train_set.augment
    task = build_task({"data": {"name": "imagenet"}}, tmp_path, train_samples=6)
    assert task.train_set.augment and not task.test_set.augment and len(task.train_set) == 6


def test_imagenet_refuses_an_empty_class_and_splits_with_other_classes(tmp_path):
    """An empty class directory (train's ``aardvark/``) would shift train's labels against
    val's: refused, also from a cached index; so are train/val class lists that differ."""
    root = tmp_path / "imagenet"
    noise_image_folder(root / "train", ODD_SIZES[:1], classes=("cat", "dog", "eel"))
    noise_image_folder(root / "val", ODD_SIZES[:1], classes=("cat", "dog", "eel"))
    (root / "train" / "aardvark").mkdir()
    (root / "train" / "aardvark" / "notes.txt").write_text("no images here")
    for _ in range(2):  # the second call reads the cached index
        with pytest.raises(DataError, match=r"train/aardvark: a class directory without images.*"
                           r"remove it or add images"):
            load_imagenet(tmp_path, image_size=8)
    (root / "train" / "aardvark" / "notes.txt").unlink()
    (root / "train" / "aardvark").rmdir()
    noise_image_folder(root / "val", ODD_SIZES[:1], classes=("fox",))
    with pytest.raises(DataError, match=r"different classes \(only in \S+/val: fox\)"):
        load_imagenet(tmp_path, image_size=8)
    noise_image_folder(root / "train", ODD_SIZES[:1], classes=("fox",))
    train, val = load_imagenet(tmp_path, image_size=8)
    assert train.classes == val.classes == ["cat", "dog", "eel", "fox"]


def test_a_broken_link_or_a_directory_named_as_an_image_is_refused(tmp_path):
    """An entry named as an image that is not one is a DataError naming it, not skipped without
    a word (the run would train on fewer images than the folder seems to hold); the same
    through a cached index, which the new entry makes stale."""
    root = tmp_path / "train"
    noise_image_folder(root, ODD_SIZES[:2], classes=("cat", "dog"))
    assert len(ImageFolder(root, image_size=8)) == 4  # writes the index
    (root / "dog" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    with pytest.raises(DataError, match=r"dog/gone\.jpg: a broken symbolic link \(to \S+"
                       r"nowhere\.jpg\); fix or remove it"):
        ImageFolder(root, image_size=8)
    (root / "dog" / "gone.jpg").unlink()
    (root / "cat" / "album.jpg").mkdir()
    with pytest.raises(DataError, match=r"cat/album\.jpg: not a file"):
        ImageFolder(root, image_size=8)
    (root / "cat" / "album.jpg").rmdir()
    (root / "cat" / "alias.jpg").symlink_to(next((root / "dog").iterdir()))
    assert len(ImageFolder(root, image_size=8)) == 5  # a link to an image is an image


def _task_batches(root: Path, world_size: int, epoch: int, seed: int = 7) -> dict:
    """{sample index: image tensor} of every rank's steps of ``epoch``, read through
    ClassificationTask as the training loop reads it (fresh objects: a new process)."""
    out = {}
    for rank in range(world_size):
        train = ImageFolder(root, image_size=8, augment=True)
        # read in this thread: worker processes give the same batches (test_loader.py), and
        # under --with-mpi each loader would start forkserver workers (seconds each)
        task = ClassificationTask(train, ImageFolder(root, image_size=8), num_workers=0)
        task.setup(per_rank_batch=2 // world_size, global_batch=2, rank=rank,
                   world_size=world_size, seed=seed, steps_per_epoch=2)
        task.start_epoch(epoch)
        for i in range(2):
            x, _ = task.batch(i)
            for j, k in enumerate(task._part_indices(i).tolist()):
                out[k] = x[j]
    return out


def test_augmented_batches_do_not_depend_on_world_size_or_resumption(tmp_path):
    root = noise_image_folder(tmp_path, ODD_SIZES[:2])
    one = _task_batches(root, 1, epoch=1)
    assert sorted(one) == list(range(4))
    two = _task_batches(root, 2, epoch=1)
    assert all(torch.equal(one[k], two[k]) for k in one)
    again = _task_batches(root, 1, epoch=1)  # a resumed run: same seed, same epoch
    assert all(torch.equal(one[k], again[k]) for k in one)
    later = _task_batches(root, 1, epoch=2)
    assert any(not torch.equal(one[k], later[k]) for k in one)
    other_seed = _task_batches(root, 1, epoch=1, seed=8)
    assert any(not torch.equal(one[k], other_seed[k]) for k in one)


def test_augment_recipe_field_is_validated(tmp_path):
    import yaml
    recipe = load_recipe("resnet-50")
    assert recipe["data"] == {"name": "imagenet"}  # augment defaults to true
    for data, match in (({"name": "imagenet", "augment": "yes"}, "data.augment: must be true or"),
                        ({"name": "fashion-mnist", "augment": True},
                         "data.augment: only the imagenet reader")):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({**recipe, "data": data}))
        with pytest.raises(ConfigError, match=match):
            load_recipe(str(path))
    path.write_text(yaml.safe_dump({**recipe, "data": {"name": "imagenet", "augment": False}}))
    assert load_recipe(str(path))["data"]["augment"] is False


def test_cnn_recipes_validate():
    r = load_recipe("resnet-50")
    assert (r["base_batch_size"], r["optimizer"], r["decay"]["power"]) == (1024, "lars", 2.0)
    f = load_recipe("fashion-resnet")
    assert f["optimizer"] == "lars" and f["data"]["name"] == "fashion-mnist"
    c = load_recipe("fashion-resnet-cpu")  # the swept reduced budget: LARS LR tuned at B0 = 128
    assert (c["model"]["depth"], c["epochs"], c["optimizers"]["lars"]["lr"]) == (8, 8, 16.0)
    for batch in (128, 1024, 4096):  # the sweep's points: LEGW's warmup fits every one
        sched = resolve("fashion-resnet-cpu", batch_size=batch).schedule(60000)
        assert sched.warmup_steps == 29 and sched.total_steps > 2 * sched.warmup_steps
    assert len(load_dataset("synthetic", train_samples=64, test_samples=32)[0]) == 64


@pytest.mark.slow
def test_fashion_resnet_lars_runs(tmp_path, fashion_root):
    import yaml
    recipe = load_recipe("fashion-resnet")
    recipe.update({"data": {"name": "fashion-mnist", "train_samples": 512, "test_samples": 256},
                   "model": {"name": "resnet_small", "depth": 8, "width": 8}, "epochs": 2})
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(recipe))
    s = train_mod.train(resolve(str(path), batch_size=128, data_dir=str(fashion_root),
                                out=str(tmp_path / "o")), SelfCommunicator(), quiet=True)
    assert s["steps"] == 8 and s["optimizer"] == "lars" and s["warmup_steps"] == 1
    assert 0 <= s["final_test_accuracy"] <= 1 and s["final_test_loss"] < 10  # ran, no blow-up
