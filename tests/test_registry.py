"""The registries (data sets, models, optimizers, task kinds): importable without torch, and
adding a data set, a model or an optimizer is one registration, seen by validation, task
building and training alike."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hpclb.comm.local import SelfCommunicator
from hpclb.config import ConfigError, load_recipe, parse_recipe, resolve
from hpclb.data.registry import DATASETS, DataSet, register_dataset, train_set_sizes
from hpclb.models import MODELS
from hpclb.optim import OPTIMIZERS
from hpclb.tasks import ClassificationTask, build_task
from hpclb.tasks.registry import TASKS
from hpclb.train import loop as train_mod
from hpclb.train.setup import build_optimizer

pytestmark = pytest.mark.timeout(300)


def test_registries_import_without_torch():
    code = ("import sys\n"
            "import hpclb.data, hpclb.data.registry, hpclb.models, hpclb.optim, hpclb.tasks\n"
            "import hpclb.tasks.registry, hpclb.tasks.spec, hpclb.plugins\n"
            "from hpclb.data.registry import DATASETS\n"
            "from hpclb.models import MODELS\n"
            "from hpclb.optim import OPTIMIZERS\n"
            "from hpclb.tasks.registry import TASKS\n"
            "print(sorted(DATASETS), sorted(MODELS), sorted(OPTIMIZERS), sorted(TASKS))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mnist" in out.stdout and "lars" in out.stdout and "seq2seq" in out.stdout


def test_builtin_entries():
    assert list(DATASETS) == ["mnist", "fashion-mnist", "imagenet", "synthetic", "ptb",
                              "bible-en-es"]
    assert tuple(OPTIMIZERS) == ("sgd", "momentum", "adam", "lars", "lamb")
    assert sorted(MODELS) == ["gnmt", "lstm_lm", "mnist_lstm", "resnet50", "resnet_small"]
    assert {k: TASKS[k].model_args for k in TASKS} == {
        "classification": (), "language_model": ("vocab_size",),
        "seq2seq": ("src_vocab", "tgt_vocab"), "supervised": ()}
    assert TASKS.load("classification").task_class() is ClassificationTask
    # hpclb jobs' published sizes (was hpclb/tools/jobs.py TRAIN_SET_SIZES, less wmt16-de-en)
    assert {k: v[:2] for k, v in train_set_sizes().items()} == {
        "mnist": (60_000, "images"), "fashion-mnist": (60_000, "images"),
        "imagenet": (1_281_167, "images"), "synthetic": (1_281_167, "images"),
        "ptb": (929_589, "tokens"), "bible-en-es": (30_319, "sentence pairs")}


class TensorSplit:
    """A classification split held in two tensors: len(), subset(n), batch(indices)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, n: int) -> TensorSplit:
        return TensorSplit(self.x[:n], self.y[:n])

    def batch(self, indices):
        return self.x[indices], self.y[indices]


def _tiny_digits(root, data):
    """256 training and 64 test "images" [28, 28] whose label is the row with the largest sum."""
    g = torch.Generator().manual_seed(data.get("seed", 0))
    x = torch.rand(320, 28, 28, generator=g)
    y = x.sum(2).argmax(1) % 10
    return TensorSplit(x[:256], y[:256]), TensorSplit(x[256:], y[256:])


class TinyMLP(torch.nn.Module):
    def __init__(self, hidden: int = 16, num_classes: int = 10):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


def _nesterov(params, **hp):
    return torch.optim.SGD(params, nesterov=True, **{"momentum": 0.9, **hp})


@pytest.fixture
def registered():
    """A data set, a model and an optimizer added for one test (removed afterwards)."""
    register_dataset(DataSet("tiny-digits", _tiny_digits, ("classification",), 256, "images",
                             "random tensors made in the test", options=("seed",)))
    MODELS.register("tiny_mlp", TinyMLP)
    OPTIMIZERS.register("nesterov", _nesterov)
    yield
    DATASETS.unregister("tiny-digits")
    MODELS.unregister("tiny_mlp")
    OPTIMIZERS.unregister("nesterov")


def _recipe(tmp_path: Path, **changes) -> str:
    recipe = {"name": "tiny", "data": {"name": "tiny-digits", "seed": 1},
              "model": {"name": "tiny_mlp", "hidden": 8}, "base_batch_size": 64, "epochs": 1,
              "warmup_epochs": 0.25, "decay": {"name": "poly", "power": 2.0},
              "optimizer": "nesterov", "optimizers": {"nesterov": {"lr": 0.05}},
              "target": {"metric": "test_accuracy", "value": 0.99}}
    recipe.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def test_registered_dataset_validates_builds_and_trains(tmp_path, registered):
    path = _recipe(tmp_path)
    spec = parse_recipe(path)
    assert (spec.data.name, spec.data.get("seed"), spec.model.kwargs) == \
        ("tiny-digits", 1, {"hidden": 8})
    task = build_task(spec, tmp_path, train_samples=128)
    assert isinstance(task, ClassificationTask)
    assert (task.num_train_samples, task.num_test_samples) == (128, 64)
    out = tmp_path / "run"
    cfg = resolve(path, out=str(out), data_dir=str(tmp_path))
    summary = train_mod.train(cfg, SelfCommunicator(), quiet=True)
    assert summary["steps"] == 4 and summary["optimizer"] == "nesterov"
    assert 0 <= summary["final_test_accuracy"] <= 1
    written = json.loads((out / "config.json").read_text())
    assert written["recipe"] == load_recipe(path)  # the mapping as read, unchanged


def test_registered_names_in_messages(tmp_path, registered):
    with pytest.raises(ConfigError, match="did you mean 'tiny-digits'"):
        load_recipe(_recipe(tmp_path, data={"name": "tiny-digitz"}))
    with pytest.raises(ConfigError, match="a language_model task reads one of \\('ptb',\\), "
                                          "not 'tiny-digits'"):
        load_recipe(_recipe(tmp_path, task="language_model"))
    with pytest.raises(ConfigError, match="only the imagenet reader augments"):
        load_recipe(_recipe(tmp_path, data={"name": "tiny-digits", "augment": False}))
    with pytest.raises(ConfigError, match="model.hiden: not an argument"):
        load_recipe(_recipe(tmp_path, model={"name": "tiny_mlp", "hiden": 8}))
    model = TinyMLP()
    opt = build_optimizer("nesterov", model, {"lr": 0.1})
    assert opt.param_groups[0]["nesterov"] and opt.param_groups[0]["momentum"] == 0.9


def test_registry_refuses_silent_replacement(registered):
    with pytest.raises(ValueError, match="already registered"):
        register_dataset(DataSet("tiny-digits", _tiny_digits, ("classification",)))
    with pytest.raises(ValueError, match="already registered"):
        OPTIMIZERS.register("sgd", _nesterov)


def test_config_names_follow_the_registries(registered):
    import hpclb.config as config

    assert "tiny-digits" in config.DATASETS and "nesterov" in config.OPTIMIZERS
    assert config.TASKS["classification"][-1] == "tiny-digits"
    assert config.TASKS["language_model"] == ("ptb",)


@pytest.mark.parametrize("name", ["mnist-lstm", "ptb-large", "gnmt", "resnet-50"])
def test_recipe_spec_round_trip(name):
    import dataclasses

    raw = load_recipe(name)
    spec = parse_recipe(name)
    assert spec.to_dict() == raw and list(spec.to_dict()) == list(raw)
    assert spec.name == raw["name"] and spec.data.name == raw["data"]["name"]
    assert spec.optimizer_spec().params == raw["optimizers"][raw["optimizer"]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
