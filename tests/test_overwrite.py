"""Nothing is overwritten without asking: ``hpclb train`` names its default run directory by scheme
and batch, refuses a directory holding a run (exit 2, naming --resume and --overwrite) on every
rank before any work, and replaces it only with --overwrite; ``hpclb scale``, ``hpclb plot`` and
``hpclb sweep`` refuse to replace their outputs likewise. Real command line in subprocesses."""
import json
import shutil
from pathlib import Path

import pytest
from helpers import quick_recipe, run_hpclb

from hpclb.config import resolve
from hpclb.config.outputs import RUN_MARKER, check_run_dir, foreign_files, mark_run
from hpclb.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


def hpclb(*args, ranks=1, cwd=None, timeout=180):
    p = run_hpclb(*args, ranks=ranks, timeout=timeout, cwd=cwd)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mnist_dir):
    """A tiny finished run (4 steps of MNIST-LSTM) and its recipe."""
    tmp = tmp_path_factory.mktemp("finished")
    recipe = quick_recipe(tmp, data={"name": "mnist", "train_samples": 512,
                                     "test_samples": 200})
    rc, out = hpclb("train", recipe, "--out", tmp / "run", "--data-dir", mnist_dir.parent)
    assert rc == 0, out
    return recipe, tmp / "run"


def test_default_run_directory_names_scheme_and_batch():
    """Two batches or schemes of one recipe no longer share runs/<experiment>."""
    a = resolve("mnist-lstm")
    b = resolve("mnist-lstm", batch_size=256)
    c = resolve("mnist-lstm", batch_size=256, scaling="sqrt")
    assert a.out == f"runs/mnist-lstm/legw-b{a.global_batch_size}"
    assert (b.out, c.out) == ("runs/mnist-lstm/legw-b256", "runs/mnist-lstm/sqrt-b256")


@pytest.mark.parametrize("ranks", [1, 2])
def test_finished_run_is_refused_without_resume_or_overwrite(finished, mnist_dir, ranks):
    recipe, run = finished
    before = (run / "summary.json").read_bytes(), (run / "summary.json").stat().st_mtime_ns
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent, ranks=ranks,
                    timeout=120)
    assert rc == 2, out
    assert "already holds a finished run" in out and "--resume" in out and "--overwrite" in out
    assert out.count("already holds") == 1, out  # rank 0 prints it, no rank aborts
    assert "epoch   1/" not in out  # refused before any rank trained
    assert ((run / "summary.json").read_bytes(),
            (run / "summary.json").stat().st_mtime_ns) == before


def test_overwrite_replaces_the_run_and_leaves_nothing_stale(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    run = tmp_path / "run"
    assert hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent)[0] == 0
    (run / "notes.txt").write_text("mine")
    stale = run / "checkpoints" / "gen-999999.pt"
    stale.write_bytes(b"old")
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent,
                    "--batch-size", "256", "--overwrite")
    assert rc == 0, out
    assert json.loads((run / "summary.json").read_text())["global_batch_size"] == 256
    assert not stale.exists() and (run / "notes.txt").read_text() == "mine"
    rc, out = hpclb("train", recipe, "--out", run, "--resume", "--overwrite")
    assert rc == 2 and "choose one" in out, out


def test_out_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        rc, text = hpclb("train", "mnist-lstm", "--out", out)
        assert rc == 2 and "is a file, not a directory" in text, text
        assert "Traceback" not in text and "FileExistsError" not in text


def test_scale_refuses_to_replace_its_recipe_and_job(finished, tmp_path):
    from hpclb import cli

    _, run = finished
    out = tmp_path / "r.yaml"
    args = ["scale", str(run), "--to-batch", "256", "--out", str(out), "--scheduler", "slurm",
            "--nodes", "1", "--gpus-per-node", "2"]
    assert cli.main(args) == 0
    recipe, job = out.read_text(), out.with_suffix(".sbatch").read_text()
    out.write_text(recipe + "# my edit\n")
    assert cli.main(args) == 2
    assert out.read_text().endswith("# my edit\n")
    assert cli.main([*args, "--overwrite"]) == 0
    assert out.read_text() == recipe and out.with_suffix(".sbatch").read_text() == job


def test_plot_refuses_to_replace_a_png(finished, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hpclb import cli

    _, run = finished
    png = tmp_path / "p.png"
    png.write_bytes(b"not a plot")
    assert cli.main(["plot", "runs", str(run), "--out", str(png)]) == 2
    assert "--overwrite" in capsys.readouterr().err and png.read_bytes() == b"not a plot"
    assert cli.main(["plot", "runs", str(run), "--out", str(png), "--overwrite"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_sweep_does_not_delete_a_run_of_other_settings(finished, tmp_path, mnist_dir):
    """A point's directory holding a run of another budget was deleted silently."""
    from hpclb.tools import sweep

    recipe, run = finished
    point = tmp_path / "runs" / "mnist-lstm" / "adam-legw-b256-s0"  # Point.dir_name
    point.mkdir(parents=True)
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        (point / name).write_text((run / name).read_text())  # B=128, another point's run
    kw = dict(epochs=1, data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
              runs_dir=tmp_path / "runs", log=lambda m: None)
    with pytest.raises(ConfigError, match="already holds a finished run; add --overwrite"):
        sweep.run_sweep(recipe, [256], ["legw"], **kw)
    assert (point / "summary.json").read_text() == (run / "summary.json").read_text()
    rows = sweep.run_sweep(recipe, [256], ["legw"], overwrite=True, **kw)
    assert rows[0]["batch_size"] == 256 and rows[0]["metric"] is not None


def test_a_run_stopped_before_its_first_checkpoint_is_not_offered_resume(tmp_path):
    """A run killed before its first checkpoint left logs only: the refusal names --overwrite
    and not --resume (which would then fail with "no checkpoint")."""
    mark_run(tmp_path, "config.json", "metrics.jsonl", "checkpoint.pt")  # hpclb's run
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError) as e:
        check_run_dir(tmp_path, resume=False, overwrite=False)
    assert "without a checkpoint" in str(e.value) and "--overwrite" in str(e.value)
    assert "--resume" not in str(e.value)
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="add --resume to continue it"):
        check_run_dir(tmp_path, resume=False, overwrite=False)


# --- hpclb deletes only what it wrote ----------------------------------------------------------

def lightning_folder(root: Path) -> Path:
    """Another tool's project folder: Lightning's checkpoint layout, its TensorBoard logs, a
    config.json of its own."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"lr": 0.1, "max_epochs": 10}\n')
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "epoch=9-step=1000.ckpt").write_bytes(b"lightning weights")
    events = root / "tb" / "lightning_logs" / "version_0"
    events.mkdir(parents=True)
    (events / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"tb events")
    (root / "notes.txt").write_text("mine")
    return root


def snapshot(root: Path, skip=(".hpclb.lock",)) -> dict[str, bytes | None]:
    """Every file and directory under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*")) if p.name not in skip}


@pytest.mark.parametrize("flags,ranks", [([], 1), (["--overwrite"], 1), (["--overwrite"], 2),
                                         (["--resume", "auto"], 1), (["--resume"], 1)])
def test_another_tools_folder_is_refused_naming_its_files_and_nothing_is_deleted(
        tmp_path, mnist_dir, flags, ranks):
    """Issue 34: such a folder was "an unfinished run", and --overwrite deleted the other
    tool's checkpoint and TensorBoard files and replaced its config.json."""
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    folder = lightning_folder(tmp_path / "project")
    before = snapshot(folder)
    rc, out = hpclb("train", recipe, "--out", folder, "--data-dir", mnist_dir.parent, *flags,
                    ranks=ranks)
    assert rc == 2 and out.count("hpclb: error:") == 1, out  # rank 0's, no rank aborts
    assert "unfinished run" not in out and "Traceback" not in out, out
    assert (f"--out {folder} holds files hpclb did not write where a run writes its own "
            f"(config.json, checkpoints/epoch=9-step=1000.ckpt, tb/lightning_logs/)") in out, out
    assert "choose another --out, or move them out of" in out, out
    assert snapshot(folder, skip=()) == before  # nothing deleted, replaced or added


def test_overwrite_deletes_only_what_hpclb_wrote(tmp_path, mnist_dir):
    """A genuine hpclb run: --overwrite removes its files and keeps the user's notes.txt beside
    them; a foreign file inside hpclb's checkpoints/ is refused by name, nothing deleted."""
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    run = tmp_path / "run"
    assert hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent)[0] == 0
    marker = json.loads((run / RUN_MARKER).read_text())["written"]
    assert {"config.json", "summary.json", "metrics.jsonl", "checkpoints"} <= set(marker)
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "best.pt").write_bytes(b"the user's copy")
    before = snapshot(run)
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent,
                    "--overwrite")
    assert rc == 2 and "(checkpoints/best.pt)" in out and "unfinished" not in out, out
    assert snapshot(run) == before
    (run / "checkpoints" / "best.pt").unlink()
    old = (run / "summary.json").read_bytes()
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent,
                    "--overwrite", "--batch-size", "256")
    assert rc == 0, out
    assert (run / "notes.txt").read_text() == "mine" and (run / "summary.json").read_bytes() != old
    assert json.loads((run / "summary.json").read_text())["global_batch_size"] == 256
    assert not foreign_files(run)


def test_a_run_of_the_previous_version_resumes_and_is_overwritten(finished, tmp_path, mnist_dir):
    """A run directory written before the marker (no .hpclb-run) whose entries have hpclb's
    names and config.json is hpclb's: resumed, then marked; --overwrite keeps notes.txt."""
    recipe, done = finished
    run = tmp_path / "old"
    shutil.copytree(done, run)
    (run / RUN_MARKER).unlink()
    (run / "notes.txt").write_text("mine")
    assert foreign_files(run) == []
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent, "--resume",
                    "auto")
    assert rc == 0 and "resum" in out.lower(), out
    assert set(json.loads((run / RUN_MARKER).read_text())["written"]) >= {"checkpoints", "tb"}
    (run / RUN_MARKER).unlink()
    rc, out = hpclb("train", recipe, "--out", run, "--data-dir", mnist_dir.parent, "--overwrite")
    assert rc == 0, out
    assert (run / "notes.txt").read_text() == "mine"


def test_foreign_files_rule(tmp_path):
    """The rule --overwrite follows (docs/faults.md): a marked directory's unclaimed entries and
    files without hpclb's names inside its directories are foreign; without a marker, all run
    entries are unless config.json is hpclb's."""
    run = tmp_path / "run"
    mark_run(run, "config.json", "checkpoints")
    (run / "config.json").write_text("{}")  # claimed: hpclb wrote it
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "gen-000001-step-4.pt").write_bytes(b"")
    (run / "checkpoints" / "gen-000001-step-4.pt.sha256").write_text("")
    (run / "notes.txt").write_text("")  # not a run entry: never looked at
    assert foreign_files(run) == []
    (run / "tb").mkdir()  # not claimed: someone else's
    (run / "tb" / "events.out.tfevents.1.h.2.0").write_bytes(b"")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert foreign_files(run) == ["checkpoints/last.ckpt", "tb/events.out.tfevents.1.h.2.0"]
    (run / RUN_MARKER).unlink()  # no marker, config.json not hpclb's: all of it is foreign
    assert foreign_files(run) == ["config.json", "checkpoints/gen-000001-step-4.pt",
                                  "checkpoints/gen-000001-step-4.pt.sha256",
                                  "checkpoints/last.ckpt", "tb/events.out.tfevents.1.h.2.0"]
    (run / "config.json").write_text(json.dumps({"experiment": "x", "recipe": {},
                                                 "global_batch_size": 8, "scaling": "legw"}))
    assert foreign_files(run) == ["checkpoints/last.ckpt"]  # an earlier version's run


def test_sweep_refuses_a_point_directory_of_another_tool(tmp_path, mnist_dir):
    """hpclb sweep deleted a point directory (shutil.rmtree) once it held a run; another tool's
    files there are now refused by name and kept."""
    from hpclb.tools import sweep

    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                          "test_samples": 200})
    point = lightning_folder(tmp_path / "runs" / "mnist-lstm" / "adam-legw-b256-s0")
    before = snapshot(point)
    kw = dict(epochs=1, data_dir=str(mnist_dir.parent), out_dir=tmp_path / "res",
              runs_dir=tmp_path / "runs", log=lambda m: None, overwrite=True)
    with pytest.raises(ConfigError, match=r"--runs-dir point \S+adam-legw-b256-s0 holds files "
                                          r"hpclb did not write .*checkpoints/epoch=9-step=1000.ckpt"):
        sweep.run_sweep(recipe, [256], ["legw"], **kw)
    assert snapshot(point, skip=()) == before


def test_a_start_up_that_fails_after_the_lock_leaves_no_directory_behind(tmp_path, mnist_dir,
                                                                        monkeypatch):
    """A failure between taking the run directory and the first step (here: the parameter
    broadcast) used to leave --out holding only .hpclb.lock; now nothing, or, in a directory
    that held something else, just that."""
    from helpers import quick_recipe

    from hpclb.comm.local import SelfCommunicator
    from hpclb.config import resolve
    from hpclb.train import setup
    from hpclb.train.loop import train

    def broken(*a, **k):
        raise RuntimeError("the broadcast failed")

    monkeypatch.setattr(setup, "broadcast_parameters", broken)
    recipe = quick_recipe(tmp_path)
    for out, keep in ((tmp_path / "fresh" / "run", None), (tmp_path / "mine", "notes.txt")):
        if keep:
            out.mkdir()
            (out / keep).write_text("mine")
        cfg = resolve(recipe, out=str(out), data_dir=str(mnist_dir.parent))
        with pytest.raises(RuntimeError, match="the broadcast failed"):
            train(cfg, SelfCommunicator(), quiet=True)
        if keep:
            assert sorted(p.name for p in out.iterdir()) == [keep]
        else:
            assert not out.exists()
