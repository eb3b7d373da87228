"""Device dry run: one training step of every packaged task on PyTorch's ``meta`` device, through
the same set-up and step code as ``hpclb train``. An op that mixes a CPU tensor with a meta one
raises, so any tensor of the step left on the CPU (a batch, carried LSTM state, a statistic, a
gradient bucket, optimizer state) fails this test: the CPU-side proof of the GPU path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.train.loop import train_step
from hpclb.train.setup import setup_run
from tests.conftest import REPO

DATA = Path(os.environ.get("HPCLB_DATA", REPO / "data"))  # where `make data` staged it

pytestmark = pytest.mark.timeout(300)
META = torch.device("meta")
# recipe, data set it reads, optimizer, small data subsets (train, test)
CASES = [("mnist-lstm", "mnist", None, (512, 100)),
         ("mnist-lstm", "mnist", "lars", (512, 100)),
         ("fashion-resnet-cpu", "fashion-mnist", "lars", (256, 100)),
         ("ptb-small-cpu", "ptb", None, (400, 40)),
         ("ptb-medium", "ptb", None, (400, 40)),
         ("gnmt-cpu", "bible-en-es", None, (2000, 64))]


def _cfg(tmp_path, experiment, optimizer, subset, data_root, **kw):
    recipe = load_recipe(experiment)
    recipe["data"].update({"train_samples": subset[0], "test_samples": subset[1]})
    if "vocab_size" in recipe["data"]:  # SentencePiece on a subset: a smaller vocabulary
        recipe["data"]["vocab_size"] = 500
    recipe["epochs"], recipe["warmup_epochs"] = 40, 0.5
    path = tmp_path / f"{experiment}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return resolve(str(path), optimizer=optimizer, out=str(tmp_path / "run"),
                   data_dir=str(data_root), **kw)


@pytest.mark.parametrize("experiment,data,optimizer,subset", CASES,
                         ids=[f"{c[0]}-{c[2] or 'recipe'}" for c in CASES])
def test_one_training_step_runs_entirely_on_the_meta_device(tmp_path, experiment, data,
                                                            optimizer, subset):
    root = DATA
    if not (root / data / ".verified").exists():
        pytest.skip(f"{data} not staged (make data)")
    cfg = _cfg(tmp_path, experiment, optimizer, subset, root, accumulation_steps=2)
    run = setup_run(cfg, SelfCommunicator(), device=META)
    run.task.start_epoch(0)
    sums = torch.zeros(3, dtype=torch.float64, device=META)
    assert train_step(run, 0, sums) is True
    assert sums.device == META and run.pos.global_step == 1
    tensors = list(run.model.parameters()) + list(run.model.buffers()) + \
        [b.buffer for b in run.optimizer.sync.buckets] + \
        [t for st in run.optimizer.state.values() for t in st.values() if torch.is_tensor(t)
         and t.dim() > 0]
    assert tensors and all(t.device == META for t in tensors)
    run.close()


def test_the_dry_run_catches_a_tensor_left_on_the_cpu(tmp_path, monkeypatch):
    """The check can fail: a task whose batch stays on the CPU breaks the meta step."""
    if not (DATA / "mnist" / ".verified").exists():
        pytest.skip("mnist not staged (make data)")
    import hpclb.tasks.classification as task_mod

    cfg = _cfg(tmp_path, "mnist-lstm", None, (512, 100), DATA)
    run = setup_run(cfg, SelfCommunicator(), device=META)
    run.task.start_epoch(0)
    monkeypatch.setattr(task_mod, "to_device", lambda batch, device: batch)
    with pytest.raises(RuntimeError, match="meta|device"):
        train_step(run, 0, torch.zeros(3, dtype=torch.float64, device=META))
    run.close()
