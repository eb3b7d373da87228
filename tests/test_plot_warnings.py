"""``hpclb plot runs`` and ``hpclb advise`` through the real command line on damaged or short
runs: every line or point they leave out is warned about with its file and line, a missing
directory is named, and no traceback is printed (before: points dropped silently, an empty
panel, a traceback from advise on a torn middle line, the parent directory named)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpclb.config import resolve
from hpclb.tools import plot

pytestmark = pytest.mark.timeout(120)


def hpclb(*args):
    p = subprocess.run([sys.executable, "-m", "hpclb", *args], capture_output=True, text=True,
                       timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


def make_run(root, name, lines, **cfg_overrides):
    run = root / name
    run.mkdir()
    cfg = resolve("mnist-lstm", batch_size=256, **{"optimizer": "lars", **cfg_overrides})
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": 2}))
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    return run


def step(s, loss, **kw):
    return json.dumps({"kind": "step", "step": s, "loss": loss, "lr": 0.1 * s,
                       "trust_min": 0.1, "trust_median": 0.2, "trust_max": 0.3, **kw})


def epoch(e, **kw):
    return json.dumps({"kind": "epoch", "epoch": e, "step": 10 * e, "train_loss": 1.0 / e,
                       "test_accuracy": 0.5 + e / 10, "lr": 0.1, **kw})


def test_plot_runs_warns_for_nan_torn_middle_and_torn_last_lines(tmp_path):
    run = make_run(tmp_path, "r", [step(5, 2.0), step(10, float("nan")), "{\"kind\": \"st",
                                   epoch(1), step(15, 1.5, lr=float("inf")),
                                   epoch(2, test_accuracy=None), '{"kind": "step", "step": 2'])
    rc, out, err = hpclb("plot", "runs", str(run))
    assert rc == 0 and out.strip().endswith("plot.png"), err
    path = run / "metrics.jsonl"
    for expected in (f"{path}: line 2: loss = nan is not a finite number; point dropped",
                     f"{path}:3: not JSON (a damaged line); line skipped",
                     f"{path}: line 5: lr = inf is not a finite number; point dropped",
                     f"{path}: line 6: test_accuracy = null is not a finite number",
                     f"{path}:7: not JSON (a torn last line: the writer was killed); line "
                     f"skipped"):
        assert f"hpclb plot: warning: {expected}" in err, err
    assert err.count("warning:") == 5, err


def test_run_shorter_than_log_every_is_warned_and_lr_drawn_at_epoch_ends_only(tmp_path):
    run = make_run(tmp_path, "short", [epoch(1), epoch(2)], log_every=50)
    notes = []
    _, fig = plot.plot_runs([run], tmp_path / "p.png", warn=notes.append)
    assert len(notes) == 1 and "no per-step lines (the run took fewer optimizer steps than " \
        "log_every = 50" in notes[0] and "no trust ratios" in notes[0], notes
    (lr_line,) = fig.axes[2].get_lines()
    assert lr_line.get_linestyle() == "None" and lr_line.get_marker() == "o"
    assert list(lr_line.get_xydata()[:, 0]) == [1, 2]
    rc, _, err = hpclb("plot", "runs", str(run))
    assert rc == 0 and "hpclb plot: warning: " in err and "log_every = 50" in err


def test_missing_directory_is_named_not_its_parent(tmp_path):
    missing = tmp_path / "runs" / "nope"
    (tmp_path / "runs").mkdir()
    for args in (["plot", "runs", str(missing)], ["advise", str(missing)]):
        rc, _, err = hpclb(*args)
        assert rc == 2 and f"hpclb: error: {missing}: no such run directory" in err, err


def noise(b):
    return {"b_simple": b, "g2": 1.0, "trace": b, "b_simple_lo": b, "b_simple_hi": b, "n": 5}


def test_advise_warns_for_torn_middle_line_and_non_finite_noise(tmp_path):
    run = make_run(tmp_path, "n", [epoch(1, noise=noise(300.0)), "garbage{",
                                   epoch(2, noise=noise(float("nan"))),
                                   epoch(3, noise=noise(500.0))], noise_scale=True)
    rc, out, err = hpclb("advise", str(run))
    assert rc == 0, err
    assert "critical_batch 400 " in out  # median of epochs 1 and 3
    path = run / "metrics.jsonl"
    assert f"hpclb advise: warning: {path}:2: not JSON (a damaged line); line skipped" in err
    assert f"hpclb advise: warning: {path}:3: epoch 2: noise.b_simple = nan is not a positive " \
        f"finite number; epoch left out" in err


def test_advise_says_why_there_is_no_noise_scale(tmp_path):
    one = make_run(tmp_path, "one", [epoch(1)], noise_scale=True)
    cfg = json.loads((one / "config.json").read_text())
    (one / "config.json").write_text(json.dumps({**cfg, "world_size": 1}))
    rc, _, err = hpclb("advise", str(one))
    assert rc == 2 and "trained at one process with noise_scale on, where the gradient noise " \
        "scale needs >= 2 ranks" in err, err
    off = make_run(tmp_path, "off", [epoch(1)])
    rc, _, err = hpclb("advise", str(off))
    assert rc == 2 and "trained without the noise scale" in err and "--noise-scale" in err


def test_advise_on_a_run_without_an_epoch_row_says_so(tmp_path):
    """An empty metrics.jsonl (a run killed in its first epoch) is not blamed on the gradient
    noise (found by a fresh-user review: it said the gradient was all noise so far)."""
    for name, lines in (("empty", []), ("steps", [step(1, 2.3), step(2, 2.2)])):
        run = make_run(tmp_path, name, lines, noise_scale=True)
        rc, _, err = hpclb("advise", str(run))
        assert rc == 2 and "it has no epoch row at all" in err, err
        assert "all noise" not in err, err


@pytest.mark.parametrize("b0", ["abc", True, 0, 12.5])
def test_advise_refuses_a_damaged_base_batch_size_naming_the_file(tmp_path, b0):
    """A config.json whose recipe.base_batch_size is not a positive integer is named (a boolean
    was read as B0 = 1 with exit 0, text gave int()'s message without the file; fresh-user
    review)."""
    run = make_run(tmp_path, "run", [epoch(1, noise=noise(500.0))], noise_scale=True)
    cfg = json.loads((run / "config.json").read_text())
    cfg["recipe"]["base_batch_size"] = b0
    (run / "config.json").write_text(json.dumps(cfg))
    rc, _, err = hpclb("advise", str(run))
    assert rc == 2 and f"{run / 'config.json'}: recipe.base_batch_size {b0!r} is not a " \
        f"positive integer" in err, err
