import math

import pytest
import torch

from hpclb import schedules as S
from hpclb.optim.lr_scheduler import ScheduleLR

N, B0 = 60_000, 128


def legw(k, w0=0.25, epochs=40, decay="multistep", params=None):
    return S.Schedule.from_recipe(base_lr=0.1, base_batch_size=B0, base_warmup_epochs=w0,
                                  global_batch_size=B0 * k, num_samples=N, epochs=epochs,
                                  scheme="legw", decay=decay,
                                  decay_params=params or {"milestones": [20, 30], "gamma": 0.1})


@pytest.mark.parametrize("k", [1, 2, 8, 64])
def test_legw_warmup_iterations_constant_and_peak_sqrt_k(k):
    s = legw(k)
    assert s.warmup_steps == round(0.25 * N / B0) == 117
    # in samples, warmup lasts W0 * k epochs (to within one step)
    assert abs(s.warmup_steps * B0 * k / N - 0.25 * k) <= B0 * k / N
    assert max(s.lr(i) for i in range(s.total_steps)) == pytest.approx(0.1 * math.sqrt(k))
    # the ramp reaches the peak at step warmup_steps, where the decay takes over
    assert s.lr(s.warmup_steps) == pytest.approx(s.peak_lr)
    assert s.lr(s.warmup_steps - 1) == pytest.approx(s.peak_lr * (1 - 1 / s.warmup_steps))


@pytest.mark.parametrize("k", [1, 2, 8, 64])
def test_legw_ramp_is_linear_from_zero(k):
    s = legw(k)
    lrs = [s.lr(i) for i in range(s.warmup_steps + 1)]
    assert lrs[0] == 0.0  # the reference code's t / T_w: the first update's LR is 0
    assert lrs[1] == pytest.approx(s.peak_lr / s.warmup_steps)
    diffs = {round(b - a, 12) for a, b in zip(lrs, lrs[1:])}
    assert len(diffs) == 1 and diffs.pop() > 0


@pytest.mark.parametrize("k", [1, 2, 8, 64])
def test_decay_boundaries_at_same_epochs(k):
    s = legw(k, w0=0.05)
    spe = s.steps_per_epoch
    assert spe == math.ceil(N / (B0 * k))
    drops = [i for i in range(1, s.total_steps) if s.lr(i) < s.lr(i - 1) * 0.5]
    assert [d / spe for d in drops] == [20.0, 30.0]
    assert s.lr(20 * spe) == pytest.approx(0.1 * math.sqrt(k) * 0.1)


def test_step_decay_boundary_inside_a_long_warmup_stays_put():
    s = legw(64, w0=0.25, epochs=40, params={"milestones": [5], "gamma": 0.1})
    spe = s.steps_per_epoch
    assert s.warmup_steps > 5 * spe
    assert s.lr(5 * spe) / s.lr(5 * spe - 1) == pytest.approx(0.1 * (5 * spe) / (5 * spe - 1))


def test_legw_warmup_epochs_scale_by_k_but_fixed_do_not():
    def sched(k, scheme):
        return S.Schedule.from_recipe(base_lr=1.0, base_batch_size=B0, base_warmup_epochs=0.5,
                                      global_batch_size=B0 * k, num_samples=N, epochs=40,
                                      scheme=scheme)
    for k in (2, 8):
        assert sched(k, "legw").warmup_steps == sched(1, "legw").warmup_steps
        assert sched(k, "sqrt").warmup_steps == round(0.5 * N / (B0 * k))
        assert sched(k, "linear").peak_lr == pytest.approx(k)
        assert sched(k, "sqrt").peak_lr == pytest.approx(math.sqrt(k))
        assert sched(k, "none").peak_lr == pytest.approx(1.0)


def test_goyal_ramps_from_eta0_to_k_eta0_over_five_epochs():
    """Goyal et al.'s gradual warmup: eta0 at step 0, k*eta0 after 5 epochs, whatever W0."""
    for k in (2, 8, 64):
        s = S.Schedule.from_recipe(base_lr=0.1, base_batch_size=B0, base_warmup_epochs=0.25,
                                   global_batch_size=B0 * k, num_samples=N, epochs=20,
                                   scheme="goyal")
        assert s.warmup_steps == round(5 * N / (B0 * k))
        assert s.lr(0) == pytest.approx(0.1) and s.lr(s.warmup_steps) == pytest.approx(0.1 * k)
        half = s.warmup_steps // 2
        assert s.lr(half) == pytest.approx(0.1 + (0.1 * k - 0.1) * half / s.warmup_steps)
        assert s.peak_lr == pytest.approx(0.1 * k) and s.warmup_start_lr == 0.1


def test_a_warmup_that_rounds_to_zero_steps_is_warned_about():
    """A fixed 0.02-epoch warmup at a batch where it is under half a step: no silent 0."""
    with pytest.warns(S.WarmupRoundedToZero, match="rounds to 0.*--scaling legw"):
        s = S.Schedule.from_recipe(base_lr=0.1, base_batch_size=B0, base_warmup_epochs=0.002,
                                   global_batch_size=B0 * 64, num_samples=N, epochs=20,
                                   scheme="sqrt")
    assert s.warmup_steps == 0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # LEGW keeps its steps: no warning
        S.Schedule.from_recipe(base_lr=0.1, base_batch_size=B0, base_warmup_epochs=0.002,
                               global_batch_size=B0 * 64, num_samples=N, epochs=20,
                               scheme="legw")


def test_wrong_k_squared_warmup_is_not_what_legw_does():
    s = legw(8)
    k2_steps = s.warmup_steps * 8  # the pitfall: warmup *steps* x k
    assert s.warmup_steps != k2_steps
    assert s.warmup_steps * B0 * 8 / N == pytest.approx(0.25 * 8, rel=0.01)


def test_warmup_longer_than_training_names_both_numbers():
    with pytest.raises(ValueError, match=r"warmup \(469 steps.*training \(235 steps"):
        S.Schedule.from_recipe(base_lr=0.1, base_batch_size=B0, base_warmup_epochs=1.0,
                               global_batch_size=B0, num_samples=N, epochs=0.5)


@pytest.mark.parametrize("bad", [dict(base_lr=-0.1), dict(base_lr=0.0), dict(epochs=0)])
def test_bad_values_raise(bad):
    kw = dict(base_lr=0.1, base_batch_size=B0, base_warmup_epochs=0.1, global_batch_size=B0,
              num_samples=N, epochs=1)
    kw.update(bad)
    with pytest.raises(ValueError):
        S.Schedule.from_recipe(**kw)


def test_legw_requires_nonzero_base_warmup():
    with pytest.raises(ValueError, match="non-zero base warmup"):
        S.scale_warmup_epochs(0.0, 128, 1024, "legw")


def test_decays():
    spe, peak = 100, 1.0
    kw = dict(steps_per_epoch=spe, warmup_steps=0, total_steps=1000, peak_lr=peak)
    assert S.decay_factor(500, decay="poly", params={"power": 2}, **kw) == pytest.approx(0.25)
    assert S.decay_factor(1000, decay="poly", params={"power": 2, "end_lr": 0.1}, **kw) == \
        pytest.approx(0.1)
    assert S.decay_factor(500, decay="cosine", params={}, **kw) == pytest.approx(0.5)
    # Zaremba: epochs 0..3 full, epoch 4 halved, epoch 5 quartered
    ex = {"gamma": 0.5, "start_epoch": 4}
    assert [S.decay_factor(e * spe, decay="exponential", params=ex, **kw) for e in range(6)] == \
        [1, 1, 1, 1, 0.5, 0.25]
    assert S.decay_factor(350, decay="constant", params={}, **kw) == 1.0
    with pytest.raises(ValueError, match="needs parameter 'gamma'"):
        S.validate_decay("multistep", {"milestones": [1]})
    with pytest.raises(ValueError, match="no parameter 'power'"):
        S.validate_decay("cosine", {"power": 2})


def test_torch_scheduler_adapter_follows_schedule():
    s = legw(8)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=123.0)
    sch = ScheduleLR(opt, s)
    seen = []
    for _ in range(200):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    assert seen == pytest.approx([s.lr(i) for i in range(200)])


def test_schedule_lr_load_state_dict_restores_the_step_lr():
    s = legw(8)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sch = ScheduleLR(opt, s)
    for _ in range(150):
        opt.step()
        sch.step()
    state = sch.state_dict()
    assert state == {"last_epoch": 150}
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch2 = ScheduleLR(opt2, s)
    assert sch2.get_last_lr() == pytest.approx([s.lr(0)])
    sch2.load_state_dict(state)
    assert s.lr(150) != pytest.approx(s.lr(0))
    assert sch2.get_last_lr() == pytest.approx([s.lr(150)]) == sch.get_last_lr()
    assert opt2.param_groups[0]["lr"] == pytest.approx(s.lr(150))
    opt2.step()
    sch2.step()  # continues from the restored step
    assert sch2.get_last_lr() == pytest.approx([s.lr(151)])
    with pytest.raises(ValueError, match="last_epoch"):
        sch2.load_state_dict({"last_epoch": -3})


def test_schedule_lr_steps_set_the_schedules_lr_times_lr_scale_as_torch_would():
    """ScheduleLR.step sets each group's LR itself after the first update: the same values as
    torch's get_lr path (schedule.lr(step) * lr_scale), tensor LRs filled in place,
    get_last_lr() and last_epoch kept, and torch's order warning still given."""
    import warnings

    s = S.Schedule(peak_lr=0.4, warmup_steps=3, total_steps=10, steps_per_epoch=5,
                   decay="poly", decay_params={"power": 2.0})
    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr_scale": 0.5,
                                             "lr": torch.tensor(0.0)}], lr=0.0)
    sch = ScheduleLR(opt, s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sch.step()  # before any optimizer.step(): torch's warning
    assert any("optimizer.step()" in str(c.message) for c in caught)
    for step in range(2, 9):
        opt.step()
        sch.step()
        assert sch.last_epoch == step
        assert opt.param_groups[0]["lr"] == s.lr(step)
        assert float(opt.param_groups[1]["lr"]) == pytest.approx(0.5 * s.lr(step), rel=1e-6)
        assert sch.get_last_lr()[0] == s.lr(step) and sch.get_lr()[0] == s.lr(step)
    assert torch.is_tensor(opt.param_groups[1]["lr"])
