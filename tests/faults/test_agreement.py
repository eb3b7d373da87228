"""Fault matrix, decisions ranks must share: an uneven last step (every sample once per epoch at
any world size), different settings on two ranks (fusion threshold), and ranks whose working
directories or --out differ with one of them seeing an unfinished run's checkpoint. Every case
ends within seconds on every rank, with the message."""
import collections
import shutil

import pytest
from conftest import command, run, summary, train_args, write_recipe


@pytest.mark.timeout(200)
def test_uneven_last_step_draws_every_sample_once(tmp_path, record):
    """N = 1,000 samples, global batch 300, 3 ranks: 4 steps, the last of 100 samples split
    34/33/33; each sample is drawn exactly once in the epoch (the ranks' batch indices, logged
    by the plug-in's data set), and the result equals the 1-process run's to fp32 rounding."""
    bound = 90
    changes = {"data": {"name": "fault_plugin:blobs", "n_train": 1000}, "epochs": 1,
               "base_batch_size": 100}
    results, t3 = {}, 0.0
    for ranks in (3, 1):
        folder = tmp_path / f"w{ranks}"
        recipe = write_recipe(folder, **changes)
        (folder / "drawn").mkdir()
        rc, out, t = run(command(["train", recipe, "--out", folder / "run", "--batch-size", 300],
                                 ranks=ranks), bound, env={"FAULT_RECORD_DIR": folder / "drawn"})
        assert rc == 0, out
        results[ranks] = summary(folder / "run")
        t3 = t3 or t
        batches = {f.stem: [list(map(int, line.split())) for line in f.read_text().splitlines()]
                   for f in sorted((folder / "drawn").glob("rank*.txt"))}
        assert sorted(batches) == [f"rank{r}" for r in range(ranks)], batches.keys()
        counts = collections.Counter(i for b in batches.values() for batch in b for i in batch)
        assert sorted(counts) == list(range(1000)) and set(counts.values()) == {1}, \
            [i for i, c in counts.items() if c != 1][:10]
        assert [len(b) for b in batches["rank0"]] == [300 // ranks] * 3 + [-(-100 // ranks)]
    assert results[3]["steps"] == results[1]["steps"] == 4
    assert abs(results[3]["final_test_loss"] - results[1]["final_test_loss"]) <= 1e-5, results
    record(bound, t3, 0, "n/a (no fault); 1,000 samples each drawn once in 4 steps on 3 ranks")


@pytest.mark.timeout(120)
def test_different_fusion_threshold_on_two_ranks(tmp_path, record):
    """HPCLB_FUSION_THRESHOLD_BYTES differs between the ranks (an MPMD launch, `-x` per rank):
    both ranks stop before the first step within 60 s, with a message naming the setting and
    both values (the run's settings, agreed before the first collective of training:
    hpclb.config.agreement; a ConfigError raised on every rank alike)."""
    bound = 60
    cmd = command(train_args(write_recipe(tmp_path), tmp_path / "run"),
                  rank_env=[{"HPCLB_FUSION_THRESHOLD_BYTES": "1024"},
                            {"HPCLB_FUSION_THRESHOLD_BYTES": "33554432"}])
    rc, out, t = run(cmd, bound)
    assert rc == 2, out
    assert ("$HPCLB_FUSION_THRESHOLD_BYTES is 1024 on rank 0 but 33554432 on rank 1; every "
            "rank must run the same configuration") in out, out
    assert "epoch   1/" not in out, out
    record(bound, t, rc, "n/a (stopped before the first step)")


def _unfinished_run(reference, where):
    """A copy of the uninterrupted run's folder without its summary: an unfinished run."""
    reference(2)
    shutil.copytree(reference.folder(2), where, symlinks=True)
    (where / "summary.json").unlink()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sees", [0, 1])
def test_working_directories_differ(tmp_path, sees, reference, record):
    """Rank 0 and rank 1 start in different working directories with the same relative --out;
    only rank ``sees``'s holds an unfinished run's checkpoint. Rank 0 decides for all: when it
    sees the checkpoint every rank exits 2 within 60 s with the message; when only rank 1 does,
    the run starts afresh under rank 0's --out (rank 1's copy untouched) and ends 0."""
    bound = 60
    recipe = write_recipe(tmp_path / "recipe")
    dirs = [tmp_path / "cwd0", tmp_path / "cwd1"]
    dirs[1 - sees].mkdir()
    _unfinished_run(reference, dirs[sees] / "run")
    before = (dirs[sees] / "run" / "checkpoint.pt").stat().st_mtime_ns
    args = train_args(recipe, "run")
    cmd = command(args, rank_env=[{}, {}])
    at = [i for i, a in enumerate(cmd) if a == "-n"]  # one --wdir per app context
    for k, i in reversed(list(enumerate(at))):
        cmd[i:i] = ["--wdir", str(dirs[k])]
    rc, out, t = run(cmd, bound)
    if sees == 0:
        assert rc == 2, out
        assert "already holds an unfinished run; add --resume" in out, out
        kept = "the unfinished run's checkpoint, untouched"
    else:
        assert rc == 0, out
        assert (dirs[0] / "run" / "summary.json").is_file()
        kept = "n/a (rank 0 saw no checkpoint: a fresh run; rank 1's copy untouched)"
    assert (dirs[sees] / "run" / "checkpoint.pt").stat().st_mtime_ns == before
    record(bound, t, rc, kept)


@pytest.mark.timeout(150)
def test_out_differs_between_ranks(tmp_path, reference, record):
    """--resume with a different --out on each rank, rank 0's empty and rank 1's holding an
    unfinished run: rank 0's decision (nothing to resume) ends every rank within 60 s with the
    message; rank 1's checkpoint is untouched."""
    bound = 60
    recipe = write_recipe(tmp_path)
    _unfinished_run(reference, tmp_path / "out1")
    before = (tmp_path / "out1" / "checkpoint.pt").stat().st_mtime_ns
    cmd = command(train_args(recipe, tmp_path / "out0", "--resume"), rank_env=[{}, {}])
    cmd[len(cmd) - cmd[::-1].index(str(tmp_path / "out0")) - 1] = str(tmp_path / "out1")
    rc, out, t = run(cmd, bound)
    assert rc == 2, out
    assert "no checkpoint to resume from" in out and "rank 0 of 2" in out, out
    assert (tmp_path / "out1" / "checkpoint.pt").stat().st_mtime_ns == before
    record(bound, t, rc, "rank 1's unfinished checkpoint untouched")
