"""hpclb scale (recipe transfer, checked against hpclb.schedules' rules) and hpclb advise."""
import json
import math

import pytest
import yaml

from hpclb import cli
from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError
from hpclb.tools.scale import format_changes, scale_run, write_job
from hpclb.train.metrics import RunLogger

pytestmark = pytest.mark.timeout(120)
N = 60_000  # MNIST training images: hpclb.data.registry
ETA0, W0, B0 = 2e-3, 0.25, 128  # the packaged mnist-lstm recipe (adam)


def fake_run(tmp_path, batch=B0, scaling="legw", **overrides):
    """A run directory holding what `hpclb train` writes first: config.json."""
    cfg = resolve("mnist-lstm", batch_size=batch, scaling=scaling, **overrides)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": 2}))
    return run


@pytest.mark.parametrize("k", [2, 8, 64])
def test_legw_transfer_follows_the_schedule_rules(tmp_path, k):
    s = scale_run(fake_run(tmp_path), B0 * k)
    before, after = s.before, s.after
    assert before["k"] == 1 and after["k"] == k
    assert after["peak_lr"] == pytest.approx(ETA0 * math.sqrt(k))          # eta0 * sqrt(k)
    assert after["warmup_steps"] == before["warmup_steps"] == round(W0 * N / B0)  # same steps
    assert after["warmup_epochs"] == pytest.approx(W0 * k)                  # W0 * k epochs
    assert after["steps_per_epoch"] == math.ceil(N / (B0 * k))
    assert after["total_steps"] == math.ceil(20 * math.ceil(N / (B0 * k)))
    recipe = load_recipe(str(s.recipe_path))  # the B0 recipe, unscaled
    assert (recipe["base_batch_size"], recipe["warmup_epochs"]) == (B0, W0)
    assert recipe["optimizers"]["adam"]["lr"] == ETA0
    assert recipe["name"] == f"mnist-lstm-b{B0 * k}"
    assert s.command == f"mpirun -n 2 hpclb train {s.recipe_path} --batch-size {B0 * k} --scaling legw"
    # the printed command resolves to exactly the printed schedule
    sched = resolve(str(s.recipe_path), batch_size=B0 * k, scaling="legw").schedule(N)
    assert (sched.peak_lr, sched.warmup_steps, sched.total_steps) == (
        after["peak_lr"], after["warmup_steps"], after["total_steps"])


@pytest.mark.parametrize("scaling,lr_factor,warmup_epochs", [
    ("linear", 8, W0), ("sqrt", math.sqrt(8), W0), ("none", 1, W0)])
def test_other_schemes_keep_the_warmup_epochs(tmp_path, scaling, lr_factor, warmup_epochs):
    s = scale_run(fake_run(tmp_path), B0 * 8, scaling=scaling)
    assert s.after["peak_lr"] == pytest.approx(ETA0 * lr_factor)
    assert s.after["warmup_steps"] == round(warmup_epochs * N / (B0 * 8))
    assert s.recipe_path.name == f"recipe-b1024-{scaling}.yaml"


def test_run_overrides_are_folded_into_the_b0_recipe(tmp_path):
    run = fake_run(tmp_path, batch=1024, optimizer="momentum", lr=0.05, epochs=4)
    s = scale_run(run, 512, out=tmp_path / "out" / "r.yaml")
    recipe = yaml.safe_load(s.recipe_path.read_text())
    assert recipe["optimizer"] == "momentum" and recipe["optimizers"]["momentum"]["lr"] == 0.05
    assert recipe["epochs"] == 4
    assert s.before["batch"] == 1024 and s.before["peak_lr"] == pytest.approx(0.05 * 8 ** 0.5)
    assert s.after["peak_lr"] == pytest.approx(0.05 * 2)


def test_bad_requests_write_nothing(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ConfigError, match="--to-batch 16384 --scaling legw: .*warmup"):
        scale_run(run, 16384)
    assert not (run / "recipe-b16384-legw.yaml").exists()
    with pytest.raises(ConfigError, match="config.json"):
        scale_run(tmp_path, 256)
    with pytest.raises(ConfigError, match="--to-batch"):
        scale_run(run, 0)
    with pytest.raises(ConfigError, match="split evenly"):
        write_job(scale_run(run, 1024), "slurm", 3, 4)


def test_cli_scale_prints_changes_and_writes_the_job(tmp_path, capsys):
    run = fake_run(tmp_path)
    assert cli.main(["scale", str(run), "--to-batch", "8192", "--scheduler", "slurm",
                     "--nodes", "16", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "peak_lr" in out and "0.016" in out and "warmup_steps" in out
    assert out.count(f"hpclb train {run}/recipe-b8192-legw.yaml --batch-size 8192 "
                     f"--scaling legw") == 1
    job = (run / "recipe-b8192-legw.sbatch").read_text()
    assert "--batch-size 8192 --scaling legw" in job and "--expect-world-size 64" in job
    assert cli.main(["scale", str(run), "--to-batch", "8192", "--scheduler", "pbs"]) == 2
    assert "--nodes" in capsys.readouterr().err


def noisy_run(tmp_path, values):
    run = fake_run(tmp_path)
    with RunLogger(run, enabled=True, tensorboard=False) as rl:
        for e, (b, lo, hi) in enumerate(values, 1):
            rl.log_epoch({"epoch": e, "step": 10 * e, "noise": {
                "b_simple": b, "g2": 1.0, "trace": b, "b_simple_lo": lo, "b_simple_hi": hi,
                "n": 10}})
    return run


def test_advise_median_of_last_epochs_and_power_of_two_rule(tmp_path, capsys):
    run = noisy_run(tmp_path, [(50, 40, 60), (900, 700, 1100), (1500, 1200, 2100),
                               (1100, 1000, 1300)])
    assert cli.main(["advise", str(run)]) == 0
    out = capsys.readouterr().out
    assert "critical_batch 1100 " in out and "epochs 2-4" in out
    assert "range 700 - 2100" in out
    # at B0 the k_max prediction (4: the budget) caps the critical-batch rule's 1024
    assert "recommended_batch 512 (LEGW, k = 4" in out and "capped at k_max's batch 512" in out
    assert "512 - 512 over the range" in out
    # a run at another batch has no prediction: the rule alone, B0 x 2^j under 1100 (and over
    # the range 700 - 2100)
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "global_batch_size": 256}))
    assert cli.main(["advise", str(run)]) == 0
    out = capsys.readouterr().out
    assert "recommended_batch 1024 (LEGW, k = 8" in out and "512 - 2048 over the range" in out
    assert "capped" not in out
    assert cli.main(["advise", str(run), "--last", "1"]) == 0
    assert "critical_batch 1100 " in capsys.readouterr().out


def test_advise_without_noise_data_exits_2_naming_the_flag(tmp_path, capsys):
    run = fake_run(tmp_path)
    with RunLogger(run, enabled=True, tensorboard=False) as rl:
        rl.log_epoch({"epoch": 1, "step": 10, "train_loss": 1.0})
    assert cli.main(["advise", str(run)]) == 2
    assert "--noise-scale" in capsys.readouterr().err
    assert cli.main(["advise", str(tmp_path / "nowhere")]) == 2


def test_advise_recommends_no_batch_above_the_training_set(tmp_path, capsys):
    # MNIST's late-epoch noise scale (84k) exceeds its 60,000 training samples: the recommended
    # batch and its range stop at the largest B0 x 2^j within one epoch (a review finding)
    run = noisy_run(tmp_path, [(84000, 70000, 90000)] * 3)
    cfg = json.loads((run / "config.json").read_text())
    # a run at 2 x B0 (no k_max prediction to cap it): 235 steps of 256 hold >= 59,905 images
    cfg.update(steps_per_epoch=235, global_batch_size=256)
    (run / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["advise", str(run)]) == 0
    out = capsys.readouterr().out
    assert "recommended_batch 32768 (LEGW, k = 256" in out
    assert "nor the training set (>= 59905 samples)" in out and "32768 - 32768 over" in out


def test_a_new_budget_keeps_the_run_column_and_warns_of_a_long_warmup(tmp_path):
    """--epochs changes the new run only: the "run" column is the source run's schedule (it
    showed the new budget's total steps); a warmup over half the new run is warned, as the dry
    run warns (fresh-user review: 117 of 120 steps went by silently)."""
    run = fake_run(tmp_path, batch=512, epochs=2)  # 118 steps an epoch, 236 steps
    s = scale_run(run, 2048, epochs=4)   # LEGW at k = 16: 117 warmup steps of 30 x 4 = 120
    assert s.before["total_steps"] == 236 and s.after["total_steps"] == 120
    text = format_changes(s)
    assert "warning: warmup takes 98% of the new run (more than half): train more epochs " \
           "(--epochs) or scale to a smaller --to-batch" in text, text
    assert "warning" not in format_changes(scale_run(run, 256))  # 117 of 470 steps
