"""An exception from the user's own plug-in code names the phase (model constructor, data
function, forward/backward at global step N), the rank, the user's file:line and how to get the
traceback; an optimizer hyper-parameter typo names the optimizer and what it takes. Real command
line, 1 process and ``mpirun -n 2``."""
import re
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
        if ranks > 1:
            assert re.search(r"rank \d of 2", err), err


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
