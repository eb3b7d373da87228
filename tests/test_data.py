import gzip

import numpy as np
import pytest
import torch

from hpclb.data.fetch import md5sum
from hpclb.data.idx import read_idx
from hpclb.data.mnist import FILES, load_mnist
from hpclb.errors import DataError


def write_idx(path, arr, code=0x08):
    header = bytes([0, 0, code, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(header + arr.astype(arr.dtype.newbyteorder(">")).tobytes())
    return path


def test_real_mnist_files_verified_and_loaded(mnist_dir):
    for name, md5 in FILES.values():
        assert md5sum(mnist_dir / name) == md5
    train, test = load_mnist(mnist_dir.parent)
    assert (len(train), len(test)) == (60_000, 10_000)
    assert train.images.shape == (60_000, 28, 28) and train.images.dtype == torch.uint8
    assert sorted(train.labels.unique().tolist()) == list(range(10))
    x, y = train.batch(torch.arange(256))
    assert x.shape == (256, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert abs(x.mean().item()) < 0.2  # normalised


def test_idx_round_trip_plain_and_gzip(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    p = write_idx(tmp_path / "a-idx3-ubyte", arr)
    np.testing.assert_array_equal(read_idx(p, ndim=3), arr)
    gz = tmp_path / "a-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    np.testing.assert_array_equal(read_idx(gz), arr)
    f32 = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "f", f32, 0x0D)), f32)


def test_truncated_file_is_a_clear_error(tmp_path):
    p = write_idx(tmp_path / "t", np.zeros((10, 28, 28), np.uint8))
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"truncated or corrupt.*hpclb data fetch"):
        read_idx(p)


def test_wrong_magic_and_ndim(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(p)
    q = write_idx(tmp_path / "labels", np.zeros(5, np.uint8))
    with pytest.raises(DataError, match="1 dimensions, expected 3"):
        read_idx(q, ndim=3)


def test_mnist_reads_gzip_files_as_the_gpu_bundle_carries_them(tmp_path, mnist_dir):
    """Only ``<name>.gz`` in the folder (benchmarks/gpu_check/prepare.py's bundle, LeCun's
    download): the same arrays as from the raw files."""
    for name, _ in FILES.values():
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress((mnist_dir / name).read_bytes(), 1))
    train, test = load_mnist(tmp_path)
    raw_train, raw_test = load_mnist(mnist_dir.parent)
    assert torch.equal(train.images, raw_train.images) and torch.equal(test.labels,
                                                                       raw_test.labels)


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"no such file.*`hpclb data fetch mnist`"):
        load_mnist(tmp_path)


def test_every_missing_data_set_names_its_fetch_command(tmp_path):
    from hpclb.data.images import load_fashion_mnist
    from hpclb.data.ptb import load_ptb
    from hpclb.data.translation import load_bible_pairs
    for load, name in ((load_fashion_mnist, "fashion-mnist"), (load_ptb, "ptb"),
                       (load_bible_pairs, "bible-en-es")):
        with pytest.raises(DataError, match=f"no such file.*`hpclb data fetch {name}`"):
            load(tmp_path)
    bad = tmp_path / "mnist"
    bad.mkdir()
    (bad / FILES["train-images"][0]).write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="not an IDX file.*`hpclb data fetch mnist`"):
        load_mnist(tmp_path)


def test_images_and_labels_must_agree(tmp_path):
    write_idx(tmp_path / FILES["train-images"][0], np.zeros((4, 28, 28), np.uint8))
    write_idx(tmp_path / FILES["train-labels"][0], np.zeros(3, np.uint8))
    with pytest.raises(DataError, match="4 images but 3 labels"):
        load_mnist(tmp_path)
