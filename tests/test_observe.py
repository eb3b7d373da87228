"""hpclb.train.metrics: metrics.jsonl step/epoch lines, TensorBoard event files read back, resume."""
import json
import logging
import sys
import time

import numpy as np
import pytest
import torch

from hpclb.train import metrics as observe
from hpclb.train.metrics import RunLogger, read_metrics, tensorboard_tag

pytestmark = pytest.mark.timeout(60)


def _events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_step_and_epoch_lines_and_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    with RunLogger(tmp_path, enabled=True) as rl:
        assert rl.tensorboard
        rl.log_step(10, {"loss": torch.tensor(2.5), "lr": 0.125, "grad_norm": np.float64(3.0),
                         "trust_min": 0.5, "trust_max": 4.0})
        rl.log_step(20, {"loss": 1.5, "lr": 0.25})
        rl.log_epoch({"epoch": 1, "step": 20, "train_loss": 2.0, "test_accuracy": 0.75,
                      "noise": {"b_simple": 64.0, "g2": 0.5, "n": 20}, "note": None})
        rl.histogram("trust/layers", torch.tensor([0.5, 1.0, 4.0]), 20)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"kind": "step", "step": 10, "loss": 2.5, "lr": 0.125, "grad_norm": 3.0,
                        "trust_min": 0.5, "trust_max": 4.0}
    assert lines[2]["kind"] == "epoch" and lines[2]["noise"]["b_simple"] == 64.0
    acc = _events(tmp_path)
    assert _scalars(acc, "train/loss") == [(10, 2.5), (20, 1.5)]
    assert _scalars(acc, "lr") == [(10, 0.125), (20, 0.25)]
    assert _scalars(acc, "grad/norm") == [(10, 3.0)]
    assert _scalars(acc, "trust/max") == [(10, 4.0)]
    assert _scalars(acc, "epoch/test/accuracy") == [(20, 0.75)]
    assert _scalars(acc, "epoch/noise/b_simple") == [(20, 64.0)]
    hist = acc.Histograms("trust/layers")
    assert hist[0].step == 20 and hist[0].histogram_value.num == 3
    assert hist[0].histogram_value.max == 4.0


def test_disabled_rank_writes_nothing(tmp_path):
    rl = RunLogger(tmp_path / "r", enabled=False, tensorboard=True)
    rl.log_step(1, {"loss": 1.0})
    rl.log_epoch({"epoch": 1, "step": 1})
    rl.histogram("x", torch.ones(2), 1)
    rl.close()
    assert not (tmp_path / "r").exists()


def test_resume_drops_lines_past_the_checkpoint(tmp_path):
    with RunLogger(tmp_path, enabled=True, tensorboard=False) as rl:
        for s in (5, 10, 15):
            rl.log_step(s, {"loss": float(s)})
        rl.log_epoch({"epoch": 1, "step": 10})  # a killed run's file: last epoch at step 10
        rl.log_step(20, {"loss": 20.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "st')  # torn by the kill
    with RunLogger(tmp_path, enabled=True, tensorboard=False, resume_step=10) as rl:
        rl.log_step(15, {"loss": -15.0})
    epochs, steps = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in steps] == [(5, 5.0), (10, 10.0), (15, -15.0)]
    assert epochs == [{"epoch": 1, "step": 10}]


def test_tensorboard_resume_purges_killed_events(tmp_path):
    pytest.importorskip("tensorboard")
    with RunLogger(tmp_path, enabled=True) as rl:
        for s in (1, 2, 3):
            rl.log_step(s, {"loss": float(s)})
    # a resumed run is a later process: its event file's name (events.out.tfevents.<seconds>.
    # <host>.<pid>.<n>) sorts after the killed run's by its time. In one process within one
    # second only <n> differs, and it sorts as text (".10" before ".9") once the process has
    # made ten writers (a flake under pytest-xdist); a new second keeps the real order.
    time.sleep(1.05)
    with RunLogger(tmp_path, enabled=True, resume_step=1) as rl:
        rl.log_step(2, {"loss": 20.0})
    assert _scalars(_events(tmp_path), "train/loss") == [(1, 1.0), (2, 20.0)]


def test_missing_tensorboard_says_how_to_get_it_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setattr(observe, "_hint_given", False)
    with caplog.at_level(logging.INFO, logger="hpclb"):
        for name in ("a", "b"):
            with RunLogger(tmp_path / name, enabled=True) as rl:
                assert not rl.tensorboard
                rl.log_step(1, {"loss": 1.0})
    hints = [r for r in caplog.records if "pip install 'hpclb[tensorboard]'" in r.getMessage()]
    assert len(hints) == 1
    assert not (tmp_path / "a" / "tb").exists()
    assert read_metrics(tmp_path / "a")[1] == [{"step": 1, "loss": 1.0}]


def test_read_metrics_old_runs_and_errors(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"epoch": 1, "step": 3, "train_loss": 1.0}\n'
        '{"kind": "step", "step": 4, "loss": 0.5}\n'
        '{"kind": "epoch", "epoch": 2, "step": 6}\n')
    epochs, steps = read_metrics(tmp_path)
    assert epochs == [{"epoch": 1, "step": 3, "train_loss": 1.0}, {"epoch": 2, "step": 6}]
    assert steps == [{"step": 4, "loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\nnot json\n{"epoch": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="hpclb train --out"):
        read_metrics(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="resume_step"):
        RunLogger(tmp_path, enabled=True, tensorboard=False, resume_step=-1)


def test_tags():
    assert tensorboard_tag("grad_norm") == "grad/norm"
    assert tensorboard_tag("comm_wait_s") == "time/comm_exposed_s"
    assert tensorboard_tag("train_loss", "epoch") == "epoch/train/loss"
    assert tensorboard_tag("lr", "epoch") == "epoch/lr"


@pytest.mark.mpi
def test_only_rank_zero_writes(comm, tmp_path):
    from pathlib import Path

    from conftest import all_ranks_ok

    run = Path(comm.broadcast_object(str(tmp_path))) / "mpi-run"  # rank 0's directory
    with RunLogger(run, enabled=comm.rank == 0, tensorboard=False) as rl:
        rl.log_step(1, {"rank": float(comm.rank)})
        rl.log_epoch({"epoch": 1, "step": 1, "rank": float(comm.rank)})
    comm.barrier()
    epochs, steps = read_metrics(run)
    all_ranks_ok(comm, steps == [{"step": 1, "rank": 0.0}] and epochs == [
        {"epoch": 1, "step": 1, "rank": 0.0}], f"rank {comm.rank} read {epochs} {steps}")
