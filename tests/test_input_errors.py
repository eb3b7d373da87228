"""Inputs that used to be accepted silently or to end in a bare traceback, each now refused with
exit 2 and one line naming the field or file and the fix, before anything is written (issue 34,
item 4): a training budget no run can mean (``epochs: 1.0e12`` trained until killed) and user
files that are not UTF-8 (a Latin-1 recipe gave a ``UnicodeDecodeError`` without the file's
name). Real command line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import quick_recipe, run_hpclb

from hpclb import schedules
from hpclb.config import load_recipe
from hpclb.errors import BudgetTooLarge, ConfigError, JobError
from hpclb.tools.jobs import JobSpec, render

pytestmark = pytest.mark.timeout(200)


def refused(p, *fragments: str) -> str:
    """The output of a run that must have exited 2 with one error line holding ``fragments``."""
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "Traceback" not in out and out.count("hpclb: error:") == 1, out
    for f in fragments:
        assert f in out, out
    return out


# --- budgets ----------------------------------------------------------------------------------

def test_schedule_refuses_more_than_max_total_steps():
    kw = dict(base_lr=0.1, base_batch_size=1, base_warmup_epochs=0.0, global_batch_size=1,
              num_samples=1000, scheme="none")
    at_limit = schedules.Schedule.from_recipe(epochs=schedules.MAX_TOTAL_STEPS / 1000, **kw)
    assert at_limit.total_steps == schedules.MAX_TOTAL_STEPS == 10 ** 9
    with pytest.raises(BudgetTooLarge, match=r"1e\+09 optimizer steps \(1e\+06 epochs x 1000 "
                                             r"steps per epoch\) is more than the 1e\+09"):
        schedules.Schedule.from_recipe(epochs=1.000001e6, **kw)


@pytest.mark.parametrize("where, recipe_epochs, args, message", [
    ("recipe", 1.0e12, [], "quick.yaml: epochs: 1e+12 epochs is at least 1e+12 optimizer steps "
                           "(one or more per epoch), more than the 1e+09 steps any run can mean"),
    ("flag", 1, ["--epochs", "1e12"], "--epochs: 1e+12 epochs is at least 1e+12 optimizer steps"),
])
def test_absurd_epochs_are_refused_before_any_work(tmp_path, where, recipe_epochs, args,
                                                   message):
    p = run_hpclb("train", quick_recipe(tmp_path, epochs=recipe_epochs), *args, "--out",
                  tmp_path / "run", "--data-dir", tmp_path / "nodata", timeout=120)
    refused(p, message, "give the training budget in epochs")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_too_many_steps_at_the_runs_batch_are_refused_naming_the_steps(tmp_path, mnist_dir,
                                                                       ranks):
    """1e8 epochs of 32 steps (4,096 images at batch 128) = 3.2e9 steps: refused on every rank
    once the data's size is known, before the run directory is made."""
    p = run_hpclb("train", quick_recipe(tmp_path), "--epochs", "1e8", "--out", tmp_path / "run",
                  "--data-dir", mnist_dir.parent, ranks=ranks, timeout=150)
    refused(p, "--epochs 1e+08: 3.2e+09 optimizer steps (1e+08 epochs x 32 steps per epoch) is "
               "more than the 1e+09 steps any run can mean at --batch-size 128 on 4096 samples",
            "at most 3.125e+07 at this batch")
    assert not (tmp_path / "run").exists()


def test_job_with_too_many_steps_is_refused():
    with pytest.raises(JobError, match=r"4.69e\+10 optimizer steps \(1e\+08 epochs x 469 steps"):
        render(JobSpec("mnist-lstm", "slurm", 1, 1, epochs=1e8))


# --- files that are not UTF-8 -----------------------------------------------------------------

def latin1_recipe(tmp_path) -> tuple[str, int]:
    """A valid recipe with a Latin-1 'é' in a comment; (path, the byte offset of the 'é')."""
    text = yaml.safe_dump(load_recipe(quick_recipe(tmp_path))) + "# caf\xe9\n"
    path = tmp_path / "latin.yaml"
    path.write_bytes(text.encode("latin-1"))
    return str(path), len(text) - 2


@pytest.mark.parametrize("command", [["train"], ["jobs", "render"]])
def test_latin1_recipe_names_the_file_the_byte_and_utf8(tmp_path, command):
    path, at = latin1_recipe(tmp_path)
    extra = ["--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "1"] \
        if command[0] == "jobs" else ["--data-dir", tmp_path / "nodata"]
    p = run_hpclb(*command, path, "--out", tmp_path / "run", *extra, timeout=120)
    refused(p, f"latin.yaml: byte {at} (0xe9, line", "is not UTF-8; recipes are UTF-8 text: "
                                                    "save the file as UTF-8")
    assert not (tmp_path / "run").exists()


def test_utf8_recipe_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + Path(quick_recipe(tmp_path)).read_bytes())
    assert load_recipe(str(path))["name"] == "mnist-lstm"


def test_load_recipe_raises_config_error_for_latin1(tmp_path):
    path, at = latin1_recipe(tmp_path)
    with pytest.raises(ConfigError, match=rf"latin.yaml: byte {at} \(0xe9, line \d+, column 6\)"):
        load_recipe(path)


@pytest.mark.parametrize("content, message", [
    (b'{"recipe": "caf\xe9"}', "config.json: byte 15 (0xe9, line 1, column 16) is not UTF-8"),
    (b'{"recipe": ', "config.json: not JSON (Expecting value"),
])
@pytest.mark.parametrize("command", ["scale", "evaluate"])
def test_run_config_not_utf8_or_not_json_names_the_file(tmp_path, command, content, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes(content)
    args = ["--to-batch", "256"] if command == "scale" else []
    refused(run_hpclb(command, run, *args, timeout=120), message)
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_sweep_results_not_utf8_name_the_file(tmp_path):
    path = tmp_path / "sweep.json"
    data = json.dumps([{"batch_size": 1, "note": "x"}]).encode().replace(b"x", b"\xe9")
    path.write_bytes(data)
    at = data.index(b"\xe9")
    refused(run_hpclb("plot", "sweep", path, timeout=120),
            f"sweep.json: byte {at} (0xe9, line 1, column {at + 1}) is not UTF-8; sweep results "
            f"are UTF-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]
