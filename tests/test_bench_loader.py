"""`hpclb bench loader` at a tiny size (make test; the real run is `make bench-loader`): it
exits 0 and writes every rate and the batch bytes; no timed asserts. The old path it is measured
against reads the same crop boxes as the new one."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from hpclb.bench.loader import reference_sample, synthetic_jpegs
from hpclb.data import transforms
from hpclb.data.images import ImageFolder
from hpclb.data.transforms import default_decoder

pytestmark = pytest.mark.timeout(120)


def test_bench_loader_writes_its_json(tmp_path):
    out = tmp_path / "bench_loader.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",  # the same decoders as here (PYTHONPATH kept)
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "hpclb", "bench", "loader", "--images", "4",
                        "--rounds", "2", "--batch-size", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=100, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    # every decoder installed here is timed: PIL, simplejpeg (the jpeg extra), the region decoder
    decoders = ["pil"] + [d for d, there in (("simplejpeg", transforms._simplejpeg()),
                                             ("libjpeg", transforms._jpeg_region())) if there]
    assert doc["fast"] == f"fast_{default_decoder()}" == f"fast_{doc['setup']['default_decoder']}"
    assert (doc["setup"]["libjpeg_region"] is None) == ("libjpeg" not in decoders)
    # where the region decoder was built, the files and shards with restart markers are timed
    # too, and they are the path a GPU node is told to use (the one held to the target)
    restarts = {"fast_libjpeg_restarts", "fast_shards_restarts"} if "libjpeg" in decoders \
        else set()
    assert doc["gpu_node_path"] == ("fast_shards_restarts" if restarts else "fast_shards")
    assert doc["train_meets_target"] == (
        doc["images_per_s_per_core"]["train"][doc["gpu_node_path"]] >= 800)
    marked = doc["setup"]["restart_markers"]
    if restarts:
        assert marked["transcode_cpu_ms_per_image"] > 0
        assert 0.9 < marked["bytes_over_original"] < 1.1  # lossless: about the same size
    else:
        assert marked is None
    for transform in ("train", "eval"):
        rates = doc["images_per_s_per_core"][transform]
        assert set(rates) == {"current", "fast_shards"} | restarts | {
            f"{kind}_{d}" for d in decoders for kind in ("fast", "full_decode")}
        assert all(math.isfinite(v) and v > 0 for v in rates.values())
        assert len(doc["per_round"][transform][doc["fast"]]) == 2
        assert set(doc["speedup"][transform]) == {"fast_shards"} | restarts | {
            f"fast_{d}" for d in decoders}
        assert all(v > 0 for v in doc["speedup"][transform].values())
        for a, b in (("simplejpeg", "pil"), ("libjpeg", "simplejpeg")):
            ratio = doc[f"{a}_over_{b}"]
            assert (ratio[transform] > 0) if {a, b} <= set(decoders) else ratio == {}
        ratio = doc["libjpeg_restarts_over_libjpeg"]
        assert (ratio[transform] > 0) if restarts else ratio == {}
    per_sample = 3 * 224 * 224
    assert doc["batch_bytes"]["current"] == 8 * (4 * per_sample + 8)  # float32 x, int64 y
    assert doc["batch_bytes"]["fast"] == 8 * (per_sample + 8)         # uint8 x
    assert doc["target_images_per_s_per_core"] == 800
    assert isinstance(doc["train_meets_target"], bool)
    assert 60_000 < doc["setup"]["mean_file_bytes"] < 200_000  # about ImageNet's 110 KB
    for flag, value in (("--images", "0"), ("--rounds", "x")):
        r = subprocess.run([sys.executable, "-m", "hpclb", "bench", "loader", flag, value,
                            "--out", str(out)], capture_output=True, text=True, timeout=60,
                           env=env)
        assert r.returncode == 2 and f"argument {flag}: must be an integer >= 1, got '{value}'" \
            in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "hpclb", "bench", "loader", "--help"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert "(default results/bench_loader.json)" in " ".join(r.stdout.split())


def test_the_baseline_and_the_fast_path_crop_the_same_boxes(tmp_path):
    """On PNGs (no DCT scaling) the path before issue 28, normalised, and the fast one agree to
    one grey level: the same seeded crop boxes and flips, the same eval crop."""
    from helpers import noise_image_folder

    root = noise_image_folder(tmp_path, ((37, 23), (23, 37), (64, 20)))
    for augment in (True, False):
        ds = ImageFolder(root, image_size=12, resize=14, augment=augment, seed=3)
        for i in range(len(ds)):
            fast = ds.normalize(ds.sample(i, 2)[0][None])[0]
            old = reference_sample(ds.files[i][0], 12, 14, augment, 3, 2, i)
            assert (fast - old).abs().max() <= 1.01 / 255 / min(0.229, 0.224, 0.225), (augment, i)


def test_synthetic_jpegs_are_imagenet_sized(tmp_path):
    from PIL import Image

    root = synthetic_jpegs(tmp_path / "first", 6, seed=1)
    files = sorted(root.glob("*/*.jpg"))
    assert len(files) == 6
    for f in files:
        with Image.open(f) as im:
            w, h = im.size
            assert im.format == "JPEG" and 500 <= w <= 800 and h == round(w * 3 / 4)
    again = synthetic_jpegs(tmp_path / "again", 6, seed=1)
    assert [p.read_bytes() for p in sorted(again.glob("*/*.jpg"))] == [
        p.read_bytes() for p in files]
    assert torch.is_tensor(ImageFolder(root).sample(0)[0])


@pytest.mark.parametrize("bench", ["loader", "host-overhead", "logging", "overhead", "scaling",
                                   "allreduce", "model", "trust-ratio"])
def test_an_existing_out_file_is_replaced_only_with_overwrite(tmp_path, bench):
    """Every `hpclb bench` refuses to replace its --out (a committed results/*.json, say) unless
    told, before it measures anything (in this process: the refusal comes first)."""
    from hpclb import cli

    out = tmp_path / "kept.json"
    out.write_text('{"committed": true}')
    assert cli.main(["bench", bench, "--out", str(out)]) == 2
    assert out.read_text() == '{"committed": true}'
    # a directory is no --out, with or without --overwrite (it failed after the whole run)
    assert cli.main(["bench", bench, "--out", str(tmp_path), "--overwrite"]) == 2
