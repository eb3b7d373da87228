"""Tar shards of an ImageFolder (hpclb/data/shards.py, `hpclb data shards`): WebDataset's layout
(key.jpg + key.cls), read by sample index: the folder's samples bit for bit, every sample once
per epoch at any world size, bad input named."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from helpers import noise_image_folder

from hpclb.config import load_recipe
from hpclb.data import shards as shards_mod
from hpclb.data.images import ImageFolder, load_imagenet
from hpclb.data.shard_writer import write_shards
from hpclb.data.shards import INDEX, TarShards, read_index
from hpclb.errors import ConfigError, DataError
from hpclb.tasks import ClassificationTask

pytestmark = pytest.mark.timeout(120)
SIZES = ((37, 23), (23, 37), (64, 20), (29, 31), (40, 40))


def _folder(root: Path) -> Path:
    """Two classes of five PNGs and one JPEG each (12 images)."""
    from PIL import Image

    noise_image_folder(root, SIZES)
    for k, c in enumerate(("a", "b")):
        Image.new("RGB", (50, 40), (200, 30 * k, 10)).save(root / c / "zz.jpeg", quality=90)
    return root


def test_shards_are_webdataset_tars_with_an_index(tmp_path):
    src = _folder(tmp_path / "train")
    out = write_shards(src, tmp_path / "shards", samples_per_shard=5)
    classes, files = ImageFolder(src).classes, ImageFolder(src).files
    assert sorted(p.name for p in out.iterdir()) == [INDEX, "shard-000000.tar",
                                                    "shard-000001.tar", "shard-000002.tar"]
    with tarfile.open(out / "shard-000001.tar") as tar:
        names = tar.getnames()
        # a/zz.jpeg is sample 5 (class 0, .jpeg written as .jpg), b/000.png sample 6
        assert names[:4] == ["000000005.jpg", "000000005.cls", "000000006.png", "000000006.cls"]
        assert tar.extractfile("000000005.cls").read() == b"0"
        assert tar.extractfile("000000006.cls").read() == b"1"
        assert tar.extractfile("000000005.jpg").read() == files[5][0].read_bytes()
    index = read_index(out)
    assert index["classes"] == classes == ["a", "b"] and len(index["label"]) == 12
    assert index["shard"].tolist() == [0] * 5 + [1] * 5 + [2] * 2
    assert index["label"].tolist() == [c for _, c in files]


@pytest.mark.parametrize("augment", [True, False])
def test_shards_read_the_folders_samples_bit_for_bit(tmp_path, augment):
    src = _folder(tmp_path / "train")
    tars = TarShards(write_shards(src, tmp_path / "s", samples_per_shard=4), image_size=16,
                     resize=20, augment=augment, seed=3)
    folder = ImageFolder(src, image_size=16, resize=20, augment=augment, seed=3)
    assert len(tars) == len(folder) == 12 and tars.classes == folder.classes
    for epoch in (0, 1):
        tars.set_epoch(epoch)
        folder.set_epoch(epoch)
        x, y = tars.batch(torch.arange(12))
        want_x, want_y = folder.batch(torch.arange(12))
        assert x.dtype == torch.uint8 and torch.equal(x, want_x) and torch.equal(y, want_y)
    sub = tars.subset(5)
    assert len(sub) == 5 and torch.equal(sub.batch(torch.arange(5))[0], x[:5])
    again = pickle.loads(pickle.dumps(tars))  # a forkserver worker's copy: its own descriptors
    assert again._open == {} and torch.equal(again.batch(torch.arange(12))[0], x)
    assert torch.equal(tars.normalize(x[:2]), folder.normalize(want_x[:2]))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sample_once_per_epoch_at_any_world_size(tmp_path, world_size):
    """Global batch 5 over 12 samples (steps of 5, 5, 2): the ranks' shares of each epoch are
    every sample exactly once, each the folder's pixels of that sample."""
    src = _folder(tmp_path / "train")
    root = write_shards(src, tmp_path / "s", samples_per_shard=5)
    folder = ImageFolder(src, image_size=8, augment=True)
    folder.set_epoch(1, seed=4)
    want = folder.batch(torch.arange(12))[0]
    seen = []
    for rank in range(world_size):
        task = ClassificationTask(TarShards(root, image_size=8, augment=True),
                                  TarShards(root, image_size=8), num_workers=0)
        task.setup(per_rank_batch=5 // world_size, global_batch=5, rank=rank,
                   world_size=world_size, seed=4, steps_per_epoch=3)
        task.start_epoch(1)
        for i in range(3):
            if task.part_size(i, 0, 1)[0]:
                x, _ = task.batch(i)
                idx = task._part_indices(i)
                assert torch.equal(x, want[idx])
                seen += idx.tolist()
    assert sorted(seen) == list(range(12))


def test_open_shards_are_bounded(tmp_path, monkeypatch):
    root = write_shards(_folder(tmp_path / "train"), tmp_path / "s", samples_per_shard=2)
    monkeypatch.setattr(shards_mod, "MAX_OPEN_SHARDS", 2)
    tars = TarShards(root, image_size=8)
    before = len(os.listdir("/proc/self/fd"))
    tars.batch(torch.arange(12))  # six shards
    assert len(tars._open) == 2 and len(os.listdir("/proc/self/fd")) == before + 2


def test_bad_shard_sets_are_named(tmp_path):
    src = _folder(tmp_path / "train")
    out = write_shards(src, tmp_path / "s", samples_per_shard=6)
    with pytest.raises(DataError, match="--overwrite"):
        write_shards(src, out)
    write_shards(src, out, samples_per_shard=12, overwrite=True)  # replaces the two shards
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar"]
    with pytest.raises(ValueError, match="samples_per_shard must be >= 1"):
        write_shards(src, tmp_path / "t", samples_per_shard=0)
    with pytest.raises(DataError, match="hpclb data shards"):
        TarShards(tmp_path / "nothing")
    tars = TarShards(out, image_size=8)
    os.truncate(out / "shard-000000.tar", 2048)
    with pytest.raises(DataError, match="truncated shard"):
        tars.batch(torch.arange(12))


def test_overwrite_deletes_only_the_shards_its_index_lists(tmp_path):
    # before: a user's data.tar was counted as a shard, and --overwrite deleted a user's
    # shard-000005.tar (matched by name only)
    src = _folder(tmp_path / "train")
    out = write_shards(src, tmp_path / "s", samples_per_shard=6)
    (out / "data.tar").write_bytes(b"mine")
    (out / "shard-000005.tar").write_bytes(b"mine too")
    with pytest.raises(DataError, match=r"\(3 files: index.npz, shard-000000.tar, "
                                        r"shard-000001.tar\).*kept \(data.tar, shard-000005.tar"):
        write_shards(src, out)
    write_shards(src, out, samples_per_shard=6, overwrite=True)
    assert (out / "data.tar").read_bytes() == b"mine"
    assert (out / "shard-000005.tar").read_bytes() == b"mine too"
    assert len(read_index(out)["label"]) == 12
    with pytest.raises(DataError, match="shard-000005.tar, which hpclb's index does not list"):
        write_shards(src, out, samples_per_shard=2, overwrite=True)  # would write shard-000005
    assert (out / "shard-000005.tar").read_bytes() == b"mine too"


def test_imagenet_reads_shards_when_the_recipe_says_so(tmp_path):
    for split in ("train", "val"):
        src = _folder(tmp_path / "folders" / split)
        write_shards(src, tmp_path / "imagenet" / "shards" / split)
    train, val = load_imagenet(tmp_path, image_size=8, shards=True)
    assert isinstance(train, TarShards) and train.augment and not val.augment
    recipe = load_recipe("resnet-50")
    path = tmp_path / "r.yaml"
    for data, match in (({"name": "imagenet", "shards": "yes"}, "data.shards: must be true or"),
                        ({"name": "fashion-mnist", "shards": True},
                         "data.shards: only the imagenet reader")):
        path.write_text(yaml.safe_dump({**recipe, "data": data}))
        with pytest.raises(ConfigError, match=match):
            load_recipe(str(path))
    path.write_text(yaml.safe_dump({**recipe, "data": {"name": "imagenet", "shards": True}}))
    assert load_recipe(str(path))["data"]["shards"] is True


def test_imagenet_shards_of_splits_with_other_classes_are_refused(tmp_path):
    _folder(tmp_path / "folders" / "train")
    noise_image_folder(_folder(tmp_path / "folders" / "val"), SIZES[:1], classes=("c",))
    for split in ("train", "val"):
        write_shards(tmp_path / "folders" / split, tmp_path / "imagenet" / "shards" / split)
    with pytest.raises(DataError, match=r"different classes \(only in \S+shards/val: c\)"):
        load_imagenet(tmp_path, image_size=8, shards=True)


def test_data_shards_command(tmp_path):
    src = _folder(tmp_path / "train")
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def hpclb(*argv):
        return subprocess.run([sys.executable, "-m", "hpclb", "data", "shards", *argv],
                              capture_output=True, text=True, timeout=60, env=env)
    r = hpclb(str(src), str(tmp_path / "s"), "--samples-per-shard", "5")
    assert r.returncode == 0 and "12 images of 2 classes in 3 shards" in r.stdout, r.stderr
    r = hpclb(str(src), str(tmp_path / "s"))
    assert r.returncode == 1 and "--overwrite" in r.stderr
    r = hpclb(str(src), str(tmp_path / "s"), "--overwrite")
    assert r.returncode == 0 and "in 1 shards" in r.stdout
    r = hpclb(str(src), str(tmp_path / "t"), "--samples-per-shard", "0")
    assert r.returncode == 2 and "--samples-per-shard must be >= 1" in r.stderr
    for out in (src / "sub", src):  # would become a class of SRC
        r = hpclb(str(src), str(out))
        assert r.returncode == 2 and f"{out}: inside the ImageFolder {src}" in r.stderr, r.stderr
        assert not (src / "sub").exists() and not list(src.glob("*.tar"))
    (tmp_path / "file").write_text("mine")
    for out in (tmp_path / "file", tmp_path / "file" / "s"):
        r = hpclb(str(src), str(out))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{out}:" in r.stderr and "choose another OUT" in r.stderr
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("bad", ["empty", "truncated", "text"])
def test_an_unreadable_image_is_named_at_pack_time_and_nothing_is_left(tmp_path, bad):
    """An empty, truncated or non-image file in the ImageFolder: `hpclb data shards` exits 1
    naming the source file, and no shard of the set is left (training would otherwise blame
    shard-000000.tar:000000005 much later)."""
    src = _folder(tmp_path / "train")
    victim = src / "b" / "zz.jpeg"
    data = victim.read_bytes()
    victim.write_bytes({"empty": b"", "truncated": data[:len(data) // 2],
                        "text": b"not a JPEG at all"}[bad])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "hpclb", "data", "shards", str(src),
                        str(tmp_path / "s"), "--samples-per-shard", "5"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and f"{victim}: not a readable image" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not list((tmp_path / "s").glob("shard-*.tar")) and not (tmp_path / "s" / INDEX).exists()


@pytest.mark.slow
def test_loader_workers_read_shards_as_the_training_thread_does(tmp_path):
    """A worker gets the split pickled (under MPI from the fork server): its own descriptors,
    the same batches."""
    root = write_shards(_folder(tmp_path / "train"), tmp_path / "s", samples_per_shard=5)
    out = {}
    for workers in (0, 1):
        task = ClassificationTask(TarShards(root, image_size=8, augment=True),
                                  TarShards(root, image_size=8), num_workers=workers)
        task.setup(per_rank_batch=5, global_batch=5, rank=0, world_size=1, seed=2,
                   steps_per_epoch=3)
        task.start_epoch(0)
        out[workers] = [task.batch(i) for i in range(3)]
        assert (task._loader() is not None) == bool(workers)
        if workers:
            task._loader().close()
    for (x0, y0), (x1, y1) in zip(out[0], out[1]):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
