"""CNN workloads: Fashion-MNIST (real staged files), ImageFolder, synthetic images, ResNets, and
a short real LARS run through the training loop."""
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO
from hpclb import train as train_mod
from hpclb.comm import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.data import DataError, load_dataset
from hpclb.data.images import ImageFolder, SyntheticImages, load_fashion_mnist
from hpclb.models import ResNet50, SmallResNet


@pytest.fixture(scope="session")
def fashion_root() -> Path:
    base = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (base / "fashion-mnist" / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"Fashion-MNIST not staged in {base}; run `make data` "
                    f"(hpclb data fetch fashion-mnist)")
    return base


def test_fashion_mnist_real_files(fashion_root):
    train, test = load_fashion_mnist(fashion_root)
    assert (len(train), len(test)) == (60_000, 10_000)
    x, y = train.batch(torch.arange(8))
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert abs(train.images.float().div(255).mean().item() - 0.2860) < 1e-3


def test_missing_fashion_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="hpclb data fetch"):
        load_fashion_mnist(tmp_path)


def test_resnets_shapes_and_size():
    m = ResNet50()
    assert sum(p.numel() for p in m.parameters()) == 25_557_032
    assert m.eval()(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    s = SmallResNet(depth=20)
    assert s(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in s.parameters()) == 272_186
    with pytest.raises(ValueError, match="6n\\+2"):
        SmallResNet(depth=21)


def test_synthetic_images_are_deterministic():
    a = SyntheticImages(100, image_size=32, num_classes=10)
    x1, y1 = a.batch(torch.arange(4, 8))
    x2, y2 = a.batch(torch.arange(4, 8))
    assert x1.shape == (4, 3, 32, 32) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert len(a.subset(10)) == 10 and int(y1.max()) < 10


def test_image_folder_reads_classes_and_pixels(tmp_path):
    from PIL import Image
    for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (40, 30), colour).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    ds = ImageFolder(tmp_path, image_size=16, resize=20)
    assert len(ds) == 4 and ds.classes == ["cat", "dog"]
    x, y = ds.batch(torch.tensor([0, 3]))
    assert x.shape == (2, 3, 16, 16) and y.tolist() == [0, 1]
    assert x[0, 0].mean() > 2 and x[1, 2].mean() > 2  # red cat, blue dog after normalisation
    with pytest.raises(DataError, match="no class"):
        ImageFolder(tmp_path / "cat")


def test_cnn_recipes_validate():
    r = load_recipe("resnet-50")
    assert (r["base_batch_size"], r["optimizer"], r["decay"]["power"]) == (1024, "lars", 2.0)
    f = load_recipe("fashion-resnet")
    assert f["optimizer"] == "lars" and f["data"]["name"] == "fashion-mnist"
    c = load_recipe("fashion-resnet-cpu")  # the swept reduced budget: LARS LR tuned at B0 = 128
    assert (c["model"]["depth"], c["epochs"], c["optimizers"]["lars"]["lr"]) == (8, 8, 16.0)
    for batch in (128, 1024, 4096):  # the sweep's points: LEGW's warmup fits every one
        sched = resolve("fashion-resnet-cpu", batch_size=batch).schedule(60000)
        assert sched.warmup_steps == 29 and sched.total_steps > 2 * sched.warmup_steps
    assert len(load_dataset("synthetic", train_samples=64, test_samples=32)[0]) == 64


@pytest.mark.slow
def test_fashion_resnet_lars_runs(tmp_path, fashion_root):
    import yaml
    recipe = load_recipe("fashion-resnet")
    recipe.update({"data": {"name": "fashion-mnist", "train_samples": 512, "test_samples": 256},
                   "model": {"name": "resnet_small", "depth": 8, "width": 8}, "epochs": 2})
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(recipe))
    s = train_mod.train(resolve(str(path), batch_size=128, data_dir=str(fashion_root),
                                out=str(tmp_path / "o")), SelfCommunicator(), quiet=True)
    assert s["steps"] == 8 and s["optimizer"] == "lars" and s["warmup_steps"] == 1
    assert 0 <= s["final_test_accuracy"] <= 1 and s["final_test_loss"] < 10  # ran, no blow-up
