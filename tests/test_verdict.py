"""The science verdict's rules (hpclb/tools/verdict.py, docs/science.md) on made-up rows."""
import math

import pytest

from hpclb.tools.verdict import cells, tolerance, verdict, verdict_markdown


def _rows(table: dict) -> list[dict]:
    return [{"batch_size": b, "scheme": s, "seed": seed, "metric": v, "epochs": 20,
             "ranks": 1, "optimizer": "adam"}
            for (b, s), vals in table.items() for seed, v in enumerate(vals)]


B0 = {(128, "legw"): [0.990, 0.991, 0.989]}


def test_legw_holds_and_both_baselines_lose_supports_the_claim():
    rows = _rows({**B0, (8192, "legw"): [0.988, 0.989, 0.988],
                  (8192, "sqrt"): [0.970, 0.975, 0.972], (8192, "goyal"): [0.93, None, 0.95]})
    v = verdict(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert v["tolerance"] == pytest.approx(0.003)  # 2 sigma0 = 0.002 < 0.3 pp
    assert v["holds"] == {8192: True}
    assert v["loses"] == {(8192, "sqrt"): True, (8192, "goyal"): True}
    assert v["supported"] is True
    md = verdict_markdown(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert "| 8192 | goyal |" in md and "1: diverged" in md and "**supported**" in md


def test_one_bad_or_diverged_legw_seed_breaks_holds():
    for bad in (None, 0.982):  # diverged, or worse than twice the tolerance
        rows = _rows({**B0, (8192, "legw"): [0.990, bad, 0.990],
                      (8192, "sqrt"): [0.97] * 3, (8192, "goyal"): [0.97] * 3})
        v = verdict(rows, metric="test_accuracy", mode="max", base_batch=128)
        assert v["holds"][8192] is False and v["supported"] is False


def test_a_baseline_within_tolerance_or_overlapping_legw_does_not_lose():
    rows = _rows({**B0, (8192, "legw"): [0.980, 0.985, 0.990],
                  (8192, "sqrt"): [0.989, 0.989, 0.989],   # within the tolerance
                  (8192, "goyal"): [0.975, 0.990, 0.975]})  # one seed as good as LEGW
    v = verdict(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert v["loses"] == {(8192, "sqrt"): False, (8192, "goyal"): False}
    assert v["supported"] is False


def test_perplexity_uses_three_percent_and_lower_is_better():
    rows = _rows({(20, "legw"): [114.0, 115.0, 116.0], (640, "legw"): [117.0, 118.0, 117.5],
                  (640, "sqrt"): [math.inf], (640, "goyal"): [None]})
    base = cells(rows)[(20, "legw")]
    assert tolerance(base, "test_perplexity", "min") == pytest.approx(0.03 * 115.0)
    v = verdict(rows, metric="test_perplexity", mode="min", base_batch=20)
    assert v["holds"] == {640: True} and v["supported"] is True


def test_a_missing_cell_leaves_the_claim_undecided_and_no_b0_no_verdict():
    rows = _rows({**B0, (8192, "legw"): [0.990] * 3})
    assert verdict(rows, metric="test_accuracy", mode="max", base_batch=128)["supported"] is None
    with pytest.raises(ValueError, match="no finite B0"):
        verdict(_rows({(8192, "legw"): [0.9]}), metric="test_accuracy", mode="max",
                base_batch=128)


def test_a_decided_failure_decides_the_claim_though_a_baseline_is_missing():
    """LEGW does not hold at the largest batch: the claim is not supported whatever the
    missing sqrt point would say (PTB-small at 640 with its sqrt run unfinished); a baseline
    that does not lose decides it too."""
    rows = _rows({**B0, (8192, "legw"): [0.970, 0.972, 0.971], (8192, "goyal"): [0.95]})
    v = verdict(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert v["holds"] == {8192: False} and (8192, "sqrt") not in v["loses"]
    assert v["supported"] is False
    md = verdict_markdown(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert "**not supported**" in md and "not decided yet" not in md
    rows = _rows({**B0, (8192, "legw"): [0.990] * 3, (8192, "goyal"): [0.990]})
    assert verdict(rows, metric="test_accuracy", mode="max", base_batch=128)["supported"] is False


def test_legw_is_pending_until_it_has_as_many_seeds_as_b0():
    rows = _rows({**B0, (8192, "legw"): [0.980], (8192, "sqrt"): [0.95]})
    v = verdict(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert v["holds"] == {8192: None} and v["loses"] == {} and v["supported"] is None
    md = verdict_markdown(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert "pending (1 of 3 seeds)" in md and "not decided yet" in md


def test_b0_is_chosen_by_batch_not_by_row_order():
    """PTB's rows: a one-seed B0 copy per baseline scheme beside LEGW's three B0 seeds. Put a
    one-seed B0 cell first: B0 must still be all three seeds (before: whichever cell came
    first, so LEGW at 640 with 3 seeds was judged against one seed and ``pending`` never
    cleared for a 1-seed base)."""
    table = {(20, "sqrt"): [113.3], (20, "legw"): [113.3, 113.4, 112.2],
             (640, "legw"): [116.0, 115.0, 114.0], (640, "sqrt"): [650.0, 640.0, 645.0]}
    rows = _rows(table)
    for ordered in (rows, rows[::-1], sorted(rows, key=lambda r: r["scheme"])):
        v = verdict(ordered, metric="test_perplexity", mode="min", base_batch=20)
        assert sorted(v["base"].values) == [0, 1, 2]
        assert v["base"].mean == pytest.approx((113.3 + 113.4 + 112.2) / 3)
        assert v["holds"] == {640: True}


def test_two_different_b0_values_for_one_seed_are_refused():
    rows = _rows({(20, "legw"): [113.3], (20, "sqrt"): [120.0], (640, "legw"): [116.0]})
    with pytest.raises(ValueError, match="seed 0 has two values"):
        verdict(rows, metric="test_perplexity", mode="min", base_batch=20)


def test_a_rejected_point_is_not_a_result():
    """A point the schedule refused (no metric, an error, status rejected) was shown as
    "diverged", and LEGW there as "does not hold", the claim "not supported": it is neither."""
    rejected = {"metric": None, "status": "rejected", "error": "schedule: warmup (293 steps) "
                "must be shorter than training (177 steps)"}
    rows = _rows(B0) + [{**r, **rejected} for r in _rows({(1024, "legw"): [None],
                                                          (1024, "goyal"): [None]})]
    v = verdict(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert v["holds"] == {} and v["loses"] == {} and v["supported"] is None
    md = verdict_markdown(rows, metric="test_accuracy", mode="max", base_batch=128)
    assert "diverged" not in md and "does not hold" not in md and "not supported" not in md, md
    assert "| 1024 | legw | — | 0: rejected, not trained |" in md, md
    assert "**not decided yet" in md
    # a diverged point (an error too, but a result) still breaks holds
    diverged = [{**r, "metric": None, "status": "diverged", "error": "loss is nan"}
                for r in _rows({(1024, "legw"): [None, None, None]})]
    assert verdict(_rows(B0) + diverged, metric="test_accuracy", mode="max",
                   base_batch=128)["holds"] == {1024: False}
