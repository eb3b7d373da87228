"""LARS / LAMB / trust ratios against a float64 NumPy reference of the formulas (You et al.
2017 and 2020), and the settings, dtypes and non-finite handling of issue #12."""
import io

import numpy as np
import pytest
import torch

from hpclb.optim import LAMB, LARS, lamb_trust_ratios, lars_trust_ratios, layer_norms

SHAPES = [(3, 5), (1,), (7,), (64, 33), (2, 3, 4), (1000,), (11, 1)]


def make_params(seed, shapes=SHAPES, scale=1.0, zero=()):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * scale) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    for i in zero:
        ps[i].data.zero_()
    return ps


def ref_lars_ratio(w, g, eta, wd, eps, adapt):
    wn, gn = np.linalg.norm(w), np.linalg.norm(g)
    if not adapt or wn == 0 or gn == 0:
        return 1.0
    return eta * wn / (gn + wd * wn + eps)


class RefLARS:
    """float64 NumPy LARS, LR inside the momentum buffer (TF/MLPerf style)."""

    def __init__(self, ws, lr, momentum, wd, eta, eps):
        self.ws = [w.astype(np.float64) for w in ws]
        self.v = [np.zeros_like(w) for w in self.ws]
        self.lr, self.m, self.wd, self.eta, self.eps = lr, momentum, wd, eta, eps

    def step(self, gs):
        for i, (w, g) in enumerate(zip(self.ws, gs)):
            adapt = w.ndim >= 2
            wd = self.wd if adapt else 0.0
            r = ref_lars_ratio(w, g, self.eta, wd, self.eps, adapt)
            self.v[i] = self.m * self.v[i] + self.lr * r * (g + wd * w)
            self.ws[i] = w - self.v[i]


class RefLAMB:
    def __init__(self, ws, lr, b1, b2, eps, wd):
        self.ws = [w.astype(np.float64) for w in ws]
        self.m = [np.zeros_like(w) for w in self.ws]
        self.v = [np.zeros_like(w) for w in self.ws]
        self.t, self.lr, self.b1, self.b2, self.eps, self.wd = 0, lr, b1, b2, eps, wd

    def step(self, gs):
        self.t += 1
        for i, (w, g) in enumerate(zip(self.ws, gs)):
            adapt = w.ndim >= 2
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            mh, vh = self.m[i] / (1 - self.b1 ** self.t), self.v[i] / (1 - self.b2 ** self.t)
            u = mh / (np.sqrt(vh) + self.eps) + (self.wd if adapt else 0.0) * w
            wn, un = np.linalg.norm(w), np.linalg.norm(u)
            r = wn / un if adapt and wn > 0 and un > 0 else 1.0
            self.ws[i] = w - self.lr * r * u


@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e15])
def test_layer_norms_fp32_accumulation(scale):
    ts = [torch.randn(s, dtype=torch.float32) * scale for s in [(1,), (5, 7), (100_000,), (0,)]]
    got = layer_norms(ts).numpy()
    want = [np.linalg.norm(t.double().numpy()) for t in ts]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert layer_norms(ts).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norms_low_precision_inputs(dtype):
    t = (torch.rand(50_000) * 100).to(dtype)  # sum of squares far beyond fp16's range
    got = layer_norms([t]).item()
    want = np.linalg.norm(t.double().numpy())
    assert np.isfinite(got) and got == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lars_ratios_match_reference(seed):
    ps = make_params(seed, zero=(2,))
    ps[4].grad.zero_()
    adapt = [p.ndim >= 2 for p in ps]
    ratios, wn, gn = lars_trust_ratios([p.detach() for p in ps], [p.grad for p in ps], trust_coefficient=0.001,
                                       weight_decay=1e-4, eps=1e-9, adapt=adapt)
    want = [ref_lars_ratio(p.detach().double().numpy(), p.grad.double().numpy(), 0.001, 1e-4,
                           1e-9, a) for p, a in zip(ps, adapt)]
    np.testing.assert_allclose(ratios.numpy(), want, rtol=1e-5)
    assert ratios[2] == 1.0 and ratios[4] == 1.0  # zero weight, zero gradient


def test_lamb_ratio_zero_rule_and_exclusion():
    w = [torch.ones(3, 3), torch.zeros(4, 4), torch.ones(3, 3), torch.ones(5)]
    u = [torch.full((3, 3), 2.0), torch.ones(4, 4), torch.zeros(3, 3), torch.ones(5)]
    ratios, _, _ = lamb_trust_ratios(w, u, adapt=[True, True, True, False])
    assert ratios.tolist() == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_trust_ratio_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 weights, 1 grads"):
        lars_trust_ratios([torch.ones(2), torch.ones(2)], [torch.ones(2)], trust_coefficient=1,
                          weight_decay=0, eps=0, adapt=[True, True])


def assert_steps_match_reference(ps, opt, ref, seed, steps=4):
    """Feed ``opt`` and its float64 ``ref`` the same random gradients; compare the weights."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in ps]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
        ref.step([gr.double().numpy() for gr in grads])
    for p, w in zip(ps, ref.ws):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)


MIXED_SIZES = [SHAPES, [(1,)] * 300 + [(4, 4)], [(2_000_000,), (3, 3)]]


@pytest.mark.parametrize("shapes", MIXED_SIZES)
def test_lars_steps_match_float64_reference(shapes):
    ps = make_params(3, shapes)
    ref = RefLARS([p.detach().numpy() for p in ps], lr=2.0, momentum=0.9, wd=1e-4, eta=0.01,
                  eps=1e-9)
    opt = LARS(ps, lr=2.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.01)
    assert_steps_match_reference(ps, opt, ref, seed=7)


@pytest.mark.parametrize("shapes", MIXED_SIZES)
def test_lamb_steps_match_float64_reference(shapes):
    ps = make_params(4, shapes)
    ref = RefLAMB([p.detach().numpy() for p in ps], lr=0.01, b1=0.9, b2=0.999, eps=1e-6, wd=0.01)
    opt = LAMB(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    assert_steps_match_reference(ps, opt, ref, seed=8)


def test_exclusion_can_be_overridden_per_group():
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    opt = LARS([{"params": [w], "exclude": True}, {"params": [b], "exclude": False}], lr=1.0)
    assert not opt.is_adapted(w, opt.param_groups[0])
    assert opt.is_adapted(b, opt.param_groups[1])


def test_exclusion_is_logged_once_with_names(caplog):
    model = torch.nn.Linear(3, 2)
    with caplog.at_level("INFO"):
        LAMB(model.named_parameters(), lr=0.1)
    msgs = [r.getMessage() for r in caplog.records if "excluded" in r.getMessage()]
    assert len(msgs) == 1 and "bias[2]" in msgs[0] and "1 parameter tensors adapted" in msgs[0]


@pytest.mark.parametrize("cls,kw,name", [
    (LARS, dict(lr=-0.1), "learning rate"), (LARS, dict(lr=1, momentum=1.0), "momentum"),
    (LARS, dict(lr=1, weight_decay=-1), "weight_decay"),
    (LARS, dict(lr=1, trust_coefficient=0), "trust_coefficient"),
    (LAMB, dict(lr=-1), "learning rate"), (LAMB, dict(betas=(1.0, 0.9)), "beta1"),
    (LAMB, dict(betas=(0.9, -0.1)), "beta2"), (LAMB, dict(eps=-1), "eps")])
def test_invalid_hyperparameters_name_the_value(cls, kw, name):
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        cls([torch.nn.Parameter(torch.ones(2, 2))], **kw)


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=0.5)), (LAMB, dict(lr=0.01))])
def test_state_dict_round_trip_continues_identically(cls, kw):
    def run(steps, opt, ps, g):
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    ps_a = make_params(5)
    opt_a = cls(ps_a, **kw)
    g_a = torch.Generator().manual_seed(1)
    run(3, opt_a, ps_a, g_a)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)  # through bytes, as a checkpoint does
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    ps_b = [torch.nn.Parameter(p.detach().clone()) for p in ps_a]
    opt_b = cls(ps_b, **kw)
    opt_b.load_state_dict(saved)
    g_b = torch.Generator().manual_seed(99)
    g_b.set_state(g_a.get_state())
    run(3, opt_a, ps_a, g_a)
    run(3, opt_b, ps_b, g_b)
    for a, b in zip(ps_a, ps_b):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# settings, sparse gradients, float64, trust-ratio clamp, non-finite layers (issue #12)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0)), (LAMB, dict(lr=0.01))])
@pytest.mark.parametrize("eps", [0.0, -1e-8, 1e-50, float("nan")])
def test_eps_must_be_positive_in_float32(cls, kw, eps):
    with pytest.raises(ValueError, match=r"Invalid eps.*typical: 1e-"):
        cls([torch.nn.Parameter(torch.ones(2, 2))], eps=eps, **kw)
    with pytest.raises(ValueError, match="Invalid eps"):   # a group's own eps is checked too
        cls([{"params": [torch.nn.Parameter(torch.ones(2, 2))], "eps": eps}], **kw)


def test_lamb_zero_gradient_entries_stay_finite():
    """Issue #12 item 2: unused parameters get zero gradients; no 0/0 anywhere."""
    ps = make_params(11, [(4, 4), (4,), (3, 3)])
    opt = LAMB(ps, lr=0.01, eps=1e-6, weight_decay=0.0)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape)
        ps[0].grad[1] = 0.0          # zero entries
        ps[2].grad.zero_()           # an unused parameter
        opt.step()
        assert all(torch.isfinite(p).all() for p in ps)
        assert int(opt.nonfinite_layers) == 0
    assert opt.trust_ratios.tolist()[1] == 1.0   # u = 0 (no weight decay): ratio 1, not 0/0


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0)), (LAMB, dict(lr=0.01))])
def test_sparse_gradient_is_refused_naming_the_parameter(cls, kw):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    opt = cls(model.named_parameters(), **kw)
    model(torch.tensor([[1, 2]])).sum().backward()
    want = (f"{cls.__name__} does not support sparse gradients (parameter 0.weight); use dense "
            "embeddings (nn.Embedding(sparse=False))")
    with pytest.raises(RuntimeError) as e:
        opt.step()
    assert str(e.value) == want


def test_layer_norms_float64_accumulate_in_float64():
    t = torch.full((100_000,), 1.0, dtype=torch.float64) + torch.arange(100_000) * 1e-9
    want = np.sqrt(np.sum(t.numpy() ** 2))
    got = layer_norms([t, torch.ones(3, dtype=torch.float32)])
    assert got.dtype == torch.float64
    assert got[0].item() == pytest.approx(want, rel=1e-14)     # fp32 accumulation: ~1e-7
    assert got[1].item() == pytest.approx(np.sqrt(3), rel=1e-7)
    assert layer_norms([torch.ones(3, dtype=torch.float32)]).dtype == torch.float32


def make_params64(seed, shapes=SHAPES):
    ps = make_params(seed, shapes)
    return [torch.nn.Parameter(p.detach().double()) for p in ps]


@pytest.mark.parametrize("cls", ["lars", "lamb"])
def test_float64_parameters_match_the_float64_reference_tightly(cls):
    ps = make_params64(12)
    if cls == "lars":
        ref = RefLARS([p.detach().numpy() for p in ps], lr=2.0, momentum=0.9, wd=1e-4,
                      eta=0.01, eps=1e-9)
        opt = LARS(ps, lr=2.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.01)
    else:
        ref = RefLAMB([p.detach().numpy() for p in ps], lr=0.01, b1=0.9, b2=0.999, eps=1e-6,
                      wd=0.01)
        opt = LAMB(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ps]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
        ref.step([gr.numpy() for gr in grads])
    for p, w in zip(ps, ref.ws):
        assert p.dtype == torch.float64
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-14)
    assert opt.trust_ratios.dtype == torch.float32 and opt.path == "torch"


@pytest.mark.parametrize("clamp", [(-0.1, 1.0), (0.5, 0.5), (2.0, 1.0), (0.1,), "ab",
                                   (float("nan"), 1.0)])
@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0)), (LAMB, dict(lr=0.01))])
def test_trust_clamp_is_validated(cls, kw, clamp):
    with pytest.raises(ValueError, match=r"Invalid trust_clamp.*0 <= min < max"):
        cls([torch.nn.Parameter(torch.ones(2, 2))], trust_clamp=clamp, **kw)


def test_trust_clamp_in_the_ratio_functions():
    ps = make_params(13, zero=(2,))
    adapt = [p.ndim >= 2 for p in ps]
    ws, gs = [p.detach() for p in ps], [p.grad for p in ps]
    kw = dict(trust_coefficient=0.001, weight_decay=1e-4, eps=1e-9, adapt=adapt)
    free, _, _ = lars_trust_ratios(ws, gs, **kw)
    lo, hi = np.quantile(free[free != 1].numpy(), [0.3, 0.7])
    got, _, _ = lars_trust_ratios(ws, gs, trust_clamp=(float(lo), float(hi)), **kw)
    want = np.where([a and p.abs().sum() > 0 for a, p in zip(adapt, ws)],
                    np.clip(free.numpy(), np.float32(lo), np.float32(hi)), 1.0)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))
    assert (got != free).any() and got[2] == 1.0 and got[1] == 1.0   # zero w, excluded: 1
    per_layer = [None] * len(ws)
    per_layer[0] = (0.0, float(free[0]) / 2)
    got, _, _ = lars_trust_ratios(ws, gs, trust_clamp=per_layer, **kw)
    assert got[0] == np.float32(float(free[0]) / 2) and torch.equal(got[1:], free[1:])
    u = [torch.full((3, 3), 2.0), torch.ones(2, 2)]
    r, _, _ = lamb_trust_ratios([torch.ones(3, 3), torch.ones(2, 2)], u, adapt=[True, True],
                                trust_clamp=(0.6, 0.9))
    assert r.tolist() == pytest.approx([0.6, 0.9])


def test_trust_clamp_in_the_optimizers_matches_the_reference():
    class Clamped(RefLARS):
        def step(self, gs):
            global ref_lars_ratio
            plain = ref_lars_ratio
            ref_lars_ratio = (lambda *a: (lambda r: r if r == 1.0 and not a[-1] else
                                          min(max(r, 0.02), 0.05))(plain(*a)))
            try:
                super().step(gs)
            finally:
                ref_lars_ratio = plain
    ps = make_params(14, [(30, 20), (20,), (10, 40)])
    ref = Clamped([p.detach().numpy() for p in ps], lr=1.0, momentum=0.9, wd=1e-4, eta=0.01,
                  eps=1e-9)
    opt = LARS(ps, lr=1.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.01,
               trust_clamp=(0.02, 0.05))
    assert_steps_match_reference(ps, opt, ref, seed=15)
    assert ((opt.trust_ratios >= 0.02) & (opt.trust_ratios <= 0.05)).all()


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0, trust_clamp=(0.0, 5.0))),
                                    (LAMB, dict(lr=0.01))])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_layer_is_left_untouched_and_counted(cls, kw, bad):
    shapes = [(6, 5), (5,), (8, 4), (9, 3)]
    runs = {}
    for case in ("bad", "absent"):
        ps = make_params(16, shapes)
        opt = cls(ps, **kw)
        g = torch.Generator().manual_seed(17)
        for step in range(3):
            grads = [torch.randn(p.shape, generator=g) for p in ps]
            if step == 2:
                before = (ps[2].detach().clone(), {k: v.clone() for k, v in
                                                   opt.state[ps[2]].items() if torch.is_tensor(v)})
                grads[2][1, 1] = bad
            for p, gr in zip(ps, grads):
                p.grad = gr
            if step == 2 and case == "absent":
                ps[2].grad = None
            opt.step()
        runs[case] = (ps, opt, before)
    ps, opt, (w_before, state_before) = runs["bad"]
    assert torch.equal(ps[2].detach(), w_before)
    for k, v in state_before.items():
        assert torch.equal(opt.state[ps[2]][k], v), k
    for i in (0, 1, 3):   # the other layers step as if the bad one had no gradient
        assert torch.equal(ps[i].detach(), runs["absent"][0][i].detach())
    assert opt.nonfinite_layers.dtype == torch.int32 and opt.nonfinite_layers.shape == ()
    assert int(opt.nonfinite_layers) == 1 and int(runs["absent"][1].nonfinite_layers) == 0
    assert opt.trust_ratios.shape == (3,) and opt.trust_ratios.dtype == torch.float32


def test_step_outputs_and_path_logged_once(caplog):
    ps = make_params(18, [(6, 5), (5,), (8, 4)])
    opt = LARS(ps, lr=1.0)
    with caplog.at_level("INFO", logger="hpclb.optim.base"):
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape)
            ratios, _, _ = lars_trust_ratios([p.detach() for p in ps], [p.grad for p in ps],
                                             trust_coefficient=0.001, weight_decay=1e-4,
                                             eps=1e-9, adapt=[True, False, True])
            opt.step()
            assert torch.equal(opt.trust_ratios, ratios[[0, 2]])
    msgs = [r.getMessage() for r in caplog.records if "path" in r.getMessage()]
    assert msgs == ["LARS: torch path on cpu (torch._foreach ops)"] and opt.path == "torch"


def _grads_for(ps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in ps]


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=1.0, momentum=0.9, weight_decay=1e-4)),
                                    (LAMB, dict(lr=0.01))])
def test_found_inf_masks_the_whole_step_on_the_device(cls, kw):
    """torch's _step_supports_amp_scaling contract: found_inf > 0 leaves every layer and its
    state untouched, found_inf 0 steps exactly as without it; no host read either way."""
    from hpclb.train.hostreads import HostReadCounter

    shapes = [(6, 5), (5,), (8, 4)]
    plain, masked = make_params(30, shapes), make_params(30, shapes)
    opts = cls(plain, **kw), cls(masked, **kw)
    assert cls._step_supports_amp_scaling
    for step in range(4):
        for ps in (plain, masked):
            for p, gr in zip(ps, _grads_for(ps, 31 + step)):
                p.grad = gr
        opts[0].step()
        skip = step == 2
        before = [p.detach().clone() for p in masked]
        state = [{k: v.clone() for k, v in opts[1].state[p].items() if torch.is_tensor(v)}
                 for p in masked]
        opts[1].found_inf, opts[1].grad_scale = torch.tensor(float(skip)), None
        with HostReadCounter() as reads:
            opts[1].step()
        del opts[1].found_inf, opts[1].grad_scale
        assert len(reads) == 0, reads.reads
        if skip:
            assert all(torch.equal(a, p) for a, p in zip(before, masked))
            assert all(torch.equal(v, opts[1].state[p][k]) for p, s in zip(masked, state)
                       for k, v in s.items())
            for p, q in zip(masked, plain):   # re-sync the reference with the skipped one
                q.data.copy_(p.data)
                opts[0].state[q] = {k: (v.clone() if torch.is_tensor(v) else v)
                                    for k, v in opts[1].state[p].items()}
        else:
            assert all(torch.equal(p, q) for p, q in zip(masked, plain)), step


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_grad_scaler_steps_without_a_host_read(cls):
    """GradScaler.step on LARS/LAMB hands found_inf to the optimizer (no .item()): an overflow
    skips the step, a finite one steps as the unscaled gradients say."""
    from hpclb.train.hostreads import HostReadCounter

    model = torch.nn.Linear(4, 3)
    opt = cls(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    for bad in (True, False):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean() * (float("inf") if bad else 1.0)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with HostReadCounter() as reads:
            scaler.step(opt)
            scaler.update()
        assert len(reads) == 0, reads.reads
        changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
        assert changed == [not bad] * 2, (bad, changed)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lamb_tensor_step_counts_update_each_layer_once():
    """A state whose ``step`` values are 0-d tensors (torch Adam's format) steps exactly like
    the same state with int steps (it used to apply the update once per parameter)."""
    shapes = [(6, 5), (5,), (8, 4)]
    a, b = make_params(40, shapes), make_params(40, shapes)
    opt_a, opt_b = LAMB(a, lr=0.01), LAMB(b, lr=0.01)
    for p, q in zip(a, b):
        p.grad, q.grad = _grads_for([p], 41)[0], _grads_for([q], 41)[0]
    opt_a.step()
    opt_b.step()
    for q in b:
        opt_b.state[q]["step"] = torch.tensor(float(opt_b.state[q]["step"]))
    for step in range(2):
        for p, q in zip(a, b):
            p.grad, q.grad = _grads_for([p], 42 + step)[0], _grads_for([q], 42 + step)[0]
        opt_a.step()
        opt_b.step()
        assert all(torch.equal(p, q) for p, q in zip(a, b)), step
    assert all(opt_b.state[q]["step"] == 3 for q in b)
