"""`hpclb bench trust-ratio` on the CPU: the code path runs, GPU fields are null with the reason,
and the GPU targets are checked by a function that can fail (fabricated GPU results)."""
from __future__ import annotations

import json

import pytest
import torch

from hpclb.bench import trust_ratio as tr

pytestmark = pytest.mark.timeout(300)


def _gpu_result(over=None):
    row = dict(fraction_of_copy_bandwidth=0.93, host_us=31.0, host_synced=False,
               speedup_vs_torch=2.1, path="cupy")
    sets = {s: {o: dict(row) for o in ("lars", "lamb")} for s in ("resnet50", "bert_large")}
    for (s, o, field), v in (over or {}).items():
        sets[s][o][field] = v
    return {"gpu_skipped": None, "sets": sets}


def test_targets_met_and_missed():
    t = tr.check_targets(_gpu_result())
    assert t["asserted"] and t["failed"] == [] and len(t["checks"]) == len(tr.TARGETS)
    t = tr.check_targets(_gpu_result({("bert_large", "lamb", "fraction_of_copy_bandwidth"): 0.6,
                                        ("resnet50", "lars", "host_us"): 700.0,
                                        ("resnet50", "lamb", "speedup_vs_torch"): 1.2}))
    assert t["asserted"] and len(t["failed"]) == 3
    assert any("bert_large lamb fraction_of_copy_bandwidth 0.6" in f for f in t["failed"])
    # a host time measured while the host waited for the device is no host overhead
    t = tr.check_targets(_gpu_result({("resnet50", "lars", "host_synced"): True}))
    assert [c for c in t["checks"] if not c["ok"]][0]["field"] == "host_us"
    # figures of the torch path (CuPy failed) are not the fused kernel's
    t = tr.check_targets(_gpu_result({("bert_large", "lars", "path"): "torch"}))
    assert [(c["set"], c["optimizer"]) for c in t["checks"] if not c["ok"]] == \
        [("bert_large", "lars")]


def test_targets_not_asserted_without_a_gpu():
    t = tr.check_targets({"gpu_skipped": "device is the CPU", "sets": {}})
    assert t == {"asserted": False, "reason": "no GPU measurement: device is the CPU",
                 "failed": [], "checks": []}


def test_bytes_per_step_counts_the_kernels_words():
    ps = [torch.nn.Parameter(torch.zeros(10, 3)), torch.nn.Parameter(torch.zeros(5))]
    assert tr.bytes_per_step("lars", ps) == 7 * 4 * 35
    assert tr.bytes_per_step("lamb", [p.half() for p in ps]) == 11 * 2 * 35


def test_cpu_run_reports_the_torch_path(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = tr.main(["--sets", "resnet50", "--optimizers", "lars,lamb", "--device", "cpu",
                  "--steps", "1", "--warmup", "1", "--host-rounds", "1", "--assert-targets",
                  "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["gpu_skipped"] == "device is the CPU" and not res["targets"]["asserted"]
    for o, words in (("lars", 7), ("lamb", 11)):
        row = res["sets"]["resnet50"][o]
        assert row["n_tensors"] == 161 and row["bytes_per_step"] == words * 4 * 25_557_032
        assert row["step_ms_torch"] > 0
        assert all(row[k] is None for k in tr.GPU_FIELDS)
        # the host path with a launcher that does nothing: plan and plan-less, same run
        assert row["host_path"] == "null" and row["host_us_per_step"] > 0
        lo, hi = row["host_us_per_step_range"]
        assert lo <= row["host_us_per_step"] <= hi
        assert row["planless_over_plan"] == pytest.approx(
            row["host_us_per_step_planless"] / row["host_us_per_step"])
    assert res["host_target_us"] == 100.0
    assert "targets: not asserted (no GPU measurement: device is the CPU)" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown sets/optimizers"):
        tr.run(["resnet50"], optimizers=("adam",), device="cpu")
    with pytest.raises(ValueError, match="steps"):
        tr.run(["resnet50"], steps=0, device="cpu")
