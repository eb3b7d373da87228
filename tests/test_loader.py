"""Image data through DataLoader workers (hpclb/data/loader.py) and ImageFolder's shared file
index (hpclb/data/images.py folder_index): the workers' batches equal the training thread's bit
for bit (augmentation, uneven shares, micro-batches, resumption); the index is listed once."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import LAUNCH_ENV, noise_image_folder, run_bounded, running

from hpclb.config import load_recipe
from hpclb.data import images
from hpclb.data.images import INDEX_NAME, ImageFolder, folder_index
from hpclb.data.loader import StepBatchSampler, default_num_workers
from hpclb.errors import ConfigError
from hpclb.tasks import ClassificationTask

pytestmark = pytest.mark.timeout(120)
SIZES = ((37, 23), (23, 37), (64, 20), (29, 31), (40, 40))


def _folder(root: Path, n_per_class: int = 6, classes=("a", "b")) -> Path:
    return noise_image_folder(root, [SIZES[k % len(SIZES)] for k in range(n_per_class)], classes)


def _batches(root: Path, *, workers: int, rank: int, world_size: int, parts: int,
             epochs=(0, 1), first: int = 0):
    train = ImageFolder(root, image_size=8, augment=True)
    task = ClassificationTask(train, ImageFolder(root, image_size=8), num_workers=workers)
    task.setup(per_rank_batch=5, global_batch=5, rank=rank, world_size=world_size, seed=3,
               steps_per_epoch=3)
    out = []
    for epoch in epochs:
        task.start_epoch(epoch)
        for i in range(first if epoch == epochs[0] else 0, 3):
            for part in range(parts):
                if task.part_size(i, part, parts)[0]:
                    out.append(((epoch, i, part), task.batch(i, part, parts)))
    return task, out


@pytest.mark.slow
@pytest.mark.parametrize("world_size,parts", [(1, 1), pytest.param(2, 2, marks=pytest.mark.extended)])
def test_worker_batches_equal_the_training_thread(tmp_path, world_size, parts):
    """12 images, global batch 5: steps of 5, 5, 2 samples (shares 3/2, 3/2, 1/1 on 2 ranks),
    augmented, 2 epochs, micro-batches: every batch identical with 2 workers and with none."""
    root = _folder(tmp_path / "train")
    for rank in range(world_size):
        task, threaded = _batches(root, workers=0, rank=rank, world_size=world_size, parts=parts)
        assert task._loader() is None
        task, loaded = _batches(root, workers=2, rank=rank, world_size=world_size, parts=parts)
        assert task._loader() is not None and task._loader().loader.num_workers == 2
        assert [k for k, _ in loaded] == [k for k, _ in threaded] and len(loaded) >= 6
        for (key, (x0, y0)), (_, (x1, y1)) in zip(threaded, loaded):
            assert x1.dtype == torch.uint8 and y1.dtype == torch.int64, key
            assert torch.equal(x0, x1) and torch.equal(y0, y1), key
        # epoch 0 and 1 draw different augmentations of the same sample
        assert not torch.equal(threaded[0][1][0], threaded[len(threaded) // 2][1][0])


@pytest.mark.slow
def test_resumed_mid_epoch_reads_the_same_batches(tmp_path):
    root = _folder(tmp_path / "train")
    _, whole = _batches(root, workers=0, rank=0, world_size=1, parts=1, epochs=(1,))
    _, resumed = _batches(root, workers=1, rank=0, world_size=1, parts=1, epochs=(1,), first=1)
    assert [k for k, _ in resumed] == [k for k, _ in whole][1:]
    for (_, (x0, _)), (_, (x1, _)) in zip(whole[1:], resumed):
        assert torch.equal(x0, x1)


def test_step_batch_sampler_yields_the_parts_and_skips_empty_ones():
    shares = {0: torch.tensor([4, 1, 3]), 1: torch.tensor([7])}

    def part_indices(i, part, parts):
        mine = shares[i]
        return mine[part * len(mine) // parts:(part + 1) * len(mine) // parts]

    s = StepBatchSampler(part_indices)
    s.start(epoch=5, first_step=0, steps=2, parts=2)
    assert list(s.keys()) == [(0, 0), (0, 1), (1, 1)]  # step 1's part 0 is empty
    assert list(s) == [[(5, 4)], [(5, 1), (5, 3)], [(5, 7)]] and len(s) == 3


def test_pin_memory_follows_the_run_device(tmp_path):
    root = _folder(tmp_path / "train", n_per_class=2)
    for device, pinned in (("cuda", True), ("cpu", False)):
        task = ClassificationTask(ImageFolder(root, augment=True), ImageFolder(root),
                                  num_workers=1)
        task.setup(per_rank_batch=2, global_batch=2, rank=0, world_size=1, seed=0,
                   steps_per_epoch=2, device=device)
        loader = task._loader().loader
        assert loader.pin_memory is pinned and loader.persistent_workers
        assert loader.prefetch_factor == 2


def test_in_memory_splits_stay_in_the_training_thread():
    from hpclb.data.images import GreySplit

    split = GreySplit(torch.zeros(10, 28, 28, dtype=torch.uint8), torch.zeros(10, dtype=torch.int64))
    task = ClassificationTask(split, split)
    task.setup(per_rank_batch=5, global_batch=5, rank=0, world_size=1, seed=0, steps_per_epoch=2)
    task.start_epoch(0)
    assert task._loader() is None and task.batch(0)[0].shape == (5, 1, 28, 28)


def test_default_num_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert default_num_workers() == 1           # 16 CPUs shared by 8 ranks: 2, one trains
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert default_num_workers() == 7           # 8 CPUs per rank
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    assert default_num_workers() == 16          # capped (64 CPUs per rank)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8, 16)))
    assert default_num_workers() == 7           # bound by the launcher to 8 CPUs
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert default_num_workers() == 0           # bound to one CPU: the training thread reads


def test_index_is_written_once_and_reused(tmp_path, monkeypatch):
    root = _folder(tmp_path / "train", n_per_class=3)
    classes, files = folder_index(root)
    assert (root / INDEX_NAME).is_file() and classes == ["a", "b"]
    assert [(p.name, c) for p, c in files] == [(f"{k:03d}.png", c) for c in (0, 1)
                                              for k in range(3)]
    assert not list(root.glob("*.building")) and not list(root.glob(".*.tmp"))

    def no_listing(r):
        raise AssertionError("listed again")
    monkeypatch.setattr(images, "_scan", no_listing)
    assert folder_index(root) == (classes, files)
    assert len(ImageFolder(root)) == 6


def test_index_is_rebuilt_when_a_class_changes(tmp_path):
    root = _folder(tmp_path / "train", n_per_class=2)
    folder_index(root)
    time.sleep(0.05)  # past the file system's timestamp granularity
    (root / "b" / "001.png").rename(root / "b" / "009.png")
    (root / "c").mkdir()
    (root / "c" / "x.png").write_bytes((root / "a" / "000.png").read_bytes())
    classes, files = folder_index(root)
    assert classes == ["a", "b", "c"]
    assert [p.name for p, _ in files] == ["000.png", "001.png", "000.png", "009.png", "x.png"]


def test_concurrent_processes_list_the_folder_once(tmp_path, monkeypatch):
    root = _folder(tmp_path / "train", n_per_class=2)
    calls = []
    real = images._scan

    def slow_scan(r):
        calls.append(r)
        time.sleep(0.3)
        return real(r)
    monkeypatch.setattr(images, "_scan", slow_scan)
    results = [None] * 4

    def read(k):
        results[k] = folder_index(root)
    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(r == results[0] for r in results) and len(results[0][1]) == 4


def test_read_only_data_uses_the_user_cache(tmp_path, monkeypatch):
    root = _folder(tmp_path / "train", n_per_class=1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    blocked = Path("/proc/hpclb-no-such-dir") / INDEX_NAME  # mkdir fails: not writable
    paths = images._index_paths(root)
    monkeypatch.setattr(images, "_index_paths", lambda r: [blocked, paths[1]])
    assert folder_index(root)[0] == ["a", "b"]
    assert paths[1].is_file() and paths[1].parent == tmp_path / "cache" / "hpclb"


def test_num_workers_recipe_field_is_validated(tmp_path):
    recipe = load_recipe("resnet-50")
    path = tmp_path / "r.yaml"
    for data, match in (({"name": "imagenet", "num_workers": -1}, "data.num_workers: must be"),
                        ({"name": "imagenet", "num_workers": True}, "data.num_workers: must be"),
                        ({"name": "fashion-mnist", "num_workers": 2},
                         "data.num_workers: only the imagenet reader")):
        path.write_text(yaml.safe_dump({**recipe, "data": data}))
        with pytest.raises(ConfigError, match=match):
            load_recipe(str(path))
    path.write_text(yaml.safe_dump({**recipe, "data": {"name": "imagenet", "num_workers": 0}}))
    assert load_recipe(str(path))["data"]["num_workers"] == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_loader_left_open_does_not_hold_the_exit(tmp_path):
    """Under MPI the workers come from a fork server started with USR2/TERM blocked (so the
    scheduler's step-wide signal reaches the rank alone); the rank's own TERM must still end them:
    multiprocessing's exit hook terminates and joins every live worker, so a process that exits
    with a loader still open (an exception, a test) would otherwise wait for them forever."""
    _folder(tmp_path / "img", n_per_class=4)
    code = (
        "import sys, time\n"
        "from mpi4py import MPI\n"
        "from pathlib import Path\n"
        "from hpclb.data.images import ImageFolder\n"
        "from hpclb.tasks import ClassificationTask\n"
        f"root = Path({str(tmp_path / 'img')!r})\n"
        "train = ImageFolder(root, image_size=8)\n"
        "task = ClassificationTask(train, ImageFolder(root, image_size=8), num_workers=2)\n"
        "task.setup(per_rank_batch=4, global_batch=4, rank=0, world_size=1, seed=3,\n"
        "           steps_per_epoch=2)\n"
        "task.start_epoch(0)\n"
        "x, y = task.batch(0, 0, 1)\n"
        "print('read', tuple(x.shape), flush=True)\n"
        "sys.modules['__main__'].keep = task  # still open at exit\n")
    r = run_bounded([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                    env=LAUNCH_ENV)  # raises TimeoutExpired (the whole session ended) on a hang
    assert r.returncode == 0 and "read (4, 3, 8, 8)" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_end_soon_after_their_rank_is_killed(tmp_path):
    """A rank killed outright (SIGKILL: the OOM killer, a launcher's abort) leaves no loader
    workers behind: they end within seconds, and with them the fork server and the resource
    tracker (a worker's parent is the fork server, which holds on while its workers live)."""
    _folder(tmp_path / "img", n_per_class=4)
    code = (
        "import multiprocessing, time\n"
        "from multiprocessing import forkserver\n"
        "from mpi4py import MPI\n"
        "from pathlib import Path\n"
        "from hpclb.data.images import ImageFolder\n"
        "from hpclb.tasks import ClassificationTask\n"
        f"root = Path({str(tmp_path / 'img')!r})\n"
        "task = ClassificationTask(ImageFolder(root, image_size=8), ImageFolder(root, image_size=8),"
        " num_workers=2)\n"
        "task.setup(per_rank_batch=4, global_batch=4, rank=0, world_size=1, seed=3,\n"
        "           steps_per_epoch=2)\n"
        "task.start_epoch(0)\n"
        "task.batch(0, 0, 1)\n"
        "pids = [p.pid for p in multiprocessing.active_children()]\n"
        "pids.append(forkserver._forkserver._forkserver_pid)\n"
        "print('PIDS', *pids, flush=True)\n"
        "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=LAUNCH_ENV, start_new_session=True)
    pids: list[int] = []
    try:
        line = next(line for line in p.stdout if line.startswith("PIDS"))
        pids += [int(x) for x in line.split()[1:]]
        assert len(pids) == 3, line  # two workers and the fork server
        p.kill()
        p.wait()
        deadline = time.monotonic() + 30
        while [pid for pid in pids if running(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in pids if running(pid)] == [], pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

