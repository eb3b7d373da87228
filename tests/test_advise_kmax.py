"""`hpclb advise`'s k_max prediction (hpclb/tools/advise.py, docs/science.md "Where LEGW
breaks") and the LR probe's verdict (hpclb/tools/lr_probe.py), on made-up inputs; the probe's
runs on a tiny recipe."""
import json
import math
import os
from pathlib import Path

import pytest
from helpers import quick_recipe

from hpclb.tools.kmax import PROGRESS_MIN, format_prediction, predict_k_max, progress_ratio
from hpclb.tools.lr_probe import trains

REPO = Path(__file__).resolve().parents[1]

MNIST = dict(base_batch_size=128, num_samples=60000, epochs=20, base_warmup_epochs=0.25,
             base_lr=2e-3)


def test_progress_ratio_by_hand():
    assert progress_ratio(128, 128, [300.0, 5000.0]) == 1.0
    # (128 + 300) / (1024 + 300) and (128 + 5000) / (1024 + 5000), averaged
    want = (428 / 1324 + 5128 / 6024) / 2
    assert progress_ratio(1024, 128, [300.0, 5000.0]) == pytest.approx(want)
    # one constant noise scale: at least 1/2 exactly while B <= B_crit + 2 B0
    assert progress_ratio(1000 + 256, 128, [1000.0]) == pytest.approx(0.5)


def test_budget_bound_from_a_constant_noise_scale():
    p = predict_k_max(**MNIST, b_simple=[1000.0] * 20)
    # k * 128 <= 1000 + 256: k = 8 passes (1024), k = 16 (2048) does not
    assert p["bounds"]["budget"] == 8 and p["k_max"] == 8 and p["binding"] == ["budget"]
    # rows end where the warmup (117 steps) is no longer shorter than the run (80 at k = 128)
    assert [r["k"] for r in p["rows"]] == [1, 2, 4, 8, 16, 32, 64]


def test_warmup_bound_is_lewgs_constant_steps_over_half_the_budget():
    p = predict_k_max(**MNIST, b_simple=[1e9] * 20)  # noise never binds
    rows = {r["k"]: r for r in p["rows"]}
    assert rows[32]["warmup_steps"] == rows[64]["warmup_steps"] == 117  # 0.25 x 60000 / 128
    assert rows[32]["total_steps"] == 300 and rows[64]["total_steps"] == 160
    assert p["bounds"]["warmup"] == 32 and p["k_max"] == 32 and p["binding"] == ["warmup"]
    assert "117 of 160" in format_prediction(p)


def test_bound_by_names_only_bounds_that_fail():
    """Where no bound fails inside the table, "bound by" names why the k range ends (the
    training set, or a warmup no shorter than the whole run, which fails the warmup bound), not
    every bound, nor an unmeasured stability (found by a fresh-user review)."""
    small = dict(MNIST, num_samples=2048, epochs=2)  # 32 steps at B0, 4 warmup steps
    p = predict_k_max(**small, b_simple=[1e9] * 2)
    # k = 4: 4 of 8 steps (50 %, passes); k = 8: 4 of 4, no schedule: the warmup fails there
    assert [r["k"] for r in p["rows"]] == [1, 2, 4] and p["table_end"] is None
    assert p["k_max"] == 4 and p["binding"] == ["warmup"], p
    assert "(fails at k = 8: the warmup is no shorter than the whole run there)" in \
        format_prediction(p)
    data = predict_k_max(**dict(MNIST, base_warmup_epochs=0.01), b_simple=[1e9] * 20)
    assert data["rows"][-1]["k"] == 256 and data["table_end"] == "training set"
    assert data["binding"] == ["training set"] and data["k_max"] == 256, data
    text = format_prediction(data)
    assert "bound by training set" in text and "stability" not in text.splitlines()[0], text


def test_stability_bound_is_the_sqrt_k_peak_under_the_stable_lr():
    # stable LR 4x eta0: sqrt(k) <= 4, k <= 16
    p = predict_k_max(**MNIST, b_simple=[1e9] * 20, stable_lr=8e-3)
    assert p["bounds"]["stability"] == 16 and p["k_max"] == 16 and p["binding"] == ["stability"]
    assert "k <= 16" in format_prediction(p)
    unmeasured = predict_k_max(**MNIST, b_simple=[1e9] * 20)
    assert "not measured" in format_prediction(unmeasured)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="b_simple"):
        predict_k_max(**MNIST, b_simple=[math.nan])
    with pytest.raises(ValueError, match="epochs"):
        predict_k_max(**{**MNIST, "epochs": 0}, b_simple=[1.0])


def test_probe_verdicts():
    assert trains([2.3, 2.0, 1.5, 1.0, 0.8, 0.7, 0.6, 0.5])[0]
    ok, why = trains([2.3, 2.0, 2.6, 1.0, 0.8, 0.7, 0.6, 0.5])
    assert not ok and "rose to 2.6" in why
    ok, why = trains([2.3, 2.3, 2.3, 2.3, 2.3, 2.3, 2.3])
    assert not ok and "not training" in why
    assert not trains([2.3, 2.0, float("nan"), 1.0, 0.9, 0.8, 0.7])[0]
    assert not trains([2.3, 2.0])[0]
    assert PROGRESS_MIN == 0.5


@pytest.mark.extended  # a real probe grid (~90 s); the rule's pieces are tested above
def test_stability_probe_runs_the_grid_until_an_lr_does_not_train(tmp_path):
    """A real probe of a small MNIST-LSTM recipe (hidden 16, 4,096 images, B0 128: 8 warmup
    steps then 62 at the LR): Adam at 0.32 trains, and the grid goes up by sqrt(2) until an LR
    does not (1.28 did not, on 2026-12-07: the loss rose to 4.0 from 2.4); the stable LR is the
    last that trained and the JSON is written."""
    from hpclb.tools.lr_probe import stability_probe

    recipe = quick_recipe(tmp_path, model={"name": "mnist_lstm", "hidden_size": 16},
                          optimizers={"adam": {"lr": 0.32}})
    seen = []
    r = stability_probe(recipe, optimizer="adam", work=tmp_path / "probe", max_j=8,
                        hold_steps=62, report=seen.append)
    assert r["probes"] == seen and seen[0]["trains"] and not seen[-1]["trains"]
    assert all(p["trains"] for p in seen[:-1])
    assert r["stable_lr"] == pytest.approx(0.32 * 2 ** (seen[-2]["j"] / 2))
    assert r["k_stable"] == 2 ** seen[-2]["j"] and r["bounded"]
    assert seen[0]["steps"] == 70 and len(seen[0]["losses"]) == 7  # logged every 10 steps
    saved = json.loads((tmp_path / "probe" / "lr_probe.json").read_text())
    assert saved["stable_lr"] == r["stable_lr"]


def test_an_epoch_whose_gradient_is_all_noise_counts_as_infinite_noise_scale():
    """Late in a run whose loss is near 0 the smoothed |G|^2 turns negative (MNIST-LSTM with
    momentum, epochs 15-20 of 20): B_simple is undefined there, and infinite by its meaning
    (every batch is below the critical batch), so those epochs make full progress."""
    assert progress_ratio(1024, 128, [math.inf]) == 1.0
    assert progress_ratio(1024, 128, [1000.0, math.inf]) == pytest.approx((1128 / 2024 + 1) / 2)
    p = predict_k_max(**MNIST, b_simple=[1000.0] * 10 + [math.inf] * 10)
    # half the epochs at full progress: the mean never falls under 1/2 (k = 64, the last row)
    assert p["bounds"]["budget"] == 64
    p = predict_k_max(**MNIST, b_simple=[1000.0] * 15 + [math.inf] * 5)
    # (3/4) 1128 / (k 128 + 1000) + 1/4 >= 1/2: k 128 + 1000 <= 3384, k <= 18: 16
    assert p["bounds"]["budget"] == 16


def test_hpclb_advise_prints_k_max_from_a_b0_run(tmp_path, capsys):
    """`hpclb advise RUN_DIR` on a B0 run directory (config.json as `hpclb train` writes it, epoch
    rows with the noise field): the critical batch, then k_max and each bound's reason; --json
    carries the inputs; a run not at B0 gets no prediction."""
    from hpclb.cli import main
    from hpclb.config import load_recipe

    recipe = quick_recipe(tmp_path, epochs=4)  # 4,096 images, B0 128: 32 steps an epoch
    run = tmp_path / "run"
    run.mkdir()
    # the run's recorded recipe is what counts, not the name it was started by (a copy, a
    # plug-in recipe, another working directory): the name here resolves to nothing
    cfg = {"experiment": "started-elsewhere.yaml", "optimizer": "adam", "lr": None,
           "epochs": 4.0, "data_root": None, "global_batch_size": 128, "world_size": 2,
           "noise_scale": True, "recipe": load_recipe(recipe)}
    (run / "config.json").write_text(json.dumps(cfg))
    noise = [300.0, 600.0, 900.0, 1200.0]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "epoch", "epoch": e + 1, "noise": {"b_simple": b, "g2": 1.0}}) + "\n"
        for e, b in enumerate(noise)))
    assert main(["advise", str(run), "--stable-lr", "0.016"]) == 0
    out = capsys.readouterr().out
    want = predict_k_max(base_batch_size=128, num_samples=4096, epochs=4.0,
                         base_warmup_epochs=0.25, base_lr=2e-3, b_simple=noise,
                         stable_lr=0.016)
    assert f"k_max {want['k_max']} (batch {128 * want['k_max']})" in out, out
    for line in ("budget:", "warmup:", "stability: sqrt(k) x eta0 <= stable LR 0.016"):
        assert line in out, out
    assert main(["advise", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["b_simple"] == noise and doc["inputs"]["num_samples"] == 4096
    assert doc["stable_from"] is None and doc["probe"] is None  # no stable LR: from nowhere
    # --last below 1 is refused by the command too (it combined every epoch, or dropped the
    # first, with exit 0; found by a fresh-user review); --lr-probe and --stable-lr exclude
    for last in ("0", "-1"):
        assert main(["advise", str(run), "--last", last]) == 2
        assert "--last must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["advise", str(run), "--lr-probe", "--stable-lr", "1"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    # a stable LR under eta0: the B0 recipe itself is past it, k_max 1, said so
    assert main(["advise", str(run), "--stable-lr", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "k_max 1 (batch 128)" in out and "(given) -> k <= 1 (B0's own eta0 is above it)" in out
    # a probe of another optimizer (the run overwritten since) is not used
    (run / "lr_probe").mkdir()
    (run / "lr_probe" / "lr_probe.json").write_text(json.dumps(
        {"optimizer": "momentum", "base_lr": 0.1, "stable_lr": 0.2, "probes": []}))
    assert main(["advise", str(run)]) == 0
    cap = capsys.readouterr()
    assert "stability: not measured" in cap.out and "probed momentum from eta0 0.1" in cap.err
    assert "not its recipe's" not in cap.err
    # a B0 run cut short of its recipe's budget predicts for the budget it trained, and says so
    # (review finding: it did so silently)
    (run / "config.json").write_text(json.dumps({**cfg, "epochs": 2.0}))
    assert main(["advise", str(run)]) == 0
    assert "trained 2 epochs, not its recipe's 4: k_max is for a budget of 2 epochs" \
        in capsys.readouterr().err
    cfg["global_batch_size"] = 1024
    (run / "config.json").write_text(json.dumps(cfg))
    assert main(["advise", str(run)]) == 0
    assert "k_max: not predicted (trained at batch 1024" in capsys.readouterr().out
    assert main(["advise", str(run), "--json"]) == 0  # the advice, no prediction
    doc = json.loads(capsys.readouterr().out)
    assert doc["prediction"] is None and doc["advice"]["run_batch_size"] == 1024
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main(["advise", str(run), "--stable-lr", bad])


def _b0_run(tmp_path, noise, epochs=4):
    """A B0 run directory of the 4,096-image quick recipe: config.json and epoch rows."""
    from hpclb.config import load_recipe

    run = tmp_path / "run"
    run.mkdir()
    cfg = {"experiment": "quick.yaml", "optimizer": "adam", "lr": None, "epochs": float(epochs),
           "data_root": "data", "data_dir": None, "global_batch_size": 128, "world_size": 2,
           "steps_per_epoch": 32, "noise_scale": True,
           "recipe": load_recipe(quick_recipe(tmp_path, epochs=epochs))}
    (run / "config.json").write_text(json.dumps(cfg))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "epoch", "epoch": e + 1, "noise": {"b_simple": b, "g2": -1.0 if b ==
                                                               math.inf else 1.0}}) + "\n"
        for e, b in enumerate(noise)))
    return run


def test_advise_review_findings(tmp_path, capsys, monkeypatch):
    """What a fresh-user review found in `hpclb advise` (2026-12-07): a recommended batch above
    k_max's, Infinity in --json, epochs labelled as a range they are not, a record's
    lr_probe.json not read, a file taken for a run, and the probe reading ./data."""
    from hpclb.cli import main

    # epochs 3 (all noise: inf) and 4: the critical batch is 3000 from epochs 1, 2, 4
    run = _b0_run(tmp_path, [1000.0, 3000.0, math.inf, 3000.0])
    assert main(["advise", str(run), "--stable-lr", "0.004"]) == 0  # stability: k <= 4
    out = capsys.readouterr().out
    assert "median of epochs 1, 2, 4;" in out, out
    # the critical-batch rule alone says 2048; k_max 4 (batch 512) caps it
    assert "recommended_batch 512 (LEGW, k = 4: the largest B0 x 2^j not above critical_batch, " \
           "capped at k_max's batch 512 (below)" in out, out
    assert "k_max 4 (batch 512)" in out
    assert main(["advise", str(run), "--json", "--stable-lr", "0.004"]) == 0
    text = capsys.readouterr().out
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert doc["inputs"]["b_simple"] == [1000.0, 3000.0, None, 3000.0]
    assert doc["advice"]["capped_at"] == 512 and doc["advice"]["recommended_batch"] == 512
    from hpclb.tools.kmax import predict_for_run  # the library gives the same, not the CLI only

    lib = predict_for_run(run, stable_lr=0.004, warn=lambda _: None)["advice"]
    assert (lib["capped_at"], lib["recommended_batch"], lib["recommended_hi"]) == (512, 512, 512)
    # a run's record keeps its probe beside config.json (results/science/b0-noise/<w>/)
    probe = {"optimizer": "adam", "base_lr": 0.002, "stable_lr": 0.004, "probes": []}
    (run / "lr_probe.json").write_text(json.dumps(probe))
    assert main(["advise", str(run)]) == 0
    assert "stable LR 0.004 (probe at B0) -> k <= 4" in capsys.readouterr().out
    # a file that is not a metrics file is refused as such, not read as 50 damaged lines
    (run / "summary.json").write_text("{}")
    assert main(["advise", str(run / "summary.json")]) == 2
    err = capsys.readouterr().err
    assert "summary.json: a file, not a run directory" in err and "damaged" not in err
    # --lr-probe reads the data where the user says (or $HPCLB_DATA), not the run's ./data
    class Probed(Exception):
        pass

    def probe(*args, data_dir, **kwargs):  # stands in for the probe's runs
        raise Probed(data_dir)

    monkeypatch.setattr("hpclb.tools.lr_probe.stability_probe", probe)
    (run / "lr_probe.json").unlink()
    with pytest.raises(Probed, match=f"^{tmp_path / 'd'}$"):
        main(["advise", str(run), "--lr-probe", "--data-dir", str(tmp_path / "d")])
    with pytest.raises(Probed, match="^None$"):  # the run's --data-dir: none, so $HPCLB_DATA
        main(["advise", str(run), "--lr-probe"])


def test_the_run_data_is_found_where_the_user_says(tmp_path, monkeypatch):
    """advise on a word-level LM run counts its training set by reading the data: it read the
    run's recorded data_root (relative: ./data of wherever advise ran) and ignored --data-dir and
    $HPCLB_DATA, so the committed PTB record failed outside the repository."""
    from hpclb.tools.kmax import run_data_dir

    here = tmp_path / "staged"
    here.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPCLB_DATA", raising=False)
    recorded = {"data_dir": None, "data_root": "data"}  # the run read ./data where it ran
    assert run_data_dir(recorded, str(here)) == str(here)  # --data-dir wins
    assert run_data_dir({**recorded, "data_dir": "/given"}) == "/given"  # the run's own flag
    assert run_data_dir(recorded) is None  # ./data is not here: the default (./data) says so
    assert run_data_dir({**recorded, "data_root": str(here)}) == str(here)  # it is here
    monkeypatch.setenv("HPCLB_DATA", "/env/data")
    assert run_data_dir({**recorded, "data_root": str(here)}) is None  # resolve reads the env


def test_advise_on_the_committed_ptb_record_from_elsewhere(tmp_path, monkeypatch, capsys):
    """The committed PTB record, from a directory without ./data: --data-dir is used."""
    from hpclb import cli

    data = Path(os.environ.get("HPCLB_DATA", REPO / "data")).resolve()
    if not (data / "ptb" / "ptb.train.txt").is_file():
        pytest.fail(f"PTB is not staged under {data}: run `make data`")
    record = (REPO / "results" / "science" / "b0-noise" / "ptb").resolve()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPCLB_DATA", raising=False)
    assert cli.main(["advise", str(record), "--data-dir", str(data)]) == 0
    assert "k_max 16 (batch 320)" in capsys.readouterr().out


def test_an_sgd_family_prediction_says_it_is_an_upper_bound(capsys):
    """advise recommended LEGW up to k = 32 with momentum, where the k-map measured failure at
    every k from 8, with no word of it: SGD-family runs get the caveat, Adam's do not."""
    from hpclb import cli

    for record, caveat in (("mnist-momentum", True), ("mnist-adam", False)):
        assert cli.main(["advise", str(REPO / "results/science/b0-noise" / record)]) == 0
        out = capsys.readouterr().out
        assert ("caveat: with SGD (+ momentum) read k_max as an upper bound" in out) == caveat
        assert "caveat: with LARS" not in out


def test_a_lars_prediction_bound_by_stability_says_it_was_conservative(capsys):
    """The CNN's k-map measured k_max 4 where advise, bound by the B0 probe's stable LR,
    predicted 1 and said nothing of it: a LARS/LAMB prediction bound by stability says so."""
    from hpclb import cli

    assert cli.main(["advise", str(REPO / "results/science/b0-noise/cnn")]) == 0
    out = capsys.readouterr().out
    assert "k_max 1 (batch 128)" in out
    assert "caveat: with LARS, a k_max bound by stability from a probe at B0 was conservative" in out
