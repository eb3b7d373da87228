"""Plug-in models and data in recipes (``package.module:attribute``, hpclb/plugins.py).

The example recipe (examples/plugin/) trains through the real command line at 1 process and
under ``mpirun -n 2``; every broken plug-in fails before training with a message naming the
recipe field and why; a small plug-in trains in process on every rank (``--with-mpi``) and
equals the same run on rank 0 alone.
"""
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, all_ranks_ok
from helpers import run_hpclb, train_multi_and_single

from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError
from hpclb.models import build_model
from hpclb.tasks import DatasetSplit, build_task

pytestmark = pytest.mark.timeout(120)
EXAMPLE = REPO / "examples" / "plugin" / "recipe.yaml"
_ids = itertools.count()


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # plug-in directories go away afterwards


def plugin(tmp_path: Path, source: str) -> str:
    """Write ``source`` as a uniquely named module in ``tmp_path``; returns the module name."""
    name = f"h6_plug_{os.getpid()}_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def recipe(tmp_path: Path, model: dict, data: dict, **changes) -> str:
    """A small classification recipe beside the plug-ins in ``tmp_path``; returns its path."""
    r = {"name": "plug", "data": data, "model": model, "base_batch_size": 32, "epochs": 4,
         "warmup_epochs": 0.25, "decay": {"name": "poly", "power": 2.0, "end_lr": 0.0},
         "optimizer": "adam", "optimizers": {"adam": {"lr": 0.05}}, **changes}
    path = tmp_path / "plug.yaml"
    path.write_text(yaml.safe_dump(r))
    return str(path)


BLOBS = """
    import torch
    from torch.utils.data import TensorDataset

    def blobs(data_dir, n=512, dim=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        centres = 3 * torch.randn(4, dim, generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        x = centres[y] + torch.randn(n, dim, generator=g)
        return TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]), TensorDataset(x[n * 3 // 4:],
                                                                            y[n * 3 // 4:])
"""


# --- the example through the real command line --------------------------------------------------

def run_cli(args, ranks: int, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return run_hpclb("train", *args, ranks=ranks, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def example_one_process(tmp_path_factory, mnist_dir):
    """`hpclb train examples/plugin/recipe.yaml` from the repository root, 1 process."""
    out = tmp_path_factory.mktemp("example") / "one"
    p = run_cli(["examples/plugin/recipe.yaml", "--out", out, "--data-dir", mnist_dir.parent],
                ranks=1, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    return {**json.loads((out / "summary.json").read_text()), "out": out}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_recipe_trains_to_its_target(example_one_process):
    s = example_one_process
    assert s["experiment"] == "plugin-mnist-mlp" and s["world_size"] == 1 and s["steps"] == 128
    assert s["final_test_accuracy"] >= 0.90, s  # measured 0.9236 (8,192 MNIST images, 2 epochs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_recipe_two_ranks_equals_one_process(example_one_process, tmp_path, mnist_dir):
    """Under mpirun -n 2, started from another directory (the plug-ins are found beside the
    recipe on both ranks): the same result to fp32 rounding."""
    p = run_cli([EXAMPLE, "--out", tmp_path / "two", "--data-dir", mnist_dir.parent], ranks=2,
                cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = example_one_process
    assert two["world_size"] == 2 and two["steps"] == one["steps"]
    assert two["final_test_loss"] == pytest.approx(one["final_test_loss"], rel=1e-5, abs=1e-7)
    assert abs(two["final_test_accuracy"] - one["final_test_accuracy"]) <= 2e-4  # <= 2 images


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_run_evaluates_from_another_directory(example_one_process, tmp_path,
                                                      monkeypatch, mnist_dir):
    """`hpclb evaluate RUN_DIR` of a plug-in run finds the plug-ins through the saved recipe's
    plugin_path and scores the checkpoint as training did."""
    from hpclb.tools.evaluate import evaluate_run

    monkeypatch.chdir(tmp_path)
    result = evaluate_run(example_one_process["out"], SelfCommunicator(),
                          data_dir=str(mnist_dir.parent))
    assert result["test_loss"] == pytest.approx(example_one_process["final_test_loss"],
                                                rel=1e-6)
    assert result["test_accuracy"] == example_one_process["final_test_accuracy"]


# --- a small plug-in in process, on every rank ---------------------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_plugin_trains_on_every_rank_like_on_one(comm, tmp_path_factory):
    """`torch.nn:Linear` (an installed class) on a plug-in data function: learns the blobs, and
    the run on all ranks equals the one on rank 0 alone."""
    tmp = Path(comm.broadcast_object(str(tmp_path_factory.mktemp("plug"))
                                     if comm.rank == 0 else None))
    if comm.rank == 0:
        module = plugin(tmp, BLOBS)
        path = recipe(tmp, {"name": "torch.nn:Linear", "in_features": 8, "out_features": 4},
                      {"name": f"{module}:blobs", "n": 512})
    path = comm.broadcast_object(path if comm.rank == 0 else None)
    multi, single = train_multi_and_single(comm, path, str(tmp), batch_size=64)
    ok = multi["final_test_accuracy"] >= 0.9 and abs(
        multi["final_test_loss"] - single["final_test_loss"]) <= 1e-5 * single["final_test_loss"]
    all_ranks_ok(comm, ok, f"multi {multi['final_test_loss']} {multi['final_test_accuracy']}, "
                           f"single {single['final_test_loss']}")


def test_adapter_collates_samples_into_batches(tmp_path):
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.full((2, 3), float(i)), i % 3  # y a plain int

    split = DatasetSplit(Items())
    x, y = split.batch(torch.tensor([4, 1, 7]))
    assert x.shape == (3, 2, 3) and x[:, 0, 0].tolist() == [4.0, 1.0, 7.0]
    assert y.dtype == torch.int64 and y.tolist() == [1, 1, 1]
    x0, y0 = split.batch(torch.tensor([], dtype=torch.int64))
    assert x0.shape == (0, 2, 3) and y0.shape == (0,)
    assert len(split.subset(4)) == 4 and split.subset(4).batch([3])[0][0, 0, 0] == 3.0

    class Batched(Items):
        calls = 0

        def __getitems__(self, idx):  # one call per batch, not one per sample
            Batched.calls += 1
            return [(torch.full((2, 3), float(i)), i % 3) for i in idx]

        def __getitem__(self, i):
            raise AssertionError("per-sample access where __getitems__ exists")

    x, y = DatasetSplit(Batched()).batch(torch.tensor([2, 5]))
    assert Batched.calls == 1 and x[:, 0, 0].tolist() == [2.0, 5.0] and y.tolist() == [2, 2]


def test_build_task_cuts_a_plugin_data_set_to_train_samples(tmp_path):
    module = plugin(tmp_path, BLOBS)
    r = load_recipe(recipe(tmp_path, {"name": "torch.nn:Linear", "in_features": 8,
                                      "out_features": 4},
                           {"name": f"{module}:blobs", "n": 400, "train_samples": 100}))
    assert r["plugin_path"][0] == str(tmp_path.resolve())
    task = build_task(r, tmp_path, train_samples=100, test_samples=None)
    assert (task.num_train_samples, task.num_test_samples) == (100, 100)
    x, y = task.test_set.batch(torch.arange(5))
    assert x.shape == (5, 8) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_cfg_run_from_config_json_imports_from_plugin_path(tmp_path, monkeypatch):
    """A run's saved recipe (config.json: `hpclb evaluate`) finds its plug-ins from any
    directory: build_task puts the recipe's plugin_path on sys.path."""
    module = plugin(tmp_path, BLOBS)
    saved = load_recipe(recipe(tmp_path, {"name": "torch.nn:Linear", "in_features": 8,
                                          "out_features": 4}, {"name": f"{module}:blobs"}))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path.resolve())])
    monkeypatch.chdir(REPO)
    task = build_task(json.loads(json.dumps(saved)), None)
    assert task.num_train_samples == 384


# --- broken plug-ins: each says why, naming the field --------------------------------------------

MODELS = """
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, hidden_size=16, width=None):
            super().__init__()
            self.fc = nn.Linear(8, hidden_size)

    class NotAModel:
        def __init__(self, size=1):
            pass

    def returns_dict(size=1):
        return {"size": size}

    def needs_width(width):
        return nn.Linear(8, width)

    NUMBER = 3
"""


@pytest.mark.parametrize("name,args,message", [
    ("h6_nowhere_xyz:MLP", {}, r"model.name: 'h6_nowhere_xyz:MLP': module 'h6_nowhere_xyz' not "
     r"found \(looked in the current directory"),
    ("{m}:MLp", {}, r"model.name: '{m}:MLp': {m} \(.*{m}.py\) has no attribute 'MLp' \(did you "
     r"mean 'MLP'\?\)"),
    ("{m}:NUMBER", {}, r"model.name: '{m}:NUMBER' is a int, not callable"),
    ("{m}.py:MLP", {}, r"model.name: '{m}.py:MLP' is not a plug-in name; write it as "
     r"package.module:attribute"),
    ("mlp", {}, r"model.name: 'mlp' is not one of \['gnmt', .*\] and not a plug-in "
     r"package.module:attribute"),
    ("{m}:NotAModel", {}, r"model.name: '{m}:NotAModel' is the class NotAModel, not a "
     r"torch.nn.Module subclass"),
    ("{m}:MLP", {"hiden_size": 3}, r"model.hiden_size: not an argument of model {m}:MLP \(did "
     r"you mean 'hidden_size'\?\); it takes hidden_size, width"),
    ("{m}:needs_width", {}, r"model.width: required by model {m}:needs_width \(no default\); "
     r"add `width: <value>`"),
])
def test_broken_model_plugin_fails_at_load_naming_why(tmp_path, name, args, message):
    m = plugin(tmp_path, MODELS)
    path = recipe(tmp_path, {"name": name.format(m=m), **args}, {"name": "mnist"})
    with pytest.raises(ConfigError, match=message.format(m=m)):
        load_recipe(path)


def test_broken_module_import_says_why(tmp_path):
    missing_dep = plugin(tmp_path, "import h6_not_installed_dep\n")
    raises = plugin(tmp_path, "raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match=rf"model.name: '{missing_dep}:M': importing module "
                       rf"'{missing_dep}' failed: No module named 'h6_not_installed_dep' \(a "
                       rf"module it imports is missing"):
        load_recipe(recipe(tmp_path, {"name": f"{missing_dep}:M"}, {"name": "mnist"}))
    with pytest.raises(ConfigError, match=rf"importing module '{raises}' raised RuntimeError: "
                       rf"boom at import"):
        load_recipe(recipe(tmp_path, {"name": f"{raises}:M"}, {"name": "mnist"}))


def test_factory_returning_the_wrong_thing_fails_at_build(tmp_path):
    m = plugin(tmp_path, MODELS)
    load_recipe(recipe(tmp_path, {"name": f"{m}:returns_dict", "size": 2}, {"name": "mnist"}))
    with pytest.raises(ConfigError, match=rf"model.name: '{m}:returns_dict' returned a dict, not "
                       rf"a torch.nn.Module"):
        build_model(f"{m}:returns_dict", size=2)
    assert isinstance(build_model(f"{m}:MLP", hidden_size=4), torch.nn.Module)


DATA = """
    import torch
    from torch.utils.data import TensorDataset

    def one_split(data_dir):
        return TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))

    def float_labels(data_dir):
        d = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
        return d, d

    def not_pairs(data_dir):
        d = TensorDataset(torch.zeros(4, 2))
        return d, d

    def lists(data_dir):
        return [1, 2], [3, 4]

    def empty(data_dir):
        d = TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
        return d, d

    def no_dir():
        return None

    def sized(data_dir, n=4):
        d = TensorDataset(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))
        return d, d
"""


@pytest.mark.parametrize("fn,extra,message", [
    ("one_split", {}, r"data.name '{m}:one_split' returned TensorDataset .*; a data function "
     r"returns a pair \(train_dataset, test_dataset\)"),
    ("float_labels", {}, r"data.name '{m}:float_labels': sample 0 of its train split is tuple "
     r".*not an \(x, y\) pair with y an integer class label"),
    ("not_pairs", {}, r"sample 0 of its train split is tuple .*not an \(x, y\) pair"),
    ("lists", {}, r"sample 0 of its train split is int .*not an \(x, y\) pair"),
    ("empty", {}, r"data.name '{m}:empty': its train split is empty"),
])
def test_data_function_returning_the_wrong_thing(tmp_path, fn, extra, message):
    m = plugin(tmp_path, DATA)
    r = load_recipe(recipe(tmp_path, {"name": "torch.nn:Linear", "in_features": 2,
                                      "out_features": 2}, {"name": f"{m}:{fn}", **extra}))
    with pytest.raises(ConfigError, match=message.format(m=m)):
        build_task(r, tmp_path)


@pytest.mark.parametrize("fn,extra,changes,message", [
    ("no_dir", {}, {}, r"data.name: '{m}:no_dir' must take the data directory \(a str\) as its "
     r"first argument"),
    ("sized", {"size": 3}, {}, r"data.size: not an argument of data function {m}:sized \(did "
     r"you mean 'n'\?\)|data.size: not an argument of data function {m}:sized; it takes n"),
    ("sized", {}, {"task": "language_model"}, r"data.name: a plug-in data set .* feeds a "
     r"classification or supervised task, not language_model"),
    ("nothing_here", {}, {}, r"data.name: '{m}:nothing_here': {m} .* has no attribute "
     r"'nothing_here'"),
])
def test_broken_data_plugin_fails_at_load(tmp_path, fn, extra, changes, message):
    m = plugin(tmp_path, DATA)
    path = recipe(tmp_path, {"name": "torch.nn:Linear", "in_features": 2, "out_features": 2},
                  {"name": f"{m}:{fn}", **extra}, **changes)
    with pytest.raises(ConfigError, match=message.format(m=m)):
        load_recipe(path)


def test_plugin_errors_through_the_command_line(tmp_path, capsys):
    """Exit 2 with one message, before any work, for a plug-in that does not import."""
    import signal

    from hpclb import cli
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    path = recipe(tmp_path, {"name": "h6_nowhere_xyz:MLP"}, {"name": "mnist"})
    try:
        rc = cli.main(["train", path, "--out", str(tmp_path / "o")])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert rc == 2 and "module 'h6_nowhere_xyz' not found" in err, err
    assert err.count("hpclb: error:") == 1 and not (tmp_path / "o").exists()


def test_plugin_run_resolves_in_process(tmp_path):
    m = plugin(tmp_path, BLOBS)
    cfg = resolve(recipe(tmp_path, {"name": "torch.nn:Linear", "in_features": 8,
                                    "out_features": 4}, {"name": f"{m}:blobs"}),
                  out=str(tmp_path / "o"))
    assert cfg.recipe["data"]["name"] == f"{m}:blobs"
    from hpclb.train import loop as train_mod
    s = train_mod.train(cfg, SelfCommunicator(), quiet=True)
    assert s["final_test_accuracy"] >= 0.9, s


def test_job_templates_render_a_plugin_recipe():
    """`hpclb jobs render` counts a plug-in data set by its data.train_samples (the LEGW plan in
    the script's header needs the training-set size)."""
    from hpclb.config import load_recipe
    from hpclb.tools.jobs import train_set_size

    recipe = load_recipe(str(REPO / "examples" / "plugin" / "recipe.yaml"))
    assert train_set_size(recipe) == (8192, "samples")
