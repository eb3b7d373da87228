"""hpclb.tools.plot: the drawn lines carry the schedule / metrics values, and the PNGs are written."""
import json

import pytest

from hpclb.config import resolve
from hpclb.errors import ConfigError
from hpclb.tools import plot
from hpclb.train.metrics import RunLogger

pytestmark = pytest.mark.timeout(120)


def _png(path):
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 10_000
    return data


def _lines(ax):
    return {line.get_label(): line.get_xydata() for line in ax.get_lines()}


@pytest.mark.slow  # ~2 s quiet, 9 s on a loaded machine
def test_schedule_lines_are_the_schedules(tmp_path):
    out = tmp_path / "s.png"
    path, fig, skipped = plot.plot_schedule("mnist-lstm", [1, 8, 64], out)
    assert path == out and skipped == []
    _png(out)
    schemes = ("legw", "goyal", "linear", "sqrt", "none")
    top, bottom = fig.axes[:5], fig.axes[5:]
    assert [ax.get_title() for ax in top] == [f"mnist-lstm: {s}" for s in schemes]
    for j, scheme in enumerate(schemes):
        for k in (1, 8, 64):
            sched = resolve("mnist-lstm", batch_size=128 * k, scaling=scheme).schedule(60_000)
            xy = _lines(top[j])[f"k={k} (B={128 * k})"]
            steps = [round(x * sched.steps_per_epoch) for x in xy[:, 0]]
            assert list(xy[:, 1]) == [sched.lr(s) for s in steps]
            assert steps[0] == 0 and steps[-1] == sched.total_steps - 1
            assert sched.warmup_steps in steps and sched.warmup_steps - 1 in steps
            xy_steps = _lines(bottom[j])[f"k={k} (B={128 * k})"]
            assert list(xy_steps[:, 0]) == [s + 1 for s in steps]
            assert list(xy_steps[:, 1]) == list(xy[:, 1])
    # the LEGW picture: peak sqrt(k)x and the same warmup steps
    legw = _lines(top[0])
    assert max(legw["k=64 (B=8192)"][:, 1]) == pytest.approx(8 * 2e-3)


def test_schedule_skips_what_cannot_run_and_checks_k(tmp_path):
    _, fig, skipped = plot.plot_schedule("mnist-lstm", [1, 128], tmp_path / "s.png",
                                         schemes=["legw"], epochs=20)
    assert len(skipped) == 1 and "legw k=128" in skipped[0] and "warmup" in skipped[0]
    assert list(_lines(fig.axes[0])) == ["k=1 (B=128)"]
    with pytest.raises(ConfigError, match="--k"):
        plot.plot_schedule("mnist-lstm", [0], tmp_path / "x.png")
    with pytest.raises(ConfigError, match="no schedule to draw"):
        plot.plot_schedule("mnist-lstm", [1024], tmp_path / "x.png", schemes=["legw"])


def _fake_run(root, name, batch, *, trust):
    run = root / name
    with RunLogger(run, enabled=True, tensorboard=False) as rl:
        for s in range(1, 21):
            scalars = {"loss": 2.0 / s, "lr": 0.01 * s}
            if trust:
                scalars.update(trust_min=0.5, trust_median=1.0 + s, trust_max=4.0)
            rl.log_step(s, scalars)
            if s % 10 == 0:
                rl.log_epoch({"epoch": s // 10, "step": s, "train_loss": 1.0 / s,
                              "test_accuracy": 0.5 + s / 100, "lr": 0.01 * s})
    (run / "config.json").write_text(json.dumps({
        "global_batch_size": batch, "scaling": "legw",
        "recipe": {"target": {"metric": "test_accuracy", "value": 0.9}}}))
    (run / "summary.json").write_text(json.dumps({"steps_per_epoch": 10}))
    return run


def test_runs_share_axes_and_carry_the_logged_values(tmp_path):
    a = _fake_run(tmp_path, "a", 128, trust=True)
    b = _fake_run(tmp_path, "b", 1024, trust=False)
    path, fig = plot.plot_runs([a, b])
    assert path == tmp_path / "plot-a+b.png"
    _png(path)
    loss, metric, lr, trust = fig.axes
    la = _lines(loss)["a (B=128, legw)"]
    assert list(la[:, 0]) == [s / 10 for s in range(1, 21)]
    assert list(la[:, 1]) == [2.0 / s for s in range(1, 21)]
    assert list(_lines(metric)["b (B=1024, legw)"][:, 1]) == [0.6, 0.7]
    assert list(_lines(metric)["b (B=1024, legw)"][:, 0]) == [1, 2]
    assert list(_lines(lr)["a (B=128, legw)"][:, 1]) == [0.01 * s for s in range(1, 21)]
    assert list(_lines(trust)) == ["a (B=128, legw)"]  # b logged no trust ratios
    assert list(_lines(trust)["a (B=128, legw)"][:, 1]) == [1.0 + s for s in range(1, 21)]
    assert metric.get_ylabel() == "test_accuracy"
    one, _ = plot.plot_runs([b])
    assert one == b / "plot.png"


def test_sparse_step_lines_give_way_to_epoch_rows(tmp_path):
    """A large-batch sweep point: 3 step lines over 10 epochs, no config.json. Loss and LR come
    from the epoch rows (a line through the step lines would claim values nobody logged), the
    metric from summary.json's metric_name, and a loss that spans > 100x is drawn on a log
    scale."""
    run = tmp_path / "big"
    with RunLogger(run, enabled=True, tensorboard=False) as rl:
        for e in range(1, 11):
            if e in (3, 6, 9):
                rl.log_step(e * 2, {"loss": 50.0, "lr": 9.0})
            rl.log_epoch({"epoch": e, "step": 2 * e, "train_loss": 10.0 ** (3 - e / 2),
                          "test_loss": 1.0, "test_accuracy": e / 10, "lr": 1.0 / e})
    (run / "summary.json").write_text(json.dumps({"steps_per_epoch": 2,
                                                  "metric_name": "test_accuracy"}))
    notes = []
    _, fig = plot.plot_runs([run], tmp_path / "p.png", warn=notes.append)
    loss, metric, lr, _ = fig.axes
    assert list(_lines(loss)["big"][:, 1]) == [10.0 ** (3 - e / 2) for e in range(1, 11)]
    assert loss.get_yscale() == "log"
    assert list(_lines(lr)["big"][:, 1]) == [1.0 / e for e in range(1, 11)]
    assert metric.get_ylabel() == "test_accuracy"
    assert list(_lines(metric)["big"][:, 1]) == [e / 10 for e in range(1, 11)]
    assert any("3 per-step lines against 10 epoch rows" in n for n in notes), notes
    # a diverged point (no summary.json) beside it: the shared panel keeps test_accuracy
    dead = tmp_path / "dead"
    with RunLogger(dead, enabled=True, tensorboard=False) as rl:
        rl.log_epoch({"epoch": 1, "step": 2, "train_loss": 300.0, "test_loss": 900.0,
                      "test_accuracy": 0.1, "lr": 9.0})
    _, fig = plot.plot_runs([dead, run], tmp_path / "q.png", warn=notes.append)
    assert fig.axes[1].get_ylabel() == "test_accuracy"
    assert list(_lines(fig.axes[1])["dead"][:, 1]) == [0.1]


def test_old_run_without_step_lines(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"epoch": 1, "step": 5, "train_loss": 2.0, "test_bleu": 0.5, "lr": 0.1}\n'
        '{"epoch": 2, "step": 10, "train_loss": 1.0, "test_bleu": 0.9, "lr": 0.05}\n')
    path, fig = plot.plot_runs([run], tmp_path / "o.png")
    _png(path)
    assert list(_lines(fig.axes[0])["old"][:, 1]) == [2.0, 1.0]
    assert list(_lines(fig.axes[1])["old"][:, 1]) == [0.5, 0.9]
    with pytest.raises(ConfigError, match=r"/missing: no such run directory"):
        plot.plot_runs([tmp_path / "missing"])
    with pytest.raises(ConfigError, match=r"old/metrics.jsonl: no metrics file.*hpclb train"):
        (run / "metrics.jsonl").unlink()
        plot.plot_runs([run])


def test_sweep_plot_marks_b0(tmp_path):
    row = {"scheme": "legw", "metric_name": "test_accuracy", "peak_lr": 0.1, "steps": 100,
           "steps_per_epoch": 10, "decay": {"name": "constant"}}
    rows = [{**row, "batch_size": b, "batch_ratio_k": b / 64, "metric": m,
             "warmup_steps": 5, "peak_lr": 0.1 * (b / 64) ** 0.5}
            for b, m in ((64, 0.9), (256, 0.85), (1024, 0.7))]
    sweep_json = tmp_path / "toy.json"
    sweep_json.write_text(json.dumps(rows))
    path, fig = plot.plot_sweep(sweep_json)
    assert path == tmp_path / "toy.png"
    _png(path)
    lines = _lines(fig.axes[0])
    assert list(lines["legw"][:, 0]) == [64, 256, 1024]
    assert list(lines["legw"][:, 1]) == pytest.approx([90, 85, 70])
    assert list(lines["B0 = 64"][:, 0]) == [64, 64]
    with pytest.raises(ConfigError, match="not the rows"):
        (tmp_path / "bad.json").write_text("{}")
        plot.plot_sweep(tmp_path / "bad.json")


def test_cli_plot(tmp_path, capsys):
    from hpclb import cli

    run = _fake_run(tmp_path, "a", 128, trust=True)
    assert cli.main(["plot", "runs", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "plot.png")
    _png(run / "plot.png")
    out = tmp_path / "sched.png"
    assert cli.main(["plot", "schedule", "mnist-lstm", "--k", "1", "2", "--schemes", "legw",
                     "--out", str(out)]) == 0
    _png(out)
    assert cli.main(["plot", "sweep", str(tmp_path / "none.json")]) == 2
    assert "no such sweep file" in capsys.readouterr().err
