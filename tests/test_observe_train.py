"""A real training run's observability output read back (issue #13, "a 2-rank `make train`
writes per-step lines and TensorBoard files, their scalars read back in a test"): at 1 process
and under mpirun, the quick MNIST-LSTM recipe with LARS, ``log_every`` 4 and, at world size > 1,
the gradient noise scale; rank 0 checks metrics.jsonl's step and epoch lines and the TensorBoard
scalars, every rank shares the verdict."""
import json
import math
from pathlib import Path

import pytest
from conftest import all_ranks_ok
from helpers import preempt_at, quick_recipe

from hpclb.config import resolve
from hpclb.schedules import Schedule
from hpclb.train import loop as train_mod
from hpclb.train.metrics import read_metrics, tensorboard_tag

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(240)]

LOG_EVERY, STEPS = 4, 32  # quick recipe: 4,096 images at B0 = 128, one epoch


def expected_lr(step: int) -> float:
    """The LR the update at global step ``step`` (1-based, as in the step lines) used: the
    quick recipe's LARS schedule written out (peak 1.0 at B0 = 128, warmup 0.25 epochs = 8
    steps, poly(2) decay to 0 over 32 steps), independent of the run's own Schedule object."""
    sched = Schedule.from_recipe(base_lr=1.0, base_batch_size=128, base_warmup_epochs=0.25,
                                 global_batch_size=128, num_samples=4096, epochs=1,
                                 scheme="legw", decay="poly",
                                 decay_params={"power": 2.0, "end_lr": 0.0})
    assert (sched.warmup_steps, sched.total_steps) == (8, STEPS)
    return sched.lr(step - 1)


def check_step_lines(steps: list[dict], world_size: int) -> list[str]:
    bad = []
    if [s["step"] for s in steps] != list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)):
        bad.append(f"step lines at {[s['step'] for s in steps]}, expected every {LOG_EVERY}")
    for s in steps:
        if not (math.isfinite(s["loss"]) and 0 < s["loss"] < 5):
            bad.append(f"step {s['step']}: loss {s['loss']}")
        if s["lr"] != pytest.approx(expected_lr(s["step"]), rel=1e-12):
            bad.append(f"step {s['step']}: lr {s['lr']} != schedule {expected_lr(s['step'])}")
        if not 0 < s["trust_min"] <= s["trust_median"] <= s["trust_max"]:
            bad.append(f"step {s['step']}: trust ratios {s['trust_min']}, "
                       f"{s['trust_median']}, {s['trust_max']}")
        if not (s["grad_norm"] > 0 and s["step_time_s"] > 0 and s["samples_per_s"] > 0):
            bad.append(f"step {s['step']}: grad_norm/step_time_s/samples_per_s {s}")
        split = s["compute_s"] + s["comm_wait_s"]
        if not (0 <= s["comm_wait_s"] < s["step_time_s"] and
                split == pytest.approx(s["step_time_s"], rel=1e-9)):
            bad.append(f"step {s['step']}: step time {s['step_time_s']} not split into compute "
                       f"{s['compute_s']} + exposed communication {s['comm_wait_s']}")
    return bad


def check_tensorboard(run_dir, steps: list[dict]) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags, bad = set(acc.Tags()["scalars"]), []
    for key in ("loss", "lr", "grad_norm", "trust_min", "trust_median", "trust_max",
                "step_time_s", "samples_per_s"):
        tag = tensorboard_tag(key)
        if tag not in tags:
            bad.append(f"no TensorBoard scalar {tag} (have {sorted(tags)})")
            continue
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        want = [(s["step"], s[key]) for s in steps]
        if [g[0] for g in got] != [w[0] for w in want] or \
                any(g[1] != pytest.approx(w[1], rel=1e-6) for g, w in zip(got, want)):
            bad.append(f"{tag}: TensorBoard {got} != metrics.jsonl {want}")
    return bad


def check_epoch_lines(epochs: list[dict], world_size: int) -> list[str]:
    if len(epochs) != 1 or epochs[0]["step"] != STEPS:
        return [f"epoch lines {epochs}"]
    noise = epochs[0].get("noise")
    if world_size == 1:
        return [] if noise is None else [f"noise field {noise} with one rank"]
    b = (noise or {}).get("b_simple")
    if not (isinstance(b, float) and math.isfinite(b) and b > 0 and noise["n"] > 0):
        return [f"epoch noise field {noise}: no finite B_simple"]
    return []


def test_run_writes_step_lines_tensorboard_and_noise_scale(tmp_path, mnist_dir, comm):
    pytest.importorskip("tensorboard")
    out = comm.broadcast_object(str(tmp_path / "run"))  # rank 0's directory on every rank
    w = comm.world_size
    cfg = resolve(quick_recipe(tmp_path, optimizer="lars"), out=out,
                  data_dir=str(mnist_dir.parent), log_every=LOG_EVERY, noise_scale=w > 1)
    summary = train_mod.train(cfg, comm, quiet=True)
    bad = [] if summary["steps"] == STEPS else [f"{summary['steps']} steps, expected {STEPS}"]
    if comm.rank == 0 and not bad:
        try:
            epochs, steps = read_metrics(out)
            bad += check_step_lines(steps, w) + check_epoch_lines(epochs, w)
            bad += check_tensorboard(tmp_path / "run", steps)
        except Exception as e:  # a verdict, not a hang of the other ranks
            bad.append(f"{type(e).__name__}: {e}")
    all_ranks_ok(comm, not bad, "; ".join(bad))


def test_mid_epoch_checkpoints_leave_the_epoch_statistics_alone(tmp_path, mnist_dir, comm):
    """``--checkpoint-interval``: a checkpoint reduces a copy of the epoch's running sums over
    the ranks; the run's epoch and step lines are those of a run without mid-epoch checkpoints
    (before, every checkpoint added the other ranks' sums into the running totals in place)."""
    recipe = quick_recipe(tmp_path, optimizer="lars")
    lines = {}
    for name, interval in (("plain", None), ("checkpointed", 1e-4)):
        out = comm.broadcast_object(str(tmp_path / name))
        cfg = resolve(recipe, out=out, data_dir=str(mnist_dir.parent), log_every=LOG_EVERY)
        train_mod.train(cfg, comm, quiet=True, checkpoint_interval_s=interval)
        lines[name] = read_metrics(out) if comm.rank == 0 else None
    bad = []
    if comm.rank == 0:
        keys = ("train_loss", "train_accuracy", "loss")
        for (ea, sa), (eb, sb) in [(lines["plain"], lines["checkpointed"])]:
            for a, b in zip(ea + sa, eb + sb):
                bad += [f"{k}: {a[k]} vs {b[k]}" for k in keys if k in a and a[k] != b.get(k)]
    all_ranks_ok(comm, not bad, "; ".join(bad[:5]))


#: The fields of metrics.jsonl that measure wall-clock time or memory, not the training: the
#: only ones in which a preempted and resumed run's file differs from an uninterrupted run's
#: (docs/observability.md). In the epoch a run resumed in, the rates are null.
WALL_CLOCK = {"samples_per_s", "tokens_per_s", "epoch_time_s", "elapsed_s", "step_time_s",
              "comm_wait_s", "compute_s", "max_memory_bytes"}


@pytest.mark.parametrize("at", [10, 8])  # mid-epoch, between log points; an epoch's last step
def test_preempted_and_resumed_metrics_equal_the_uninterrupted_ones(tmp_path, mnist_dir, comm,
                                                                    monkeypatch, at):
    """metrics.jsonl after a preemption at global step ``at`` and ``--resume`` equals the
    uninterrupted run's line by line, but for :data:`WALL_CLOCK` (before: the step line after
    the resume averaged the loss from the epoch's start, not from the last log point, and the
    epoch lines' gradient noise scale started its smoothing afresh). 8 steps per epoch, a step
    line every 3, the noise scale at world size > 1."""
    recipe = quick_recipe(tmp_path)
    kw = dict(data_dir=str(mnist_dir.parent), batch_size=512, epochs=2.5, log_every=3,
              noise_scale=comm.world_size > 1)
    outs = {name: comm.broadcast_object(str(tmp_path / name)) for name in ("full", "cut")}
    train_mod.train(resolve(recipe, out=outs["full"], **kw), comm, quiet=True)
    preempt_at(monkeypatch, at)
    with pytest.raises(train_mod.Preempted):
        train_mod.train(resolve(recipe, out=outs["cut"], **kw), comm, quiet=True)
    monkeypatch.undo()
    train_mod.train(resolve(recipe, out=outs["cut"], resume=True, **kw), comm, quiet=True)
    bad = []
    if comm.rank == 0:
        full, cut = ([{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
                      for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
                     for out in (outs["full"], outs["cut"]))
        if len(full) != len(cut):
            bad.append(f"{len(full)} lines vs {len(cut)}")
        bad += [f"{a} vs {b}" for a, b in zip(full, cut) if a != b]
        if comm.world_size > 1 and "noise" not in full[-1]:
            bad.append(f"no noise field in {full[-1]}")
    all_ranks_ok(comm, not bad, "; ".join(bad[:3]))


def test_a_step_line_across_an_epochs_end_averages_all_its_steps(tmp_path, mnist_dir, comm):
    """1,000 images at batch 384: 3 steps an epoch, the last of 232 images. A line every 2
    steps spans the epoch's end at step 4 (steps 3 and 4): its loss is the sample-weighted mean
    of both steps' losses (from a line-every-step run of the same trajectory) and its samples
    per second count 232 + 384 images (before: the loss of step 4 alone, and 2 x 384)."""
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 1000,
                                          "test_samples": 500})
    kw = dict(data_dir=str(mnist_dir.parent), batch_size=384, epochs=2)
    outs = {n: comm.broadcast_object(str(tmp_path / f"every{n}")) for n in (1, 2)}
    for n, out in outs.items():
        train_mod.train(resolve(recipe, out=out, log_every=n, **kw), comm, quiet=True)
    bad = []
    if comm.rank == 0:
        one, two = ({s["step"]: s for s in read_metrics(out)[1]}
                    for out in outs.values())
        size = {1: 384, 2: 384, 3: 232, 4: 384, 5: 384, 6: 232}
        if sorted(one) != list(range(1, 7)) or sorted(two) != [2, 4, 6]:
            bad.append(f"step lines at {sorted(one)} and {sorted(two)}")
        else:
            for s, n in size.items():  # one step per line: samples/s x s/step = its samples
                if one[s]["samples_per_s"] * one[s]["step_time_s"] != pytest.approx(n):
                    bad.append(f"step {s}: {one[s]['samples_per_s']} samples/s x "
                               f"{one[s]['step_time_s']} s != {n} samples")
            for s in (2, 4, 6):
                want = (size[s - 1] * one[s - 1]["loss"] + size[s] * one[s]["loss"]) / \
                    (size[s - 1] + size[s])
                if two[s]["loss"] != pytest.approx(want, rel=1e-6):
                    bad.append(f"line at step {s}: loss {two[s]['loss']}, the mean of steps "
                               f"{s - 1}-{s} is {want}")
                got = two[s]["samples_per_s"] * two[s]["step_time_s"] * 2
                if got != pytest.approx(size[s - 1] + size[s]):
                    bad.append(f"line at step {s}: {got} samples, not {size[s - 1] + size[s]}")
    all_ranks_ok(comm, not bad, "; ".join(bad[:3]))
