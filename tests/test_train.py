"""Real training runs on real MNIST, 1 process (the MPI suite repeats them on several ranks)."""
import json

import pytest
import torch

from hpclb import train as train_mod
from hpclb.checkpoint import load_checkpoint
from hpclb.comm import SelfCommunicator
from hpclb.config import ConfigError, resolve
from hpclb.data import DataError
from helpers import quick_recipe

pytestmark = pytest.mark.slow


def run(tmp_path, out, **kw):
    kw.setdefault("batch_size", 512)
    kw.setdefault("epochs", 2.5)
    cfg = resolve(quick_recipe(tmp_path), out=str(tmp_path / out), **kw)
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
    rows = [json.loads(l) for l in open(f"{c1.out}/metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[-1]["step"] == 20
    assert json.load(open(f"{c1.out}/summary.json"))["final_test_accuracy"] == \
        s1["final_test_accuracy"]


def test_preempted_run_resumes_bit_for_bit(tmp_path, mnist_dir, monkeypatch):
    full, cfg_full = run(tmp_path, "full", data_dir=str(mnist_dir.parent))
    calls = {"n": 0}

    def preempt_at_step_11(self, comm):
        calls["n"] += 1
        return calls["n"] == 11  # mid-epoch 2 (8 steps per epoch)

    monkeypatch.setattr(train_mod.PreemptionFlag, "agreed", preempt_at_step_11)
    with pytest.raises(train_mod.Preempted):
        run(tmp_path, "cut", data_dir=str(mnist_dir.parent))
    ck = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert (ck["epoch"], ck["step_in_epoch"], ck["global_step"]) == (1, 3, 11)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="unfinished run; add --resume"):
        run(tmp_path, "cut", data_dir=str(mnist_dir.parent))  # would overwrite the progress
    resumed, cfg_cut = run(tmp_path, "cut", data_dir=str(mnist_dir.parent), resume=True)
    a, b = params_of(cfg_full), params_of(cfg_cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_test_accuracy"] == full["final_test_accuracy"]
    assert resumed["steps"] == full["steps"]


def test_resume_refuses_a_different_run(tmp_path, mnist_dir):
    run(tmp_path, "r", data_dir=str(mnist_dir.parent))
    with pytest.raises(ConfigError, match="global_batch_size=512.*256"):
        run(tmp_path, "r", data_dir=str(mnist_dir.parent), batch_size=256, resume=True)


def test_missing_data_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="hpclb data fetch"):
        run(tmp_path, "x", data_dir=str(tmp_path / "nowhere"))


def test_warmup_longer_than_training_fails_before_work(tmp_path, mnist_dir):
    with pytest.raises(ConfigError, match=r"warmup .* must be shorter than training"):
        run(tmp_path, "w", data_dir=str(mnist_dir.parent), epochs=0.01)
    assert not (tmp_path / "w").exists()
