"""``--resume`` continues a run with the settings it was made with: every setting that can change
a number is compared with the checkpoint's (a mismatch: exit 2 naming each field, both values and
the fix), what may change (locations, world size, accumulation, logging...) may; a finished run
is left as it is. Real command line in subprocesses, at 1 process and under ``mpirun -n 2``."""
import json
import shutil

import pytest
import yaml
from helpers import quick_recipe, run_hpclb

pytestmark = pytest.mark.timeout(300)
SMALL = {"name": "mnist", "train_samples": 512, "test_samples": 200}  # 4 steps at B 128


def hpclb(*args, ranks=1):
    p = run_hpclb(*args, ranks=ranks, timeout=180)
    return p.returncode, p.stdout + p.stderr


def record(run):
    """The bytes of the files a finished run's record consists of."""
    return {name: (run / name).read_bytes()
            for name in ("summary.json", "config.json", "metrics.jsonl", "checkpoint.pt")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mnist_dir):
    """(recipe, run directory) of a tiny finished run at 1 process."""
    tmp = tmp_path_factory.mktemp("finished")
    recipe = quick_recipe(tmp, data=SMALL)
    rc, out = hpclb("train", recipe, "--out", tmp / "run", "--data-dir", mnist_dir.parent)
    assert rc == 0, out
    return recipe, tmp / "run"


def edited(recipe, tmp_path, **changes):
    """A copy of ``recipe`` (another file) with ``changes`` (``"optimizers.adam.lr"``: a path)."""
    content = yaml.safe_load(open(recipe))
    for path, value in changes.items():
        *sections, key = path.split(".")
        node = content
        for s in sections:
            node = node[s]
        node[key] = value
    out = tmp_path / "copy.yaml"
    out.write_text(yaml.safe_dump(content))
    return out


def test_resume_with_other_hyper_parameters_is_refused_naming_each(finished, tmp_path,
                                                                   mnist_dir):
    """Before: a recipe whose LR and warmup changed resumed with exit 0 and rewrote the run's
    config.json and summary.json with the new peak LR."""
    recipe, done = finished
    run = tmp_path / "run"
    shutil.copytree(done, run)
    before = record(run)
    lr = yaml.safe_load(open(recipe))["optimizers"]["adam"]["lr"]
    other = edited(recipe, tmp_path, **{"optimizers.adam.lr": lr * 2, "warmup_epochs": 0.5})
    rc, out = hpclb("train", other, "--out", run, "--data-dir", mnist_dir.parent, "--resume")
    assert rc == 2, out
    assert "was made with other settings than this run's, 2 differ" in out, out
    assert f"optimizer_params (the recipe's optimizers.adam): {{\"lr\": {lr}" in out, out
    assert "recipe field warmup_epochs: 0.25 there, 0.5 now" in out, out
    assert "resume with the recipe and flags the run was started with" in out, out
    assert "another --out" in out and "epoch   1/" not in out, out
    assert record(run) == before
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent, "--resume",
                    "--seed", "7", "--precision", "fp32")
    assert rc == 2 and "seed (--seed): 0 there, 7 now" in out, out
    assert record(run) == before


def test_resume_may_change_locations_accumulation_and_logging(finished, tmp_path, mnist_dir):
    """The recipe at another path, another --data-dir spelling, --accumulation-steps,
    --log-every, --keep-checkpoints, --compile: resumed (the run stopped at its last step,
    its summary.json not yet written)."""
    recipe, done = finished
    run = tmp_path / "run"
    shutil.copytree(done, run)
    (run / "summary.json").unlink()
    moved = shutil.copy(recipe, tmp_path / "moved.yaml")
    rc, out = hpclb("train", moved, "--out", run, "--data-dir", f"{mnist_dir.parent}/.",
                    "--resume", "--accumulation-steps", "2", "--log-every", "1",
                    "--keep-checkpoints", "3", "--max-nonfinite-steps", "5")
    assert rc == 0 and "resumed from" in out, out
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_resume_of_a_finished_run_leaves_its_record(tmp_path, mnist_dir):
    """Before: resuming at 1 process a run finished on 2 ranks trained nothing but rewrote its
    summary.json and config.json as world size 1, micro-batch 128."""
    recipe = quick_recipe(tmp_path, data=SMALL)
    run = tmp_path / "run"
    args = ("train", recipe, "--batch-size", "256", "--accumulation-steps", "2", "--out", run,
            "--data-dir", mnist_dir.parent)
    rc, out = hpclb(*args, ranks=2)
    assert rc == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["micro_batch_size"]) == (2, 64)
    before = record(run)
    for resume in (["--resume"], ["--resume", "auto"]):
        rc, out = hpclb(*args, *resume)
        assert rc == 0, out
        assert f"--resume: {run} holds a finished run (mnist-lstm legw global batch 256 on 2 " \
               f"rank(s): test_accuracy" in out, out
        assert "after 2 steps" in out and "nothing left to train" in out, out
        shown = f"{100 * summary['final_test_accuracy']:.2f}%"  # as the epoch lines show it
        assert f"rank(s): test_accuracy {shown} after" in out, out
        assert "summary:" not in out and "epoch   1/" not in out, out
        assert record(run) == before
    rc, out = hpclb(*args, "--resume", ranks=2)
    assert rc == 0 and out.count("holds a finished run") == 1, out
    assert record(run) == before


def test_a_finished_run_without_a_metric_is_shown_not_called_unreadable(tmp_path):
    """A plug-in task with a loss and no metric finishes with ``metric_name: null``: --resume
    says what it holds (it said "its summary.json cannot be read (can only concatenate str (not
    "NoneType") to str)")."""
    from hpclb.train.rundir import _finished

    (tmp_path / "summary.json").write_text(json.dumps(
        {"experiment": "faults", "scaling": "legw", "global_batch_size": 64, "world_size": 2,
         "metric_name": None, "steps": 16}))
    msg = _finished(tmp_path, "ckpt.pt")
    assert "faults legw global batch 64 on 2 rank(s): after 16 steps" in msg, msg
    assert "cannot be read" not in msg and "nothing left to train" in msg


def test_resume_changed_is_one_declaration(tmp_path):
    """--resume-changed is declared once (a RunConfig option, #52): its flag and argparse type,
    its check in resolve() for the library alike, and the record in config.json come from it."""
    import argparse

    from hpclb.config import OPTIONS, resolve
    from hpclb.config.fields import add_option_flags
    from hpclb.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_option_flags(parser, OPTIONS)
    assert parser.parse_args(["--resume-changed", "data,code"]).resume_changed == ("data", "code")
    assert parser.parse_args([]).resume_changed == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--resume-changed", "weights"])
    cfg = resolve("mnist-lstm", resume=True, resume_changed=("data", "code", "data"),
                  out=str(tmp_path / "o"))
    assert cfg.resume_changed == ("code", "data") and cfg.to_dict()["resume_changed"] == \
        ("code", "data")
    for bad, resume in ((("weights",), True), (("code",), False)):
        with pytest.raises(ConfigError, match=r"^--resume-changed: .*takes code or data or both, "
                                              r"comma-separated .*and only with --resume"):
            resolve("mnist-lstm", resume=resume, resume_changed=bad, out=str(tmp_path / "o"))
