"""Real training runs on real MNIST, 1 process (the MPI suite repeats them on several ranks)."""
import json

import pytest
import torch
from helpers import preempt_at, quick_recipe

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.errors import ConfigError, DataError
from hpclb.train import loop as train_mod
from hpclb.train.checkpoint import load_checkpoint
from hpclb.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def run(tmp_path, out, recipe=None, **kw):
    kw.setdefault("batch_size", 512)
    kw.setdefault("epochs", 2.5)
    cfg = resolve(recipe or quick_recipe(tmp_path), out=str(tmp_path / out), **kw)
    return train_mod.train(cfg, SelfCommunicator(), quiet=True), cfg


def params_of(cfg):
    return load_checkpoint(f"{cfg.out}/checkpoint.pt")["model"]


def test_outputs_and_same_seed_same_result(tmp_path, mnist_dir):
    s1, c1 = run(tmp_path, "a", data_dir=str(mnist_dir.parent))
    s2, c2 = run(tmp_path, "b", data_dir=str(mnist_dir.parent))
    for key in ("final_test_accuracy", "global_batch_size", "base_batch_size", "world_size",
                "epochs", "scaling", "wall_time_s"):
        assert key in s1
    assert s1["final_test_accuracy"] == s2["final_test_accuracy"]
    assert s1["steps"] == 20 and s1["steps_per_epoch"] == 8
    assert s1["final_test_accuracy"] > 0.25  # 20 steps of real learning, far above 10% chance
    a, b = params_of(c1), params_of(c2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(c1.out)[0]  # the epoch lines
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[-1]["step"] == 20
    assert json.load(open(f"{c1.out}/summary.json"))["final_test_accuracy"] == \
        s1["final_test_accuracy"]


@pytest.mark.parametrize("acc", [pytest.param(1, marks=pytest.mark.extended), 2])  # 2 covers 1's
def test_preempted_run_resumes_bit_for_bit(tmp_path, mnist_dir, monkeypatch, acc):
    """Also with 2 micro-batches per step (checkpoints are taken between optimizer steps)."""
    full, cfg_full = run(tmp_path, "full", data_dir=str(mnist_dir.parent), accumulation_steps=acc)
    preempt_at(monkeypatch, 11)  # mid-epoch 2 (8 steps per epoch)
    with pytest.raises(train_mod.Preempted):
        run(tmp_path, "cut", data_dir=str(mnist_dir.parent), accumulation_steps=acc)
    ck = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert (ck["epoch"], ck["step_in_epoch"], ck["global_step"]) == (1, 3, 11)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="unfinished run; add --resume"):
        run(tmp_path, "cut", data_dir=str(mnist_dir.parent))  # would overwrite the progress
    resumed, cfg_cut = run(tmp_path, "cut", data_dir=str(mnist_dir.parent), resume=True,
                           accumulation_steps=acc)
    a, b = params_of(cfg_full), params_of(cfg_cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_test_accuracy"] == full["final_test_accuracy"]
    assert resumed["steps"] == full["steps"]


def test_accumulation_follows_the_one_pass_trajectory(tmp_path, mnist_dir):
    """K micro-batches per step at global batch B = one pass over B (one allreduce per step; in
    fp32 the summation order differs, hence a tolerance). 3,585 samples at B 512: the epoch's
    last step holds 1 sample, split 0/1 at K = 2 and 0/0/0/1 at K = 4, so the parts' weights and
    empty parts count (unweighted, K = 4 ends 6e-3 away)."""
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 3585,
                                          "test_samples": 500})
    kw = dict(recipe=recipe, batch_size=512, epochs=1.5, data_dir=str(mnist_dir.parent))
    one, cfg_one = run(tmp_path, "k1", **kw)
    ref = params_of(cfg_one)
    for acc in (2, 4):
        s, cfg = run(tmp_path, f"k{acc}", accumulation_steps=acc, **kw)
        got = params_of(cfg)
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, f"K={acc}: max parameter difference {diff:.3g}"
        assert (s["accumulation_steps"], s["micro_batch_size"], s["steps"]) == \
            (acc, 512 // acc, one["steps"])
        assert s["global_batch_size"] == 512 and s["batch_ratio_k"] == one["batch_ratio_k"]
        assert s["peak_lr"] == one["peak_lr"] and s["warmup_steps"] == one["warmup_steps"]
        assert json.load(open(f"{cfg.out}/summary.json"))["accumulation_steps"] == acc
    assert (one["accumulation_steps"], one["micro_batch_size"]) == (1, 512)


def test_accumulation_steps_setting_and_errors_name_the_field(tmp_path):
    assert resolve(quick_recipe(tmp_path)).accumulation_steps == 1
    from_recipe = quick_recipe(tmp_path, accumulation_steps=4)
    assert resolve(from_recipe).accumulation_steps == 4
    assert resolve(from_recipe, accumulation_steps=2).accumulation_steps == 2  # CLI wins
    for bad in (0, -2):
        with pytest.raises(ConfigError, match=r"--accumulation-steps \(recipe field "
                           r"accumulation_steps\): must be an integer >= 1"):
            resolve(quick_recipe(tmp_path), accumulation_steps=bad)
    with pytest.raises(ConfigError, match=r"quick.yaml: accumulation_steps \(or "
                       r"--accumulation-steps\): must be an integer"):
        resolve(quick_recipe(tmp_path, accumulation_steps=0))
    with pytest.raises(ConfigError, match=r"--batch-size 512 \(the global batch\) is not divisible "
                       r"by the world size 1 x --accumulation-steps 3 = 3.* multiple of 3"):
        run(tmp_path, "d", accumulation_steps=3, data_dir=str(tmp_path / "no-data-needed"))
    assert not (tmp_path / "d").exists()  # failed before any work


def test_resume_refuses_a_different_run(tmp_path, mnist_dir):
    run(tmp_path, "r", data_dir=str(mnist_dir.parent))
    with pytest.raises(ConfigError, match=r"global_batch_size \(--batch-size\): 512 there, 256 now"):
        run(tmp_path, "r", data_dir=str(mnist_dir.parent), batch_size=256, resume=True)


def test_missing_data_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="hpclb data fetch"):
        run(tmp_path, "x", data_dir=str(tmp_path / "nowhere"))


def test_warmup_longer_than_training_fails_before_work(tmp_path, mnist_dir):
    with pytest.raises(ConfigError, match=r"warmup .* must be shorter than training"):
        run(tmp_path, "w", data_dir=str(mnist_dir.parent), epochs=0.01)
    assert not (tmp_path / "w").exists()


def test_two_runs_into_one_out_directory_at_once_are_refused(tmp_path, mnist_dir):
    """Rank 0 holds a lock on --out for the whole run: a second run started into the same
    directory while the first is running is a ConfigError naming the holder and the fix; once
    the first run ends (or dies), the directory is free again."""
    from hpclb.errors import ConfigError
    from hpclb.train.setup import setup_run

    cfg = resolve(quick_recipe(tmp_path), out=str(tmp_path / "run"),
                  data_dir=str(mnist_dir.parent))
    first = setup_run(cfg, SelfCommunicator())
    try:
        with pytest.raises(ConfigError, match=r"another hpclb train \(pid \d+ on .*\) is writing"):
            train_mod.train(cfg, SelfCommunicator(), quiet=True)
    finally:
        first.close()
    assert train_mod.train(cfg, SelfCommunicator(), quiet=True)["steps"] == 32
