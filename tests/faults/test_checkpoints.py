"""Fault matrix, checkpoints and divergence on 2 ranks: a corrupt or truncated newest checkpoint
(--resume falls back to the previous generation with a warning), a full disk during a write (the
previous checkpoint stays valid and says so; --resume works), and a non-finite loss (exit 3 with
the global step, epoch and layer, no summary, the checkpoint on disk finite)."""
import re
import subprocess

import pytest
import torch
from conftest import (
    checkpoint_state,
    command,
    run,
    same_result,
    summary,
    train_args,
    write_recipe,
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, damage, reference, record):
    """A 2-epoch run killed after its last checkpoint (step 16, checkpoint.pt and its generation
    file are one hard-linked file), before its summary: the newest checkpoint has bytes flipped
    / is cut to half: --resume warns, resumes from the previous generation (step 8) and ends at
    the uninterrupted result within 60 s. (A run with its summary is finished: --resume leaves
    it as it is: tests/test_resume_settings.py.)"""
    bound = 60
    recipe, out = write_recipe(tmp_path), tmp_path / "run"
    reference(2)  # the uninterrupted run, then a copy of its folder (hard links kept)
    subprocess.run(["cp", "-a", str(reference.folder(2)), str(out)], check=True)
    (out / "summary.json").unlink()  # killed before it was written
    newest = out / "checkpoint.pt"
    assert checkpoint_state(out)["global_step"] == 16
    data = bytearray(newest.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    else:
        data = data[:len(data) // 2]
    with open(newest, "r+b") as f:  # in place: the generation file is the same inode
        f.write(data)
        f.truncate()
    rc, text, t = run(command(train_args(recipe, out, "--resume"), ranks=2), bound)
    assert rc == 0, text
    assert re.search(r"--resume: skipped damaged checkpoint \S+gen-000002-step-16\.pt", text), text
    assert "resumed from" in text and "at global step 8 (epoch 2, step 0 of it)" in text, text
    assert same_result(summary(out), reference(2))
    record(bound, t, rc, "fell back to the step-8 generation; resumed to the uninterrupted "
                         "result")


@pytest.mark.timeout(240)
def test_disk_full_while_writing(tmp_path, reference, record):
    """The disk fills during the step-16 checkpoint's write (ENOSPC after its first 4 KiB, on
    rank 0): every rank exits non-zero within 60 s with the message that the previous checkpoint
    is still valid; no partial file is left; --resume ends at the uninterrupted result."""
    bound = 60
    recipe, out = write_recipe(tmp_path), tmp_path / "run"
    rc, text, t = run(command(train_args(recipe, out), ranks=2, hooked=True), bound,
                      env={"HOOK_MODE": "enospc", "HOOK_SAVE": "2"})
    assert rc != 0, text
    assert re.search(r"disk full while writing the checkpoint \(\[Errno 28\] No space left on "
                     r"device\); the previous checkpoint \S+checkpoint\.pt is still valid and "
                     r"--resume will use it", text), text
    assert checkpoint_state(out)["global_step"] == 8
    leftovers = [p.name for p in out.rglob(".*tmp*")]
    assert not leftovers and not (out / "summary.json").exists(), leftovers
    rc2, text2, _ = run(command(train_args(recipe, out, "--resume"), ranks=2), 120)
    assert rc2 == 0 and "at global step 8 (epoch 2, step 0 of it)" in text2, text2
    assert same_result(summary(out), reference(2))
    record(bound, t, rc, "checkpoint at global step 8 kept valid; resumed to the uninterrupted "
                         "result")


def _finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@pytest.mark.timeout(150)
def test_nonfinite_loss_from_a_given_step(tmp_path, record):
    """Rank 1's logits are NaN from global step 11 on: the steps are skipped on both ranks, and
    the third in a row (13) stops the run: exit 3 within 60 s, the message names the global
    step, the epoch and the first non-finite layer; no summary; the checkpoint (step 8) finite."""
    bound = 60
    out = tmp_path / "run"
    rc, text, t = run(command(train_args(write_recipe(tmp_path), out), ranks=2), bound,
                      env={"FAULT_MODE": "nan", "FAULT_RANK": "1", "FAULT_STEP": "11"})
    assert rc == 3, text
    assert re.search(r"diverged: non-finite gradient at optimizer step 13 \(first non-finite "
                     r"layer net\.\S+\); 3 step\(s\) in a row skipped.*\(global step 13, epoch "
                     r"2, step 5/8\); the last finite checkpoint is kept in \S+checkpoint\.pt; "
                     r"exit 3", text), text
    assert "summary:" not in text and not (out / "summary.json").exists()
    state = checkpoint_state(out)
    assert state["global_step"] == 8 and _finite(state)
    record(bound, t, rc, "finite checkpoint at global step 8; stopped at step 13")


# Found by this matrix: at LR 1e6 the loss reaches 2.1e20 with finite weights (nothing non-finite:
# caught as an exploded loss, > 100x the first applied step's); at LR 1e20 test_loss is inf
# (caught as a non-finite metric). Both end with exit 3 and no summary.
@pytest.mark.timeout(200)
@pytest.mark.parametrize("lr", ["1e6", "1e20"], ids=["lr1e6", "lr1e20"])
def test_lars_huge_lr_diverges_with_exit_3(tmp_path, mnist_dir, lr, record):
    """Issue 12 item 1: LARS at a huge LR on MNIST (2,048 samples, hidden 16, one epoch, 1
    process): exit 3 within 120 s with the step/epoch/layer message, no summary.json, and no
    checkpoint with non-finite weights on disk."""
    from helpers import quick_recipe

    bound = 120
    recipe = quick_recipe(tmp_path, model={"name": "mnist_lstm", "hidden_size": 16},
                          data={"name": "mnist", "train_samples": 2048, "test_samples": 500},
                          optimizer="lars")
    out = tmp_path / "run"
    rc, text, t = run(command(["train", recipe, "--out", out, "--lr", lr, "--data-dir",
                               mnist_dir.parent]), bound)
    record(bound, t, rc, "no summary; no checkpoint with non-finite weights")
    assert rc == 3, text
    assert re.search(r"diverged: .*(non-finite|exploded).*global step \d+, epoch 1", text), text
    assert not (out / "summary.json").exists()
    state = checkpoint_state(out) if (out / "checkpoint.pt").exists() else None
    assert state is None or _finite(state)
