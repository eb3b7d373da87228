"""A recipe with its own loss and metrics (``task: {name: supervised, loss, metrics}``): the
regression example (examples/regression/: complete the lower half of an MNIST digit) trains
through the real command line at 1 process and under ``mpirun -n 2`` to the same numbers, and
``sweep``, ``plot`` and ``advise`` use the recipe's own metric and its direction; recipe typos
(a data option, a target metric the task does not report, a missing loss) are refused naming
the field and the valid choices."""
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO
from helpers import LAUNCH_ENV, run_hpclb

from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError
from hpclb.tasks.spec import metric_mode, primary_metric

pytestmark = pytest.mark.timeout(300)
EXAMPLE = REPO / "examples" / "regression" / "recipe.yaml"
ENV = dict(LAUNCH_ENV)


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # plug-in directories go away afterwards
    monkeypatch.delitem(sys.modules, "halves", raising=False)  # each test imports its copy


def train_cli(out: Path, ranks: int, *extra) -> dict:
    """One epoch of the example (64 steps of B = 128 on 8,192 digits); its summary."""
    p = run_hpclb("train", EXAMPLE, "--epochs", "1", "--out", out, *extra, ranks=ranks,
                  timeout=240, cwd=out.parent, env=ENV)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mnist_dir):
    """The example at 1 process and at 2 ranks (with the gradient noise scale)."""
    tmp = tmp_path_factory.mktemp("regression")
    ENV["HPCLB_DATA"] = str(mnist_dir.parent)  # this module's copy of LAUNCH_ENV
    return {1: (tmp / "one", train_cli(tmp / "one", 1)),
            2: (tmp / "two", train_cli(tmp / "two", 2, "--noise-scale"))}


def mean_image_mse(mnist_dir) -> float:
    """The test MSE of predicting the training subset's mean lower half (the baseline)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import halves

    train, test = halves.mnist_halves(str(mnist_dir.parent))
    mean = train.tensors[1][:8192].mean(0)
    return float(((test.tensors[1] - mean) ** 2).mean())


@pytest.mark.slow
def test_regression_example_learns_and_ranks_agree(runs, mnist_dir):
    (_, one), (_, two) = runs[1], runs[2]
    assert one["task"] == "supervised" and one["metric_name"] == "test_mse"
    assert {"final_test_mse", "final_test_mae", "final_test_loss"} <= set(one)
    assert "final_test_accuracy" not in one
    assert one["final_test_mse"] < 0.8 * mean_image_mse(mnist_dir)  # learnt, not the mean
    for key in ("final_test_mse", "final_test_mae", "final_test_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    assert two["world_size"] == 2 and one["steps"] == two["steps"] == 64


@pytest.mark.slow
def test_plot_advise_and_evaluate_read_the_regression_run(runs, tmp_path, mnist_dir,
                                                          monkeypatch):
    pytest.importorskip("matplotlib")
    from hpclb.tools.advise import advise
    from hpclb.tools.evaluate import evaluate_run
    from hpclb.tools.plot import plot_runs

    run, summary = runs[2]
    _, fig = plot_runs([run], tmp_path / "p.png")
    assert fig.axes[1].get_ylabel() == "test_mse"
    assert advise(run)["recommended_batch"] >= 128
    monkeypatch.chdir(tmp_path)  # the plug-ins are found through the saved plugin_path
    scored = evaluate_run(run, SelfCommunicator(), data_dir=str(mnist_dir.parent))
    assert scored["test_mse"] == pytest.approx(summary["final_test_mse"], rel=1e-5)


@pytest.mark.slow
def test_sweep_reports_the_recipe_metric_lower_is_better(tmp_path, mnist_dir):
    from hpclb.tools import sweep

    rows = sweep.run_sweep(str(EXAMPLE), [128, 256], ["legw"], epochs=1,
                           data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
                           runs_dir=tmp_path / "runs", log=lambda m: None)
    assert [r["metric_name"] for r in rows] == ["test_mse", "test_mse"]
    assert all(0 < r["metric"] < 1 for r in rows)
    table = (tmp_path / "res" / "regression-mnist-halves.md").read_text()
    assert "Final test_mse (lower is better)" in table


def test_direction_and_metric_come_from_the_recipe():
    recipe = load_recipe(str(EXAMPLE))
    assert primary_metric(recipe) == "test_mse" and metric_mode("test_mse", recipe) == "min"
    mae = {**recipe, "target": {"metric": "test_mae"}}
    assert metric_mode("test_mae", mae) == "min"  # from the name: an error
    no_target = {k: v for k, v in recipe.items() if k != "target"}
    assert primary_metric(no_target) == "test_mse"  # the task's first metric, not accuracy
    r2 = {**recipe, "target": {"metric": "test_r2", "mode": "max"}}
    assert metric_mode("test_r2", r2) == "max" and metric_mode("test_r2_loss", r2) == "min"
    from hpclb.tools.sweep import metric_of

    assert metric_of(no_target) == ("test_mse", "min")


def _write(tmp_path: Path, **changes) -> str:
    """The example recipe with ``changes``, beside a copy of its plug-ins."""
    recipe = yaml.safe_load(EXAMPLE.read_text())
    recipe.update(changes)
    (tmp_path / "halves.py").write_text((EXAMPLE.parent / "halves.py").read_text())
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.parametrize("changes,message", [
    ({"target": {"metric": "test_accuracy"}}, r"target.metric: 'test_accuracy' is not a metric "
     r"of the supervised task; it reports train_loss, test_loss, test_ma?s?e, test_ma?s?e"),
    ({"task": {"name": "supervised"}}, r"task.loss: required by task supervised"),
    ({"task": {"name": "supervised", "loss": "halves:nope"}}, r"task.loss: .*has no attribute "
     r"'nope'"),
    ({"task": {"name": "supervised", "loss": "halves:mse", "metrics": {"loss": "halves:mse"}}},
     r"task.metrics: must map metric names \(identifiers other than loss\)"),
    ({"task": {"name": "supervized", "loss": "halves:mse"}}, r"task.name: 'supervized' is not "
     r"one of .*\(did you mean 'supervised'\?\)"),
    ({"task": {"name": "supervised", "los": "halves:mse"}}, r"task.los: not a task field "
     r"\(did you mean 'loss'\?\)"),
    ({"task": {"name": "classification", "loss": "halves:mse"}}, r"task.loss: the "
     r"classification task has its own loss"),
    ({"data": {"name": "halves:mnist_halves", "train_sample": 64}},
     r"data.train_sample: not a data option \(did you mean 'train_samples'\?\)"),
])
def test_recipe_mistakes_name_the_field_and_the_choices(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(_write(tmp_path, **changes))


def test_builtin_data_option_typo_and_unreported_target(tmp_path):
    recipe = load_recipe("mnist-lstm")
    for changes, message in (
            ({"data": {"name": "mnist", "train_sample": 512}},
             r"data.train_sample: not an option of data set 'mnist' \(did you mean "
             r"'train_samples'\?\); it takes name, train_samples, test_samples"),
            ({"target": {"metric": "test_acc", "value": 0.9}},
             r"target.metric: 'test_acc' is not a metric of the classification task \(did you "
             r"mean 'test_accuracy'\?\)")):
        path = tmp_path / "m.yaml"
        path.write_text(yaml.safe_dump({**recipe, **changes}))
        with pytest.raises(ConfigError, match=message):
            load_recipe(str(path))


def test_loss_error_names_the_phase_step_and_line(tmp_path, mnist_dir):
    from hpclb.train.loop import train
    from hpclb.train.usercode import describe

    path = _write(tmp_path, data={"name": "halves:mnist_halves", "train_samples": 1024,
                                  "test_samples": 256})
    (tmp_path / "halves.py").write_text((tmp_path / "halves.py").read_text() + textwrap.dedent(
        """
        CALLS = []


        def flaky(output, y):
            CALLS.append(1)
            if len(CALLS) == 3:
                raise ValueError("my loss broke")  # FLAKY
            return mse(output, y)
        """))
    recipe = yaml.safe_load(Path(path).read_text())
    recipe["task"]["loss"] = "halves:flaky"
    Path(path).write_text(yaml.safe_dump(recipe))
    cfg = resolve(path, epochs=1, out=str(tmp_path / "run"), data_dir=str(mnist_dir.parent))
    with pytest.raises(ValueError, match="my loss broke") as e:
        train(cfg, SelfCommunicator(), quiet=True)
    line = next(i for i, t in enumerate((tmp_path / "halves.py").read_text().splitlines(), 1)
                if "FLAKY" in t)
    text = describe(e.value)
    assert "in the loss function (task.loss) of global step 3" in text, text
    assert f"{tmp_path / 'halves.py'}:{line} (in flaky)" in text and "HPCLB_TRACEBACK=1" in text


def test_float_targets_keep_their_dtype_and_shape(tmp_path, mnist_dir):
    from hpclb.tasks import build_task

    task = build_task(load_recipe(_write(tmp_path)), str(mnist_dir.parent), train_samples=64)
    x, y = task.train_set.batch(torch.arange(5))
    assert x.shape == (5, 14, 28) and y.shape == (5, 14, 28) and y.dtype == torch.float32
