"""No silent wrong answers (issue 50, items 3-5): recipe values that were accepted and changed
what a run computes (an ``end_lr`` above the peak, a boolean where a number goes, more
``train_samples`` than the data set has, an empty ``--out``, a directory as the recipe), errors
that ended in a traceback or a bare ``OSError`` (a full disk during any write, an ``--out`` under
a file), and library mode's ``$HPCLB_COMPRESSION`` and the ``HPCLB_*`` variables the ranks
compare. Each was accepted (or unclear) before; each is now refused in one line naming the field
or file and the fix. In this process (``hpclb.cli.main``) where a command is run."""
from __future__ import annotations

import errno
import inspect
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import quick_recipe

from hpclb import schedules
from hpclb._io import write_json
from hpclb.config import load_recipe, resolve
from hpclb.config.outputs import check_output_file
from hpclb.errors import ConfigError, DiskFull, ModelMismatchError
from hpclb.plugins import check_kwargs, takes_number
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)


def one_error(err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("hpclb: error:")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], lines[0]


# --- item 3: recipe values ---------------------------------------------------------------------

def test_end_lr_at_or_above_the_peak_is_refused_naming_the_field(tmp_path):
    """Before: end_lr 5.0 with a peak of 0.002 was accepted, the 'decay' raised the LR to 4.97."""
    recipe = quick_recipe(tmp_path, decay={"name": "poly", "power": 2.0, "end_lr": 5.0})
    with pytest.raises(ConfigError, match=r"decay.end_lr 5 \(recipe field\) is not below the "
                                          r"peak LR.*the B0 peak is 0.002 \(optimizers.adam.lr\)"
                                          r".*every --scaling keeps the peak at or above it"):
        resolve(recipe, batch_size=256).schedule(4096)
    with pytest.raises(ConfigError, match=r"decay.end_lr 5 .*the B0 peak is 4 \(--lr\)"):
        resolve(recipe, lr=4.0).schedule(4096)
    assert resolve(recipe, lr=8.0).schedule(4096).lr(31) >= 5.0  # below the peak: a decay
    # below the B0 peak but above the scaled peak at k = 1/4 (sqrt: eta0 / 2)
    mid = quick_recipe(tmp_path, decay={"name": "cosine", "end_lr": 0.0015})
    with pytest.raises(ConfigError, match=r"the peak at --batch-size 32 \(--scaling legw\) is "
                                          r"0.001; set decay.end_lr below 0.001"):
        resolve(mid, batch_size=32).schedule(4096)
    with pytest.raises(ValueError, match="end_lr 0.1 must be below the peak learning rate 0.1"):
        schedules.Schedule(peak_lr=0.1, warmup_steps=0, total_steps=10, steps_per_epoch=10,
                           decay="poly", decay_params={"end_lr": 0.1})


def test_end_lr_above_the_peak_is_refused_by_dry_run(tmp_path, mnist_dir, in_process):
    recipe = quick_recipe(tmp_path, decay={"name": "poly", "power": 2.0, "end_lr": 5.0})
    rc, err = in_process("train", recipe, "--dry-run", "--data-dir", mnist_dir.parent)
    assert rc == 2
    one_error(err, "decay.end_lr 5", "set decay.end_lr below 0.002")


def _plugin_model(width: int, scale: float | None = None, flag: bool = False):
    return torch.nn.Linear(width, 1)


def test_a_boolean_where_a_number_goes_is_refused(tmp_path):
    """Before: `hidden_size: yes` built an LSTM of hidden size 1 (True is the int 1)."""
    model = {"name": "mnist_lstm", "hidden_size": True, "forget_bias": 1.0}
    with pytest.raises(ConfigError, match=r"quick.yaml: model.hidden_size: true is a boolean "
                                          r".*write the number, e.g. `hidden_size: 128`"):
        load_recipe(quick_recipe(tmp_path, model=model))
    sgd = {"momentum": {"lr": 0.1, "momentum": 0.9, "dampening": True}}
    with pytest.raises(ConfigError, match=r"optimizers.momentum.dampening: true is a boolean"):
        load_recipe(quick_recipe(tmp_path, optimizer="momentum", optimizers=sgd))
    # by annotation alone (no default), Optional too; a bool argument takes a bool
    with pytest.raises(ConfigError, match=r"model.width: true is a boolean.*`width: 1`"):
        check_kwargs(_plugin_model, {"width": True}, what="model m:f", section="model")
    with pytest.raises(ConfigError, match=r"data.scale: false is a boolean"):
        check_kwargs(_plugin_model, {"width": 2, "scale": False}, what="data function m:f",
                     section="data")
    check_kwargs(_plugin_model, {"width": 2, "scale": 0.5, "flag": True}, what="m", section="m")
    params = inspect.signature(_plugin_model).parameters
    assert [takes_number(p) for p in params.values()] == [True, True, False]


def test_train_samples_above_the_data_sets_size_is_refused(mnist_dir):
    """Before: data.train_samples 100000 on MNIST's 60000 trained on 60000, silently."""
    from hpclb.data import load_dataset
    from hpclb.tasks.build import build_task

    recipe = {"data": {"name": "mnist"}}
    with pytest.raises(ConfigError, match=r"data.train_samples 100000: more than the 60000 "
                                          r"samples of mnist's training split.*set "
                                          r"data.train_samples to 60000 or less"):
        build_task(recipe, mnist_dir.parent, train_samples=100000)
    with pytest.raises(ConfigError, match=r"data.test_samples 10001: more than the 10000"):
        build_task(recipe, mnist_dir.parent, test_samples=10001)
    with pytest.raises(ConfigError, match=r"train_samples 60001: more than the 60000"):
        load_dataset("mnist", mnist_dir.parent, train_samples=60001)
    assert build_task(recipe, mnist_dir.parent, train_samples=60000).num_train_samples == 60000
    # the dry run and `hpclb jobs` size the set from the registry: refused there too (the dry
    # run planned 60000 images and exited 0)
    from hpclb.tools.jobs import train_set_size
    with pytest.raises(ConfigError, match=r"data.train_samples 70000: more than the 60000 "
                                          r"images of mnist's training split"):
        train_set_size({"data": {"name": "mnist", "train_samples": 70000}})


def test_an_empty_out_is_refused(in_process):
    """Before: `--out ''` meant the default folder, silently."""
    for flag, argv in (("--out", ("train", "mnist-lstm", "--out", "", "--dry-run")),
                       ("--out", ("plot", "schedule", "mnist-lstm", "--out", " ")),
                       ("--out-dir", ("sweep", "mnist-lstm", "--batch-sizes", "128",
                                      "--out-dir", "")),
                       ("--data-dir", ("train", "mnist-lstm", "--data-dir", "", "--dry-run"))):
        rc, err = in_process(*argv)
        assert rc == 2, argv
        one_error(err, f"hpclb: error: {flag} ", ": empty; give a path, or leave")
    with pytest.raises(ConfigError, match=r"--out: '' is empty; give the run directory"):
        resolve("mnist-lstm", out="")


def test_a_directory_as_the_recipe_says_so(tmp_path, in_process):
    """Before: `hpclb train some/folder` said 'unknown experiment'."""
    (tmp_path / "mine.yaml").write_text("name: x\n")
    rc, err = in_process("train", tmp_path, "--dry-run")
    assert rc == 2
    one_error(err, f"{tmp_path} is a directory, not a recipe: a recipe is a .yaml file (in it: "
                   f"mine.yaml), or a packaged name, one of [", "'mnist-lstm'")


def test_the_agreement_names_the_optimizers_section(tmp_path):
    """Before: 'optimizer_params (the recipe's optimizers.<optimizer>)'."""
    from hpclb.config.agreement import config_settings

    names = config_settings(resolve("mnist-lstm", optimizer="lamb"))
    assert "optimizer_params (the recipe's optimizers.lamb)" in names, list(names)


# --- item 4: unclear errors --------------------------------------------------------------------

def _full_disk_at(monkeypatch, name: str | None = None) -> None:
    """Every fsync of an atomic write (of the temporary file of ``name`` only, when given)
    raises ENOSPC, as a full disk does."""
    import hpclb._io as io

    real = os.fsync

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if name is None or Path(target).name.startswith(f".{name}.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)
    monkeypatch.setattr(io.os, "fsync", fsync)


def test_a_full_disk_in_an_atomic_write_names_the_file_and_what_is_valid(tmp_path,
                                                                         monkeypatch):
    path = tmp_path / "summary.json"
    write_json(path, {"old": 1})
    _full_disk_at(monkeypatch)
    with pytest.raises(DiskFull) as e:
        write_json(path, {"new": 2})
    assert str(e.value) == (f"{path}: disk full while writing it ([Errno 28] No space left on "
                            f"device); the summary.json there before, if any, is left as it "
                            f"was; free space under {tmp_path} (or write elsewhere) and run the "
                            f"command again")
    assert e.value.errno == errno.ENOSPC and e.value.exit_code == 1
    assert path.read_text() == '{\n  "old": 1\n}\n' and os.listdir(tmp_path) == ["summary.json"]


def test_a_full_disk_while_appending_metrics_names_the_file(tmp_path):
    from hpclb.train.metrics import RunLogger

    logger = RunLogger(tmp_path, enabled=True, tensorboard=False)
    logger.log_step(1, {"loss": 1.0})

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            pass
    logger._file = Full()
    with pytest.raises(DiskFull, match=r"metrics.jsonl: disk full while writing it .*its lines "
                                       r"before are whole.*--resume continues from it"):
        logger.log_step(2, {"loss": 0.5})


def test_a_full_disk_writing_config_json_is_one_line(tmp_path, mnist_dir, monkeypatch, in_process):
    """Before: `hpclb: error: OSError: [Errno 28] No space left on device` (the run's
    config.json, written on --resume as on a fresh start)."""
    _full_disk_at(monkeypatch, "config.json")
    out = tmp_path / "run"
    rc, err = in_process("train", quick_recipe(tmp_path), "--out", out, "--data-dir",
                    mnist_dir.parent, "--no-tensorboard")
    assert rc == 1
    one_error(err, f"DiskFull: {out / 'config.json'}: disk full while writing it ([Errno 28]",
              "the run's other files are whole and its last checkpoint, if any, is valid: "
              "--resume continues from it; free space under")
    assert not (out / "config.json").exists()


def test_a_full_disk_writing_an_out_file_is_one_line(tmp_path, monkeypatch, in_process):
    pytest.importorskip("matplotlib")
    _full_disk_at(monkeypatch)
    png = tmp_path / "s.png"
    rc, err = in_process("plot", "schedule", "mnist-lstm", "--k", "1", "--out", png)
    assert rc == 1
    one_error(err, f"{png}: disk full while writing it", "free space under")
    assert not png.exists()


@pytest.mark.parametrize("flag, argv", [
    ("--out", ("bench", "loader", "--out", "{f}/x.json")),
    ("--out", ("bench", "model", "--out", "{f}/x.json")),
    ("--out", ("plot", "schedule", "mnist-lstm", "--out", "{f}/x.png")),
    ("--out-dir", ("sweep", "mnist-lstm", "--batch-sizes", "128", "--out-dir", "{f}/sweep")),
    ("--runs-dir", ("sweep", "mnist-lstm", "--batch-sizes", "128", "--runs-dir", "{f}/runs")),
    ("--out", ("train", "mnist-lstm", "--out", "{f}/run", "--dry-run")),
    ("OUT", ("data", "shards", "src", "{f}/shards")),
])
def test_an_out_under_a_file_is_one_line(tmp_path, in_process, flag, argv):
    """Before: `hpclb bench loader --out file/x.json` ended in a FileExistsError traceback."""
    f = tmp_path / "notes.txt"
    f.write_text("kept")
    rc, err = in_process(*[a.format(f=f) for a in argv])
    assert rc == 2
    one_error(err, f"hpclb: error: {flag} {f}/", f"{f} is a file, not a directory")
    assert f.read_text() == "kept"
    with pytest.raises(ConfigError, match=f"{f} is a file, not a directory"):
        check_output_file(f / "x.json", overwrite=True)


# --- item 5: library mode ----------------------------------------------------------------------

def test_horovod_optimizer_honours_hpclb_compression(comm, monkeypatch):
    """Before: hvd.DistributedOptimizer's default Compression.none won over the variable."""
    import hpclb.horovod as hvd

    hvd.init()
    monkeypatch.setenv("HPCLB_COMPRESSION", "fp16")
    for given, want in (({}, torch.float16), ({"compression": hvd.Compression.none}, None)):
        model = torch.nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **given)
        try:
            assert opt.sync.compression is want, given
        finally:
            opt.close()


def _doc_list(path: str, pattern: str) -> set[str]:
    m = re.search(pattern, (REPO / path).read_text(), re.S)
    assert m, f"{path}: the list of the HPCLB_* variables the ranks compare is gone"
    return set(re.findall(r"`(HPCLB_\w+)`", m.group(1)))


def test_the_variables_compared_are_the_ones_the_docs_list(comm):
    """Before: library mode compared neither $HPCLB_STALL_TIMEOUT_S nor $HPCLB_TRUST_BACKEND,
    and the docs said every HPCLB_* setting must agree."""
    from hpclb.sync.agree import check_sync_agreement
    from hpclb.sync.gradients import GradientSync
    from hpclb.sync.options import AGREED_ENVIRONMENT, SYNC_VARIABLES

    sync = GradientSync(torch.nn.Linear(2, 1), comm)
    try:
        settings = sync.agreed_settings()
    finally:
        sync.close()
    library = {SYNC_VARIABLES[k] for k in settings if k in SYNC_VARIABLES} | \
        {k[1:] for k in settings if k.startswith("$")}
    cli = _doc_list("docs/cli.md", r"These `HPCLB_\*` variables must be the same on every rank"
                                   r".*?start-up check\): (.*?)\. The others")
    faults = _doc_list("docs/faults.md", r"the `HPCLB_\*` variables in force .*?agree\): (.*?)\.")
    assert library == set(AGREED_ENVIRONMENT) == cli == faults, (library, cli, faults)
    other = dict(settings, stall_timeout_s=30.0)
    with pytest.raises(ModelMismatchError, match=r"rank 1 has stall_timeout_s \(the argument, "
                                                 r"else \$HPCLB_STALL_TIMEOUT_S\)=30.0 but "
                                                 r"rank 0 has 60.0"):
        check_sync_agreement([{"params": [], "buckets": [], "settings": settings},
                              {"params": [], "buckets": [], "settings": other}])
