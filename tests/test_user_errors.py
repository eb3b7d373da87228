"""An exception from the user's own plug-in code names the phase (model constructor, data
function, forward/backward at global step N), the rank, the user's file:line and how to get the
traceback; an optimizer hyper-parameter typo names the optimizer and what it takes. Real command
line, 1 process and ``mpirun -n 2``."""
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import run_hpclb

from hpclb.config import load_recipe
from hpclb.errors import ConfigError

pytestmark = pytest.mark.timeout(200)

MODELS = '''
from torch import nn


class BadInit(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.name = "layer %s" % (width, 2)  # BUG-INIT


class BadForward(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("my forward broke")  # BUG-FORWARD
        return self.lin(x)
'''
DATA = '''
import os

import torch
from torch.utils.data import TensorDataset


class BadSamples(TensorDataset):
    def __getitem__(self, i):
        if i >= 64:  # in the first batch already (the samples are shuffled)
            raise OSError("sample %d unreadable" % i)  # BUG-GETITEM
        return super().__getitem__(i)


def blobs(data_dir, missing=False, faulty=False):
    if missing:
        os.listdir(os.path.join(data_dir, "no-such-dir"))  # BUG-DATA
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    train = (BadSamples if faulty else TensorDataset)(x, y)
    return train, TensorDataset(x[:64], y[:64])
'''


def write(tmp_path: Path, model: str, **data) -> Path:
    (tmp_path / "u_models.py").write_text(textwrap.dedent(MODELS))
    (tmp_path / "u_data.py").write_text(textwrap.dedent(DATA))
    recipe = {"name": "u", "data": {"name": "u_data:blobs", **data},
              "model": {"name": f"u_models:{model}"}, "base_batch_size": 32, "epochs": 1,
              "warmup_epochs": 0.1, "decay": {"name": "poly", "power": 2.0},
              "optimizer": "adam", "optimizers": {"adam": {"lr": 0.01}}}
    path = tmp_path / "u.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def train(recipe: Path, ranks: int):
    p = run_hpclb("train", recipe, "--out", recipe.parent / f"run{ranks}", ranks=ranks,
                  timeout=150, cwd=recipe.parent)
    return p.returncode, p.stdout + p.stderr


def line_of(source: str, marker: str) -> int:
    """The line number of ``marker`` in ``source`` as written to the module file."""
    return next(i for i, text in enumerate(textwrap.dedent(source).splitlines(), 1)
                if marker in text)


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("hpclb: error:")]


USER_FAULTS = [
    ("BadInit", {}, "in the model constructor (model.name)",
     f"u_models.py:{line_of(MODELS, 'BUG-INIT')} (in __init__)", "TypeError"),
    ("BadForward", {"missing": True}, "in the data function (data.name)",
     f"u_data.py:{line_of(DATA, 'BUG-DATA')} (in blobs)", "FileNotFoundError"),
    ("BadForward", {}, "in the forward/backward of global step 3",
     f"u_models.py:{line_of(MODELS, 'BUG-FORWARD')} (in forward)", "my forward broke"),
]


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_a_failing_getitem_is_a_data_loading_error_naming_the_data_set(tmp_path, ranks):
    """A data set whose ``__getitem__`` raises is reported as a data loading error in that data
    set (its data.name and class), not as the forward/backward."""
    path = write(tmp_path, "BadForward", faulty=True)
    recipe = yaml.safe_load(path.read_text())
    recipe["model"] = {"name": "u_models:Plain"}
    path.write_text(yaml.safe_dump(recipe))
    (tmp_path / "u_models.py").write_text(textwrap.dedent(MODELS) + PLAIN)
    rc, out = train(path, ranks)
    assert rc == 1, out
    errors = error_lines(out)
    assert errors, out
    for err in errors:
        assert "OSError" in err and "unreadable" in err, err
        assert "forward/backward" not in err, err
        assert re.search(r"a data loading error, in the data set data.name 'u_data:blobs' "
                         r"\(BadSamples.__getitem__\) for global step [0-9]+, at \S*u_data.py:"
                         + str(line_of(DATA, "BUG-GETITEM")) + r" \(in __getitem__\)", err), err


PLAIN = '''

class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)
'''


@pytest.mark.parametrize("ranks,model,data,phase,line,text", [
    *[(1, *f) for f in USER_FAULTS],  # under mpirun -n 2: the forward in make test (it names
    *[pytest.param(2, *f, marks=[] if i == 2 else [pytest.mark.extended])  # the global step),
      for i, f in enumerate(USER_FAULTS)]])  # the other phases in make test-extended
def test_user_exception_names_phase_rank_and_line(tmp_path, ranks, model, data, phase, line,
                                                  text):
    rc, out = train(write(tmp_path, model, **data), ranks)
    assert rc == 1, out
    errors = error_lines(out)
    assert errors, out
    for err in errors:
        assert text in err and phase in err and f"{tmp_path}/{line}" in err, err
        assert "HPCLB_TRACEBACK=1" in err, err
        if ranks > 1 and "global step" in phase:  # one rank's failure: named
            assert re.search(r"rank \d of 2", err), err
    if ranks > 1 and "global step" not in phase:
        # a start-up phase that fails on every rank alike (hpclb.train.agreed): printed once,
        # by rank 0, without a rank
        assert len(errors) == 1, out


def test_optimizer_typo_names_the_optimizer_and_its_arguments(tmp_path):
    path = write(tmp_path, "BadForward")
    recipe = yaml.safe_load(path.read_text())
    recipe["optimizers"]["lars"] = {"lr": 1.0, "momentun": 0.9}
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError) as e:
        load_recipe(str(path))
    msg = str(e.value)
    assert "optimizers.lars.momentun: not a hyper-parameter of the lars optimizer" in msg
    assert "did you mean 'momentum'" in msg and "trust_coefficient" in msg


# --- a model the recipe describes wrongly: exit 2 naming the field, in the run and the dry run ---

def mnist_recipe(tmp_path: Path, name: str, **model) -> Path:
    """The packaged MNIST-LSTM recipe on 256 images with ``model`` fields changed."""
    recipe = load_recipe("mnist-lstm")
    recipe.update({"warmup_epochs": 0.25, "epochs": 1,
                   "data": {"name": "mnist", "train_samples": 256, "test_samples": 100}})
    recipe["model"].update(model)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def hpclb_train(recipe: Path, out: Path, *args, ranks: int = 1, data=None):
    p = run_hpclb("train", recipe, "--out", out, *([] if data is None else ["--data-dir", data]),
                  *args, ranks=ranks, timeout=150, cwd=recipe.parent)
    return p.returncode, p.stdout + p.stderr


def no_torch_blame(out: str) -> None:
    assert "Traceback" not in out and "torch/nn/modules" not in out, out


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_model_value_the_constructor_refuses_names_the_recipe_field(tmp_path, mnist_dir,
                                                                     ranks, dry):
    """``model.hidden_size: -4`` ended with exit 1 blaming torch/nn/modules/rnn.py, and the
    dry run said yes (exit 0)."""
    recipe = mnist_recipe(tmp_path, "neg.yaml", hidden_size=-4)
    rc, out = hpclb_train(recipe, tmp_path / "o", *(["--dry-run"] if dry else []), ranks=ranks,
                          data=mnist_dir.parent)
    assert rc == 2, out
    no_torch_blame(out)
    assert "dry run:" not in out, out
    errors = error_lines(out)
    assert errors and all("recipe mnist-lstm: model.hidden_size: -4: refused by model "
                          "'mnist_lstm' (ValueError: hidden_size must be greater than zero); "
                          "fix model.hidden_size in the recipe" in e for e in errors), out
    assert not (tmp_path / "o").exists()  # refused before --out is touched


PLUGIN_MODELS = '''
from torch import nn


def returns_dict(size=1):
    return {"size": size}


class Checked(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        if width % 2:
            raise ValueError(f"width must be even, got {width}")
        self.lin = nn.Linear(784, width)
'''


@pytest.mark.parametrize("model,message", [
    ({"name": "u_plug:returns_dict", "size": 2},
     "recipe u: model.name: 'u_plug:returns_dict' returned a dict, not a torch.nn.Module"),
    ({"name": "u_plug:Checked", "width": 3},
     "recipe u: model.width: 3: refused by model 'u_plug:Checked' (ValueError: width must be "
     "even, got 3); fix model.width in the recipe"),
])
def test_the_dry_run_refuses_a_plugin_model_as_the_run_does(tmp_path, mnist_dir, model,
                                                             message):
    """A plug-in factory returning a dict: the dry run said yes (exit 0), the run refused it."""
    (tmp_path / "u_plug.py").write_text(PLUGIN_MODELS)
    recipe = {"name": "u", "data": {"name": "mnist", "train_samples": 256, "test_samples": 100},
              "model": model, "base_batch_size": 32, "epochs": 1, "warmup_epochs": 0.1,
              "decay": {"name": "poly", "power": 2.0}, "optimizer": "adam",
              "optimizers": {"adam": {"lr": 0.01}}}
    path = tmp_path / "u.yaml"
    path.write_text(yaml.safe_dump(recipe))
    said = []
    for dry in (["--dry-run"], []):
        rc, out = hpclb_train(path, tmp_path / "o", *dry, data=mnist_dir.parent)
        assert rc == 2 and "dry run:" not in out, out
        no_torch_blame(out)
        said.append(error_lines(out))
        assert len(said[-1]) == 1 and message in said[-1][0], out
    assert said[0] == said[1]  # the same words in the dry run and the run
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def run16(tmp_path_factory, mnist_dir):
    """A finished run of MNIST-LSTM with model.hidden_size 16 (2 steps)."""
    tmp = tmp_path_factory.mktemp("run16")
    recipe = mnist_recipe(tmp, "r16.yaml", hidden_size=16)
    rc, out = hpclb_train(recipe, tmp / "run", data=mnist_dir.parent)
    assert rc == 0, out
    return tmp / "run"


def files_of(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` but the lock: its bytes and modification time."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".hpclb.lock"}


@pytest.mark.parametrize("args", [["--resume"], ["--resume", "auto"],
                                  ["--resume", "auto", "--dry-run"]])
def test_resume_with_another_model_names_the_field_and_changes_nothing(run16, tmp_path,
                                                                       mnist_dir, args):
    """``hidden_size`` 16 -> 32 on --resume: exit 1 with torch's "size mismatch" naming
    torch/nn/modules/module.py; now exit 2 naming the field and both values."""
    before = files_of(run16)
    recipe = mnist_recipe(tmp_path, "r32.yaml", hidden_size=32)
    rc, out = hpclb_train(recipe, run16, *args, data=mnist_dir.parent)
    assert rc == 2, out
    no_torch_blame(out)
    assert "size mismatch" not in out and "dry run:" not in out, out
    assert "--resume: model.hidden_size: 16 in the checkpoint's run, 32 now (recipe " \
           "mnist-lstm)" in out, out
    assert files_of(run16) == before


def test_resume_of_another_model_without_its_config_names_the_parameter(run16, tmp_path,
                                                                        mnist_dir):
    """Where config.json no longer says what the run used, the checkpoint's recipe does (a
    checkpoint written before it held one: its parameters' shapes, named by the load)."""
    run = tmp_path / "run"
    shutil.copytree(run16, run)
    (run / "config.json").unlink()
    before = files_of(run)
    recipe = mnist_recipe(tmp_path, "r32.yaml", hidden_size=32)
    rc, out = hpclb_train(recipe, run, "--resume", data=mnist_dir.parent)
    assert rc == 2, out
    no_torch_blame(out)
    assert "--resume: model.hidden_size: 16 in the checkpoint's run, 32 now" in out, out
    assert files_of(run) == before
