"""One checkpoint schema for `hpclb train` and the library's `hpclb.Checkpointer`
(hpclb/train/checkpointer.py), and a Checkpointer that loads little of hpclb."""
import json
import subprocess
import sys

import pytest
import torch
from helpers import LAUNCH_ENV, quick_recipe, run_hpclb
from torch import nn

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.errors import ConfigError
from hpclb.sync.optimizer import DistributedOptimizer
from hpclb.train import loop as train_mod
from hpclb.train.checkpoint import load_checkpoint
from hpclb.train.checkpointer import POSITION_KEYS, STATE_KEYS, Checkpointer
from hpclb.train.rundir import check_resumable
from hpclb.train.setup import build_optimizer, build_recipe_model

#: the most hpclb modules `import hpclb; hpclb.Checkpointer` may load (docs/design.md)
MAX_CHECKPOINTER_MODULES = 25


def test_checkpointer_loads_few_hpclb_modules():
    """The library's Checkpointer needs the communicator, the checkpoint store, the RNG streams
    and the preemption flag: not the recipe schema, the tasks, the loop or its progress bar
    (tqdm itself comes with torch)."""
    code = ("import sys, hpclb; hpclb.Checkpointer; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('hpclb')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=LAUNCH_ENV, timeout=120, check=True).stdout.split()
    assert "hpclb.train.checkpointer" in out
    assert len(out) <= MAX_CHECKPOINTER_MODULES, out
    for heavy in ("hpclb.train.progress", "hpclb.config", "hpclb.tasks", "hpclb.train.loop",
                  "hpclb.train.setup", "hpclb.sync.optimizer"):
        assert heavy not in out, (heavy, out)


def _library_checkpoint(out) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()
    ckpt = Checkpointer(out, model, opt, sched, comm=SelfCommunicator())
    try:
        path = ckpt.save(7, extra={"epoch": 1})
    finally:
        ckpt.close()
    return load_checkpoint(path)


def _train(tmp_path, mnist_dir):
    data = {"name": "mnist", "train_samples": 1024, "test_samples": 500}
    cfg = resolve(quick_recipe(tmp_path, warmup_epochs=0.1, data=data),
                  out=str(tmp_path / "run"), batch_size=512, epochs=1,
                  data_dir=str(mnist_dir.parent))
    train_mod.train(cfg, SelfCommunicator(), quiet=True)
    return cfg, load_checkpoint(tmp_path / "run" / "checkpoint.pt")


@pytest.mark.slow
def test_hpclb_train_and_the_library_write_one_schema(tmp_path, mnist_dir):
    lib = _library_checkpoint(tmp_path / "lib")
    _, run = _train(tmp_path, mnist_dir)
    assert tuple(lib) == tuple(run) == STATE_KEYS
    assert (lib["global_step"], lib["world_size"], lib["extra"], lib["run"]) == (7, 1,
                                                                             {"epoch": 1}, None)
    assert all(lib[k] is None for k in POSITION_KEYS + ("task", "steplog"))
    assert lib["scheduler"]["last_epoch"] == 1 and len(lib["rng"]) == 1
    assert (run["global_step"], run["epoch"], run["step_in_epoch"], run["extra"]) == (2, 1, 0, {})
    assert run["run"]["experiment"] and len(run["history"]) == 1


@pytest.mark.slow
def test_an_hpclb_train_checkpoint_resumes_in_the_library_checkpointer(tmp_path, mnist_dir):
    """A recipe's run continued in one's own loop: the model and the optimizer's state (momentum)
    come back, with the global step."""
    cfg, saved = _train(tmp_path, mnist_dir)
    model = build_recipe_model(cfg, {})
    comm = SelfCommunicator()
    opt = DistributedOptimizer(build_optimizer(cfg.optimizer, model, cfg.optimizer_params),
                               model, comm=comm)
    ckpt = Checkpointer(tmp_path / "run", model, opt, comm=comm)
    try:
        assert ckpt.resume() == (saved["global_step"], {})
    finally:
        ckpt.close()
        opt.close()
    assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    mine, theirs = opt.state_dict()["state"], saved["optimizer"]["state"]
    assert mine.keys() == theirs.keys() and mine
    assert all(torch.equal(mine[i][k], v) for i in theirs for k, v in theirs[i].items()
               if isinstance(v, torch.Tensor))


def test_hpclb_train_resume_refuses_a_library_checkpoint(tmp_path):
    """`hpclb train --resume` continues a recipe's run (its settings are checked, its position in
    an epoch restored); a library loop's checkpoint has neither: refused, naming why (exit 2)."""
    state = _library_checkpoint(tmp_path / "lib")
    cfg = resolve(quick_recipe(tmp_path), out=str(tmp_path / "lib"), resume=True)
    with pytest.raises(ConfigError, match=r"library loop \(hpclb.Checkpointer\), not by hpclb "
                                          r"train.*no run settings"):
        check_resumable(cfg, state, tmp_path / "lib" / "checkpoint.pt")


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_hpclb_train_names_a_library_checkpoint_directory_given_as_out(tmp_path, flag):
    """`hpclb train --out DIR` on a library loop's checkpoint directory: exit 2, nothing
    touched, and the message says what the files are (hpclb.Checkpointer's, with no run's
    config.json) rather than only "files hpclb did not write"."""
    _library_checkpoint(tmp_path / "lib")
    before = sorted(p.name for p in (tmp_path / "lib").rglob("*"))
    p = run_hpclb("train", quick_recipe(tmp_path), "--out", tmp_path / "lib", flag,
                  timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "hpclb.Checkpointer" in p.stderr and "config.json" in p.stderr, p.stderr
    assert sorted(p.name for p in (tmp_path / "lib").rglob("*")) == before


MID_WINDOW = '''
import hashlib, json, os, signal, sys
import torch
import torch.nn.functional as F
import hpclb
out, sig_at = sys.argv[1], int(sys.argv[2])
comm = hpclb.init()
torch.manual_seed(0)
x_all = torch.randn(128, 8)
ds = torch.utils.data.TensorDataset(x_all, (x_all.sum(1) > 0).long())
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 model, accumulation_steps=2)
loader = hpclb.shard_loader(ds, batch_size=16, generator=torch.Generator())
ckpt = hpclb.Checkpointer(out, model, opt, seed=0)
start, _ = ckpt.resume()
step = start
for epoch in range(start // len(loader), 2):
    loader.batch_sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        if epoch * len(loader) + i < step:
            continue
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()  # hpclb's loop: after every micro-batch, the second of each pair updates
        step += 1
        if step == sig_at:
            os.kill(os.getpid(), signal.SIGUSR2)
        ckpt.step_done(step)
ckpt.close()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print(json.dumps({"resumed_from": start, "updates": opt.steps, "sha": digest.hexdigest()}))
'''


def test_a_signal_inside_an_accumulation_window_is_saved_at_the_windows_end(tmp_path):
    """hpclb's accumulation loop (``step()`` after every micro-batch, K = 2) and
    ``step_done()`` after every ``step()``: a SIGUSR2 after micro-batch 7 (half a window) is
    saved at micro-batch 8, and the resumed run ends with the uninterrupted run's weights (before:
    step 7 was saved without its gradient, and the resumed run silently lost it)."""
    script = tmp_path / "mid_window.py"
    script.write_text(MID_WINDOW)

    def run(out, sig_at):
        return subprocess.run([sys.executable, str(script), str(out), str(sig_at)],
                              capture_output=True, text=True, timeout=120, env=LAUNCH_ENV)

    whole = run(tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr
    cut = run(tmp_path / "cut", 7)
    assert cut.returncode == 75 and "checkpoint of step 8 saved" in cut.stderr, cut.stderr
    resumed = run(tmp_path / "cut", 0)
    assert resumed.returncode == 0, resumed.stderr
    a, b = json.loads(whole.stdout), json.loads(resumed.stdout)
    assert b["resumed_from"] == 8 and b["updates"] == a["updates"] == 8
    assert b["sha"] == a["sha"]


def test_preemption_flag_carries_rank_0s_checkpoint_clock(monkeypatch):
    """``checkpoint_interval_s``: agreed() sets checkpoint_now once the clock is that far past
    checkpoint_saved() (no signal: not a stop), and checkpoint_saved() restarts it."""
    from hpclb.train import preemption as pre

    clock = {"t": 50.0}
    monkeypatch.setattr(pre.time, "monotonic", lambda: clock["t"])
    flag = pre.PreemptionFlag(checkpoint_interval_s=10.0)
    never = pre.PreemptionFlag()
    try:
        comm = SelfCommunicator()
        clock["t"] = 59.0
        assert not flag.agreed(comm) and not flag.checkpoint_now
        clock["t"] = 60.0
        assert not flag.agreed(comm) and flag.checkpoint_now
        assert not never.agreed(comm) and not never.checkpoint_now
        flag.checkpoint_saved()
        assert not flag.agreed(comm) and not flag.checkpoint_now
    finally:
        never.restore()
        flag.restore()
