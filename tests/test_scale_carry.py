"""``hpclb scale RUN --to-batch B [--scheduler ...]`` carries everything the source run used
(its data directory, seed and run settings) into the recipe, the printed command and the job
script, and its errors name only flags ``hpclb scale`` has (before: the job dropped the data
directory and seed, and a warmup error suggested ``--batch-size``/``--epochs``, which scale
did not take)."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from hpclb import cli
from hpclb.cli import scale as scale_cli
from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError
from hpclb.tools.scale import scale_run, write_job

pytestmark = pytest.mark.timeout(120)
SETTINGS = {"precision": "bf16", "log_every": 7, "noise_scale": True, "max_nonfinite_steps": 5,
            "keep_checkpoints": 4, "device": "cpu"}


def source_run(tmp_path, data_root="/scratch/hpclb-data"):
    cfg = resolve("mnist-lstm", batch_size=256, seed=3, data_dir="rel/data",
                  accumulation_steps=2, **SETTINGS)
    run = tmp_path / "run"
    run.mkdir()
    record = {**cfg.to_dict(), "world_size": 2}
    if data_root:
        record["data_root"] = data_root
    (run / "config.json").write_text(json.dumps(record))
    return run


def _train_argv(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("TRAIN=("))
    return shlex.split(line[len("TRAIN=("):-1])


def test_recipe_command_and_job_carry_the_source_settings(tmp_path):
    s = scale_run(source_run(tmp_path), 1024)
    recipe = load_recipe(str(s.recipe_path))
    assert {k: recipe[k] for k in SETTINGS} == SETTINGS
    assert recipe["accumulation_steps"] == 2
    assert s.command.endswith("--scaling legw --seed 3 --data-dir /scratch/hpclb-data")
    assert s.command.startswith("mpirun -n 2 hpclb train ")  # the source ran on 2 ranks
    cfg = resolve(str(s.recipe_path), batch_size=1024)
    assert {k: getattr(cfg, k) for k in SETTINGS} == SETTINGS
    job = write_job(s, "slurm", 2, 4).read_text()
    argv = _train_argv(job)
    assert argv[argv.index("--seed") + 1] == "3"
    assert argv[argv.index("--data-dir") + 1] == "$HPCLB_DATA"
    assert "export HPCLB_DATA=/scratch/hpclb-data" in job
    assert argv[argv.index("--batch-size") + 1] == "1024"


def test_without_recorded_data_root_the_given_data_dir_is_carried(tmp_path):
    s = scale_run(source_run(tmp_path, data_root=None), 512)
    assert s.data_dir == "rel/data" and "--data-dir rel/data" in s.command


def _scale_flags() -> set[str]:
    import argparse
    p = argparse.ArgumentParser()
    scale_cli.add_parser(p.add_subparsers())
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices["scale"]._actions for o in a.option_strings}


def test_errors_name_only_flags_scale_has_and_the_fix_works(tmp_path, capsys):
    run = source_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        scale_run(run, 16384)
    message = str(e.value)
    named = set(re.findall(r"--[a-z][a-z-]*", message))
    assert {"--to-batch", "--epochs"} <= named, message
    assert named <= _scale_flags(), (named - _scale_flags(), message)
    at_least = float(re.search(r"--epochs, at least ([0-9.]+)", message).group(1))
    assert cli.main(["scale", str(run), "--to-batch", "16384", "--epochs", str(at_least)]) == 0
    assert "total_steps" in capsys.readouterr().out
    assert load_recipe(str(run / "recipe-b16384-legw.yaml"))["epochs"] == at_least
