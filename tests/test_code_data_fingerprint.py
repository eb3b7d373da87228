"""No silent wrong answers from code or data that differ (issue 50, items 1 and 2): the ranks
compare the content of the recipe's plug-in modules and of the data files before training, and
``--resume`` compares them with the checkpoint's. Before, two ranks whose plug-in module differed
in one constant averaged the gradients of two models with exit 0, ranks whose MNIST labels
differed trained on two data sets, and ``--resume`` after an edit of the module, or with
Fashion-MNIST under MNIST's file names, trained on without a word. Real ``mpirun`` (MPMD: one
command line per rank) and ``hpclb train`` subprocesses, a few steps each."""
from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import quick_recipe, run_hpclb
from torch import nn

from hpclb._io import sha256_file
from hpclb.data.manifest import fingerprint_files
from hpclb.data.registry import dataset
from hpclb.errors import ModelMismatchError
from hpclb.plugins import source_digests
from hpclb.sync.agree import check_model_consistency
from tests.test_rank_settings import launch

pytestmark = pytest.mark.timeout(300)
SMALL = {"name": "mnist", "train_samples": 512, "test_samples": 200}  # 4 steps at B 128
MODULE = '''import torch
from torch import nn

SCALE = {scale}


class MLP(nn.Module):
    def __init__(self, hidden_size=16):
        super().__init__()
        self.a, self.b = nn.Linear(784, hidden_size), nn.Linear(hidden_size, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1).float() * SCALE)))
'''


def plugin_recipe(folder: Path, scale: float = 1.0) -> str:
    """A recipe in ``folder`` whose model is the plug-in ``fp_model:MLP`` beside it, its forward
    scaled by the constant ``scale``; trains 4 steps on MNIST."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fp_model.py").write_text(MODULE.format(scale=scale))
    path = quick_recipe(folder, data=SMALL)
    recipe = yaml.safe_load(open(path))
    recipe["model"] = {"name": "fp_model:MLP", "hidden_size": 16}
    Path(path).write_text(yaml.safe_dump(recipe))
    return path


def mnist_copy(folder: Path, mnist_dir: Path, *, labels_byte: bool = False) -> Path:
    """A data directory ``folder/mnist`` holding MNIST's four files (no ``.verified``: a copy
    made by hand), the training labels copied, the images linked; ``labels_byte``: the first
    training label changed (still a digit)."""
    (folder / "mnist").mkdir(parents=True)
    for f in mnist_dir.glob("*-idx?-ubyte"):
        (folder / "mnist" / f.name).symlink_to(f)
    labels = folder / "mnist" / "train-labels-idx1-ubyte"
    labels.unlink()
    data = bytearray((mnist_dir / labels.name).read_bytes())
    if labels_byte:
        data[8] = (data[8] + 1) % 10
    labels.write_bytes(bytes(data))
    return folder


def test_two_ranks_whose_plugin_module_differs_in_a_constant_all_exit_2(tmp_path, mnist_dir):
    """Rank 1's copy of the recipe's plug-in module has another constant in forward (same
    parameter names and shapes): both ranks exit 2 naming the module and both digests."""
    a, b = plugin_recipe(tmp_path / "A", 1.0), plugin_recipe(tmp_path / "B", 2.0)
    out, exits = launch([[a], [b]], [{}, {}], ["--out", str(tmp_path / "run"), "--data-dir",
                                                str(mnist_dir.parent), "--no-tensorboard"])
    assert exits == {0: 2, 1: 2}, out[-3000:]
    digests = [sha256_file(tmp_path / d / "fp_model.py") for d in ("A", "B")]
    assert "the ranks disagree on 1 plug-in module(s) or data file(s) by content: plug-in " \
           f"module fp_model is \"{digests[0][:20]}" in out, out[-3000:]
    assert f"on rank 0 but \"{digests[1][:20]}" in out, out[-3000:]
    assert "a stale node-local copy?" in out and "epoch   1/" not in out, out[-3000:]
    assert not (tmp_path / "run" / "summary.json").exists()


def test_two_ranks_whose_mnist_labels_differ_all_exit_2(tmp_path, mnist_dir):
    """Each rank's --data-dir holds its own MNIST copy, rank 1's with one label changed: both
    exit 2 naming the labels file; the paths may differ, the content may not."""
    d0 = mnist_copy(tmp_path / "node0", mnist_dir)
    d1 = mnist_copy(tmp_path / "node1", mnist_dir, labels_byte=True)
    recipe = quick_recipe(tmp_path, data=SMALL)
    out, exits = launch([[recipe, "--data-dir", str(d0)], [recipe, "--data-dir", str(d1)]],
                        [{}, {}], ["--out", str(tmp_path / "run"), "--no-tensorboard"])
    assert exits == {0: 2, 1: 2}, out[-3000:]
    assert "plug-in module(s) or data file(s) by content: data file train-labels-idx1-ubyte " \
           "is \"60008 bytes, SHA-256 " in out, out[-3000:]
    assert "on rank 0 but \"60008 bytes, SHA-256 " in out and "epoch   1/" not in out, out[-3000:]
    assert not (tmp_path / "run" / "summary.json").exists()


def hpclb(*args):
    p = run_hpclb(*args, timeout=180)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, mnist_dir):
    """(recipe folder, run directory) of a 4-step run of the plug-in model on MNIST, stopped
    after its last checkpoint (no summary.json: --resume continues it)."""
    tmp = tmp_path_factory.mktemp("stopped")
    recipe = plugin_recipe(tmp / "recipe")
    rc, out = hpclb("train", recipe, "--out", tmp / "run", "--data-dir", mnist_dir.parent,
                    "--no-tensorboard")
    assert rc == 0, out
    (tmp / "run" / "summary.json").unlink()
    return tmp / "recipe", tmp / "run"


def copies(stopped, tmp_path) -> tuple[str, Path]:
    """A copy of the stopped run's recipe folder and run directory in ``tmp_path``."""
    recipe, run = (shutil.copytree(p, tmp_path / p.name) for p in stopped)
    return str(Path(recipe) / "quick.yaml"), Path(run)


def test_resume_after_editing_the_module_is_refused_then_continues_with_the_flag(
        stopped, tmp_path, mnist_dir):
    """--resume after the plug-in module's constant changed: exit 2 naming the module and
    --resume-changed, nothing written; with --resume-changed code: continues, says so, and
    config.json records it."""
    recipe, run = copies(stopped, tmp_path)
    Path(recipe).with_name("fp_model.py").write_text(MODULE.format(scale=3.0))
    args = ("train", recipe, "--out", run, "--data-dir", mnist_dir.parent, "--resume",
            "--no-tensorboard")
    config = (run / "config.json").read_bytes()
    rc, out = hpclb(*args)
    assert rc == 2, out
    assert "was made with other code: plug-in module fp_model: " in out, out
    assert "add --resume-changed code to continue" in out and "epoch   1/" not in out, out
    assert (run / "config.json").read_bytes() == config
    rc, out = hpclb(*args, "--resume-changed", "code")
    assert rc == 0, out
    assert "--resume-changed code: continuing the run in" in out, out
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["resume_changed"] == ["code"], recorded
    (change,) = recorded["resumed_with_changes"]
    assert change["global_step"] == 4 and change["code"][0].startswith("plug-in module fp_model")
    assert list(change) == ["global_step", "code"], change


def test_resume_with_fashion_mnist_under_mnist_names_is_refused(stopped, tmp_path, mnist_dir):
    """--resume --data-dir pointed at Fashion-MNIST's files under MNIST's names (before: it
    trained on, finishing at 69.5 % instead of ~92 %): exit 2 naming the files."""
    fashion = mnist_dir.parent / "fashion-mnist"
    if not (fashion / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"Fashion-MNIST not staged in {fashion}; run `make data`")
    recipe, run = copies(stopped, tmp_path)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    for f in fashion.glob("*.gz"):
        with gzip.open(f) as src, open(tmp_path / "data" / "mnist" / f.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", tmp_path / "data", "--resume",
                    "--no-tensorboard")
    assert rc == 2, out
    assert "was made with other data: data file t10k-images-idx3-ubyte: 7840016 bytes, " in out
    assert "data file train-labels-idx1-ubyte: 60008 bytes, SHA-256 " in out, out
    assert "--resume-changed data" in out and "epoch   1/" not in out, out


def test_the_code_fingerprint_follows_imports_from_the_plugin_path(tmp_path, monkeypatch):
    """The named modules and what they import from the plugin_path directories, by name;
    installed code (torch, hpclb) is left out."""
    (tmp_path / "fp_top.py").write_text("import fp_helper\nimport torch\n")
    (tmp_path / "fp_helper.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("fp_top")
    try:
        digests = source_digests(["fp_top", "torch", "hpclb.plugins"], [tmp_path])
    finally:
        for name in ("fp_top", "fp_helper"):
            sys.modules.pop(name, None)
    assert sorted(digests) == ["fp_helper", "fp_top"], digests


def test_the_data_fingerprint_of_unknown_files_and_of_many(tmp_path, monkeypatch):
    """A plug-in's data (files unknown): every file under the data directory but hidden ones
    and the run directory's, by size and first and last 64 KiB; above LISTED_FILES files, one
    entry per folder; above the limit, none."""
    for folder in ("a", "run"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.bin").write_bytes(b"1" * 200_000)
    (tmp_path / ".verified").write_text("{}")
    fp = dataset("my_data:load").fingerprint(tmp_path, {}, exclude=(tmp_path / "run",))
    assert list(fp) == ["a/x.bin"] and fp["a/x.bin"].startswith("200000 bytes, first+last 64 KiB")
    monkeypatch.setattr("hpclb.data.manifest.LISTED_FILES", 1)
    (tmp_path / "a" / "y.bin").write_bytes(b"2")
    assert list(fingerprint_files(tmp_path, {"a/*": "size"})) == ["a/"]
    assert fingerprint_files(tmp_path, {"a/*": "size"}, limit=1) == {
        "*": "more than 1 files: not fingerprinted"}


class _TwoRanks:
    """Rank 0 of a pretend world of two whose rank 1 reports ``theirs`` as its model's code."""

    rank, world_size = 0, 2

    def __init__(self, theirs):
        self.theirs = theirs

    def allgather_object(self, obj):
        return [obj, (obj[0], self.theirs) if isinstance(obj, tuple) else self.theirs]


def test_library_model_checks_compare_the_model_classes_source():
    """Library mode: hpclb.broadcast_parameters' model check and DistributedOptimizer's
    start-up check compare the modules that define the model's classes too; a rank whose module
    differs is named (ModelMismatchError on every rank)."""
    from hpclb.sync.optimizer import DistributedOptimizer

    model = nn.Sequential(_Scaled(), nn.Linear(2, 2))
    mine = source_digests([__name__])
    check_model_consistency(model, _TwoRanks(mine))
    differs = (f"rank 1 builds the model from other code than rank 0: module {__name__} .* has "
               f"SHA-256 0000 on rank 1 but {mine[__name__]} on rank 0")
    with pytest.raises(ModelMismatchError, match=differs):
        check_model_consistency(model, _TwoRanks({__name__: "0000"}))
    with pytest.raises(ModelMismatchError, match=differs):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                             comm=_TwoRanks({__name__: "0000"}))


class _Scaled(nn.Module):
    def forward(self, x):
        return x * torch.tensor(2.0)
