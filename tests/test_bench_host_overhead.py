"""`hpclb bench host-overhead` at tiny sizes: the 1-process path in this process, the 2-rank path
under mpirun (extended); every optimizer and tensor count reports both sides and the difference,
with no timed asserts (the figures depend on the machine)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from hpclb.bench import host_overhead as ho

pytestmark = pytest.mark.timeout(300)
FIELDS = ("plain_us", "hpclb_us", "added_us", "added_us_per_tensor")


def _drive(argv):
    import argparse
    p = argparse.ArgumentParser()
    ho.add_run_arguments(p)
    return ho.driver(p.parse_args(argv))


def _check(run, world, tensors):
    assert run["world_size"] == world
    assert set(run["results"]) == set(ho.OPTIMIZERS)
    for rows in run["results"].values():
        assert set(rows) == {str(n) for n in tensors}
        for n, v in rows.items():
            assert all(math.isfinite(v[k]) for k in FIELDS)
            assert v["plain_us"] > 0 and v["hpclb_us"] > 0
            lo, hi = v["added_us_range"]
            assert lo <= v["added_us"] <= hi
            assert v["added_us_per_tensor"] == pytest.approx(v["added_us"] / int(n))


def test_one_process(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert _drive(["--np", "1", "--steps", "2", "--rounds", "2", "--tensors", "4", "16",
                   "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    _check(doc["runs"]["np1"], 1, (4, 16))
    assert doc["runs"]["np1"]["results"]["adam"]["16"]["aim_added_us"] == 50.0
    assert "wrote" in capsys.readouterr().out


def test_tiny_model_has_the_tensors_asked_for():
    m = ho.TinyModel(6)
    assert [tuple(p.shape) for p in m.parameters()] == [(4, 4), (4,)] * 3
    x = torch.ones(3 * 20)
    assert m(x).shape == ()


@pytest.mark.extended
def test_two_ranks(tmp_path):
    out = tmp_path / "h.json"
    assert _drive(["--np", "2", "--steps", "2", "--rounds", "1", "--tensors", "4",
                   "--out", str(out)]) == 0
    _check(json.loads(out.read_text())["runs"]["np2"], 2, (4,))
