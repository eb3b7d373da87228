"""`hpclb evaluate RUN_DIR`: a finished run's checkpoint scores what its last epoch reported."""
import json

import pytest
from helpers import quick_recipe

from hpclb import cli
from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.errors import ConfigError
from hpclb.tools.evaluate import evaluate_run
from hpclb.train import loop as train_mod


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, mnist_dir):
    tmp = tmp_path_factory.mktemp("evaluate")
    cfg = resolve(quick_recipe(tmp), out=str(tmp / "run"), batch_size=512, epochs=2,
                  data_dir=str(mnist_dir.parent))
    summary = train_mod.train(cfg, SelfCommunicator(), quiet=True)
    return tmp / "run", summary


def test_checkpoint_scores_the_final_metric(finished_run):
    run_dir, summary = finished_run
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    result = evaluate_run(run_dir, SelfCommunicator())
    assert result["test_accuracy"] == summary["final_test_accuracy"]
    assert result["global_step"] == summary["steps"] and result["decoding"] is None
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # read-only


def test_cli_prints_json(finished_run, capsys):
    run_dir, summary = finished_run
    assert cli.main(["evaluate", str(run_dir)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["test_accuracy"] == summary["final_test_accuracy"]


def test_bad_inputs_name_the_fix(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    with pytest.raises(ConfigError, match="seq2seq runs only"):
        evaluate_run(run_dir, SelfCommunicator(), beam_size=4)
    with pytest.raises(ConfigError, match="hpclb train --out"):
        evaluate_run(tmp_path, SelfCommunicator())
    assert cli.main(["evaluate", str(tmp_path)]) == 2
    assert "config.json: not found" in capsys.readouterr().err
    (tmp_path / "config.json").write_text((run_dir / "config.json").read_text())
    assert cli.main(["evaluate", str(tmp_path)]) == 2  # no checkpoint yet: a ConfigError
    err = capsys.readouterr().err
    assert "checkpoint.pt: not found; the run has not saved a checkpoint yet" in err, err
    assert "--resume" not in err and err.count("hpclb: error:") == 1
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert cli.main(["evaluate", str(tmp_path)]) == 1  # corrupt: CheckpointError
    assert "CheckpointError" in capsys.readouterr().err


def test_a_damaged_newest_checkpoint_falls_back_as_resume_does(finished_run, tmp_path, capsys,
                                                                caplog):
    """The newest generation damaged (bytes flipped): evaluate scores the previous generation
    with a warning naming the damaged file, as `hpclb train --resume` would read it; with every
    generation damaged it fails (exit 1) listing each file."""
    import shutil

    from hpclb.train.checkpoint import CheckpointStore

    run_dir, summary = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    gens = CheckpointStore(copy).generations()
    assert len(gens) == 2  # the epoch-1 and epoch-2 checkpoints
    (copy / "checkpoint.pt").unlink()  # a hard link to the newest: damage the file itself
    newest = gens[-1][2]
    newest.write_bytes(newest.read_bytes()[:-64] + bytes(64))
    assert cli.main(["evaluate", str(copy)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["epoch"] == 1 and out["global_step"] < summary["steps"]
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert newest.name in warned and "unusable" in warned and f"reading {gens[0][2]}" in warned
    old = gens[0][2]
    old.write_bytes(old.read_bytes()[:-64] + bytes(64))
    assert cli.main(["evaluate", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and newest.name in err and old.name in err
    assert err.count(str(newest)) == 1 and err.count(str(old)) == 1, err  # each named once
