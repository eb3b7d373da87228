"""Checkpoint files and generations: checksums, fallback to an older generation, disk full."""
import errno
import logging
import os
import subprocess

import pytest
import torch

from hpclb.errors import CheckpointError
from hpclb.train import checkpoint as C
from hpclb.train.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(60)


def state(step):
    return {"global_step": step, "w": torch.full((64, 64), float(step))}


def files(directory):
    return sorted(p.name for p in directory.iterdir())


def test_store_keeps_the_last_k_generations_and_checkpoint_pt_is_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    assert not store.exists() and store.latest() is None
    for step in (10, 20, 30):
        path = store.save(state(step))
    assert path.name == "gen-000003-step-30.pt"
    assert files(tmp_path / "checkpoints") == ["gen-000002-step-20.pt",
                                               "gen-000002-step-20.pt.sha256",
                                               "gen-000003-step-30.pt",
                                               "gen-000003-step-30.pt.sha256"]
    assert store.exists() and store.latest().state["global_step"] == 30
    # checkpoint.pt is the newest generation, readable by the plain loader, verified
    assert C.load_checkpoint(tmp_path / "checkpoint.pt")["global_step"] == 30
    assert C.verify_checkpoint(tmp_path / "checkpoint.pt") is True
    assert not [p for p in tmp_path.rglob(".*tmp*")]


def test_sidecar_is_sha256sum_format(tmp_path):
    CheckpointStore(tmp_path).save(state(1))
    done = subprocess.run(["sha256sum", "-c", "checkpoint.pt.sha256"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "checkpoint.pt: OK" in done.stdout


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_latest"])
def test_damaged_newest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog, damage):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(10))
    newest = store.save(state(20))
    if damage == "truncate":  # checkpoint.pt is the same file (hard link): both are damaged
        with open(newest, "r+b") as f:
            f.truncate(newest.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    else:  # the newest generation is gone; checkpoint.pt (its link) remains and is used
        newest.unlink()
    with caplog.at_level(logging.WARNING, logger="hpclb.train.checkpoint"):
        loaded = store.latest()
    if damage == "delete_latest":
        assert loaded.state["global_step"] == 20 and not loaded.skipped
        return
    assert loaded.state["global_step"] == 10 and loaded.step == 10 and loaded.generation == 1
    assert [p.name for p, _ in loaded.skipped] == [newest.name]
    assert "damaged or partial" in loaded.skipped[0][1]
    assert "trying the previous one" in caplog.text and newest.name in caplog.text
    with pytest.raises(CheckpointError, match="damaged or partial"):
        C.load_checkpoint(tmp_path / "checkpoint.pt")


def test_every_checkpoint_damaged_is_an_error_listing_them(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2):
        p = store.save(state(step))
        p.write_bytes(b"not a checkpoint")  # hard link: checkpoint.pt too for the newest
    with pytest.raises(CheckpointError, match="no usable checkpoint.*gen-000002.*gen-000001") \
            as e:
        store.latest()
    # one line a user can act on: each file once, the fix named, no library jargon
    msg = str(e.value)
    assert "--overwrite" in msg and "CheckpointStore" not in msg and len(msg) < 600, msg
    assert msg.count("gen-000002") == 1 and "delete them" not in msg


def test_disk_full_midway_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(state(10))
    before = files(tmp_path), files(tmp_path / "checkpoints")
    written = {"n": 0}
    real_init = C._HashingWriter.__init__

    class FillingFile:
        """The temporary file: the disk fills up after 1,000 bytes."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            if written["n"] > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written["n"] += len(data)
            return self.f.write(data)

    monkeypatch.setattr(C._HashingWriter, "__init__",
                        lambda self, f: real_init(self, FillingFile(f)))
    with pytest.raises(CheckpointError, match="disk full.*checkpoint.pt is still valid"):
        store.save(state(20))
    assert written["n"] > 1000  # the failure came midway, after bytes were written
    assert (files(tmp_path), files(tmp_path / "checkpoints")) == before  # no partial file
    loaded = store.latest()
    assert loaded.state["global_step"] == 10 and not loaded.skipped
    monkeypatch.undo()
    assert store.save(state(20)).name == "gen-000002-step-20.pt"  # space back: goes on


def test_save_checkpoint_disk_full_is_a_checkpoint_error(tmp_path, monkeypatch):
    path = C.save_checkpoint(tmp_path / "checkpoint.pt", state(1))

    def full(obj, f):
        f.write(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C.torch, "save", full)
    with pytest.raises(CheckpointError, match="disk full.*left as it was"):
        C.save_checkpoint(path, state(2))
    monkeypatch.undo()
    assert C.load_checkpoint(path)["global_step"] == 1


def test_checkpoint_pt_verifies_at_every_instant_of_a_replacement(tmp_path, monkeypatch):
    """Between the sidecar update and the rename, both the old and the new file verify."""
    path = C.save_checkpoint(tmp_path / "checkpoint.pt", state(1))
    seen = []
    real_replace = os.replace

    def replace_and_check(src, dst):
        if str(dst) == str(path):
            seen.append(C.verify_checkpoint(path))  # old file, sidecar already lists the new
            real_replace(src, dst)
            seen.append(C.verify_checkpoint(path))  # new file, sidecar still lists both
        else:
            real_replace(src, dst)

    monkeypatch.setattr(C.os, "replace", replace_and_check)
    C.save_checkpoint(path, state(2))
    assert seen == [True, True]
    assert len(C.sidecar_path(path).read_text().splitlines()) == 1


def test_legacy_checkpoint_without_sidecar_still_loads(tmp_path):
    torch.save(state(7), tmp_path / "checkpoint.pt")
    store = CheckpointStore(tmp_path)
    assert store.exists() and store.latest().state["global_step"] == 7
    store.save(state(8))
    assert C.load_checkpoint(tmp_path / "checkpoint.pt")["global_step"] == 8


def test_missing_checkpoint_and_bad_keep(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        C.load_checkpoint(tmp_path / "checkpoint.pt")
    for keep in (0, 1.5, True):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            CheckpointStore(tmp_path, keep=keep)


def test_no_hard_links_falls_back_to_a_copy(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(C.os, "link", no_link)
    store = CheckpointStore(tmp_path, keep=1)
    store.save(state(1))
    newest = store.save(state(2))
    assert not (tmp_path / "checkpoint.pt").samefile(newest)
    assert C.load_checkpoint(tmp_path / "checkpoint.pt")["global_step"] == 2
    assert len(store.generations()) == 1 and store.latest().state["global_step"] == 2
