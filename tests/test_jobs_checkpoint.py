"""`hpclb train --checkpoint-interval` (what the job templates pass): periodic mid-epoch
checkpoints ride on the preemption allreduce and do not change the trajectory."""
import pytest
import torch
from helpers import quick_recipe

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.train import loop as train_mod
from hpclb.train.checkpoint import CheckpointStore, load_checkpoint

pytestmark = pytest.mark.slow


def test_periodic_checkpoints_leave_the_trajectory_alone(tmp_path, mnist_dir, monkeypatch):
    def run(out, interval):
        cfg = resolve(quick_recipe(tmp_path), out=str(tmp_path / out), batch_size=512,
                      epochs=1.5, data_dir=str(mnist_dir.parent))
        train_mod.train(cfg, SelfCommunicator(), quiet=True, checkpoint_interval_s=interval)
        return load_checkpoint(tmp_path / out / "checkpoint.pt")

    saved = []
    real_save = CheckpointStore.save
    monkeypatch.setattr(CheckpointStore, "save",
                        lambda self, state, step=None: saved.append((state["epoch"],
                                                                     state["step_in_epoch"]))
                        or real_save(self, state, step))
    plain = run("plain", None)
    assert saved == [(1, 0), (2, 0)]  # 8 steps per epoch, 12 steps: epoch ends only
    saved.clear()
    every = run("every", 1e-9)  # due after every step
    assert saved == [(0, i) for i in range(1, 9)] + [(1, 0)] + [(1, i) for i in range(1, 5)] \
        + [(2, 0)]
    assert every["global_step"] == plain["global_step"] == 12
    assert all(torch.equal(plain["model"][k], every["model"][k]) for k in plain["model"])
