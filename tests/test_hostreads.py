"""Device-to-host reads per training step, counted on the CPU (hpclb.train.hostreads).

Every packaged task (MNIST-LSTM and ResNet classification, the PTB language model, GNMT
translation), tiny, through the real training loop (``hpclb.train.loop.train``), with each
optimizer and precision: with LARS and LAMB a step reads nothing from the device (the
non-finite guard masks the update there); with SGD and Adam at most one read per step (the
guard's verdict, as ``GradScaler`` makes). Log steps and the epoch end (where statistics are read
on purpose) are left out of the count.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.config.recipe import load_recipe
from hpclb.train.hostreads import HostReadCounter, reads_per_step

DATA = Path(os.environ.get("HPCLB_DATA", Path(__file__).resolve().parents[1] / "data"))
LOG_EVERY = 4
OPTIMIZERS = {"sgd": {"lr": 0.1}, "adam": {"lr": 1e-3},
              "lars": {"lr": 1.0, "momentum": 0.9, "weight_decay": 1e-4,
                       "trust_coefficient": 0.02},
              "lamb": {"lr": 1e-3, "weight_decay": 0.01}}
# Each tiny: one epoch of 8 steps, the steps of a log point and the epoch's last step left out.
TASKS = {
    "mnist-lstm": ("mnist/train-images-idx3-ubyte", {
        "data": {"name": "mnist", "train_samples": 256, "test_samples": 64},
        "model": {"name": "mnist_lstm", "hidden_size": 8}}, 32),
    "fashion-resnet-cpu": ("fashion-mnist", {
        "data": {"name": "fashion-mnist", "train_samples": 128, "test_samples": 32},
        "model": {"name": "resnet_small", "depth": 8, "width": 4, "num_classes": 10,
                  "in_channels": 1}}, 16),
    "ptb-small-cpu": ("ptb/ptb.train.txt", {
        "data": {"name": "ptb", "bptt": 4, "eval_streams": 2, "train_samples": 64,
                 "test_samples": 8},
        "model": {"name": "lstm_lm", "hidden_size": 8, "num_layers": 1, "dropout": 0.0,
                  "init_scale": 0.1}}, 8),
    "gnmt-cpu": ("bible-en-es", {
        "data": {"name": "bible-en-es", "source": "en", "target": "es", "vocab_size": 200,
                 "max_length": 12, "train_samples": 128, "test_samples": 4,
                 "eval_samples": 2, "beam_size": 1},
        "model": {"name": "gnmt", "encoder_layers": 2, "decoder_layers": 2, "hidden_size": 8,
                  "dropout": 0.0}}, 16),
}


def _recipe(tmp_path: Path, experiment: str, changes: dict) -> str:
    recipe = load_recipe(experiment)
    recipe.update({"epochs": 1, "warmup_epochs": 0.25, "base_batch_size": 8,
                   "grad_clip_norm": 1.0, "optimizers": OPTIMIZERS, **changes})
    recipe.pop("target", None)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_the_counter_sees_reads():
    t = torch.arange(4.0)
    with HostReadCounter() as reads:
        t.sum().item()
        bool(t[0] == 0)
        float(t[1]), t.tolist(), t.cpu()
        t.sum()  # not a read
    assert [r.name for r in reads.reads] == ["item", "__bool__", "__float__", "tolist", "cpu"]
    assert reads.reads[0].where.endswith(f"test_hostreads.py:{_line_of('t.sum().item()')}")


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.strip() == text)


PRECISIONS = ("fp32", "bf16", "fp16")


def _cases():
    """Every task x optimizer x precision. In make test every task x optimizer at one precision
    (turning, so each optimizer and each task meets fp16's GradScaler and bf16); the other two
    precisions of each pair in make test-extended."""
    for ti, experiment in enumerate(TASKS):
        for oi, optimizer in enumerate(OPTIMIZERS):
            for pi, precision in enumerate(PRECISIONS):
                quick = pi == (ti + oi) % len(PRECISIONS)
                yield pytest.param(experiment, optimizer, precision,
                                   marks=[] if quick else [pytest.mark.extended],
                                   id=f"{experiment}-{optimizer}-{precision}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("experiment,optimizer,precision", list(_cases()))
def test_reads_per_step(tmp_path, experiment, optimizer, precision):
    probe, changes, batch = TASKS[experiment]
    if not (DATA / probe).exists():
        pytest.skip(f"{probe} not staged in {DATA}; run `make data`")
    cfg = resolve(_recipe(tmp_path, experiment, changes), out=str(tmp_path / "run"),
                  batch_size=batch, optimizer=optimizer, precision=precision, device="cpu",
                  log_every=LOG_EVERY, data_dir=str(DATA), scaling="none")
    windows = {s: w.reads for s, w in reads_per_step(cfg, SelfCommunicator()).items()}
    last = max(windows)
    assert last >= 6, windows
    plain = {s: w for s, w in windows.items() if s % LOG_EVERY and s != last}
    assert len(plain) >= 4, sorted(windows)
    allowed = 0 if optimizer in ("lars", "lamb") else 1
    over = {s: w for s, w in plain.items() if len(w) > allowed}
    assert not over, f"more than {allowed} host read(s) in a step: {over}"
    if optimizer not in ("lars", "lamb"):  # the guard's one read is really there and counted
        assert all(len(w) == 1 for w in plain.values()), plain
    assert all(windows[s] for s in windows if s % LOG_EVERY == 0), "a log step reads"
