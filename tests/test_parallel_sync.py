"""GradientSync on every rank of `mpirun -n N python -m pytest --with-mpi` (and at N = 1).

Bucketed = one flat Allreduce bit for bit; overlapped = blocking; k-step accumulation = one k x
batch step; unused parameters reduced as zeros; uneven shards terminate; a model that differs
across ranks fails fast naming the parameter; the stall watchdog names a sleeping rank; fp16
compression of large gradients does not overflow. Verdicts are shared across ranks
(``all_ranks_ok``) so one failing rank cannot leave the others in a collective.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from conftest import all_ranks_ok
from torch import nn

from hpclb.errors import ModelMismatchError
from hpclb.models import MnistLSTM
from hpclb.sync.agree import agree_num_steps, check_model_consistency
from hpclb.sync.gradients import GradientSync

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120, method="thread")]
MODES = ("none", "thread", "nonblocking")
KiB = 1024


def small_net(hidden: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(28, hidden), nn.Tanh(), nn.Linear(hidden, 3 * hidden),
                         nn.Tanh(), nn.Linear(3 * hidden, 10))


def data(comm, n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + comm.rank)  # different data per rank
    return torch.randn(n, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def local_grads(model: nn.Module, x, y) -> list[torch.Tensor]:
    """Gradients of a copy without any sync attached (the reference each rank contributes)."""
    m = copy.deepcopy(model)
    nn.functional.cross_entropy(m(x), y).backward()
    return [p.grad.clone() for p in m.parameters()]


def flat_mean(comm, grads: list[torch.Tensor]) -> torch.Tensor:
    """Today's reference: one flat fp32 buffer, one Allreduce, divide by world size once."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.allreduce_(flat)
    return flat.div_(comm.world_size)


def synced(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def exact_expected(comm) -> bool:
    """Sums of two addends do not depend on the algorithm's order; beyond two ranks the MPI may
    add in a different order per message size, so random floats are compared to rounding."""
    return comm.world_size <= 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threshold", [4 * KiB, 256 * KiB, 25 * 2 ** 20])
def test_bucketed_equals_one_flat_allreduce(comm, mode, threshold):
    model = small_net()
    x, y = data(comm)
    ref = flat_mean(comm, local_grads(model, x, y))
    sync = GradientSync(model.named_parameters(), comm, overlap=mode,
                        fusion_threshold_bytes=threshold, first_bucket_bytes=2 * KiB)
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        sync.synchronize()
        got = synced(model)
    finally:
        sync.close()
    if exact_expected(comm):
        ok = torch.equal(got, ref)
    else:
        ok = torch.allclose(got, ref, rtol=1e-6, atol=1e-9)
    all_ranks_ok(comm, ok and len(sync.buckets) >= (4 if threshold < 8 * KiB else 2),
                 f"{mode} {threshold} B: max diff {(got - ref).abs().max().item():.3g}, "
                 f"{len(sync.buckets)} buckets")


@pytest.mark.parametrize("mode", MODES)
def test_bucketed_equals_flat_bitwise_at_any_world_size(comm, mode):
    """Integer-valued gradients: every summation order is exact, so bit-for-bit at any N."""
    model = small_net()
    g = torch.Generator().manual_seed(comm.rank)
    coef = [torch.randint(-1000, 1000, p.shape, generator=g).float() for p in model.parameters()]
    ref = flat_mean(comm, coef)
    sync = GradientSync(model.named_parameters(), comm, overlap=mode,
                        fusion_threshold_bytes=8 * KiB, first_bucket_bytes=KiB)
    try:
        for step in range(2):  # the second step reuses the buckets
            model.zero_grad(set_to_none=False)
            sum((p * c).sum() for p, c in zip(model.parameters(), coef)).backward()
            sync.synchronize()
            got = synced(model)
            all_ranks_ok(comm, torch.equal(got, ref), f"{mode} step {step}: "
                         f"max diff {(got - ref).abs().max().item():.3g}")
    finally:
        sync.close()


def test_overlapped_equals_blocking_on_an_lstm(comm):
    results = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = MnistLSTM(hidden_size=32)
        sync = GradientSync(model.named_parameters(), comm, overlap=mode,
                            fusion_threshold_bytes=16 * KiB, first_bucket_bytes=KiB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + comm.rank)
                x, y = torch.randn(8, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
                opt.zero_grad(set_to_none=(step == 1))  # also the path where grads are replaced
                nn.functional.cross_entropy(model(x), y).backward()
                sync.synchronize()
                opt.step()
        finally:
            sync.close()
        results[mode] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = results["none"]
    same = {m: (torch.equal(r, ref) if exact_expected(comm) else
                torch.allclose(r, ref, rtol=1e-5, atol=1e-7)) for m, r in results.items()}
    everyone = comm.allgather_object(ref)
    all_ranks_ok(comm, all(same.values()) and all(torch.equal(everyone[0], e) for e in everyone),
                 f"equal to blocking: {same}")


@pytest.mark.parametrize("mode", MODES)
def test_gradients_written_by_hand_are_averaged_by_mark_all_ready(comm, mode):
    """mark_all_ready() ends a micro-batch whose gradients were written without autograd: they
    are averaged as they are (before: at more than one rank every such gradient was taken for
    an unused parameter and reduced as zeros)."""
    model = small_net()
    sync = GradientSync(model.named_parameters(), comm, overlap=mode,
                        fusion_threshold_bytes=4 * KiB, first_bucket_bytes=KiB)
    try:
        grads = local_grads(model, *data(comm, seed=5))
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(g)  # written in place into the bucket view
        sync.mark_all_ready()
        assert sync.synchronize()
        got, ref = synced(model), flat_mean(comm, grads)
        all_ranks_ok(comm, torch.equal(got, ref) if exact_expected(comm) else
                     torch.allclose(got, ref, rtol=1e-6, atol=1e-8),
                     f"{mode}: max diff {(got - ref).abs().max().item():.3g}")
    finally:
        sync.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", (1, 2))
def test_a_prescaled_loss_gives_the_divided_mean_bit_for_bit(comm, mode, k):
    """The mean at the price of a sum: each micro-batch's loss times ``loss_prescale`` (1/(W*K))
    and no division after the allreduce gives the same gradients, bit for bit, as the division
    when W*K is a power of two (LSTM and linear layers, several steps, grads replaced once);
    to rounding otherwise. Every bucket is left undivided (``divisor`` 1)."""
    grads = {}
    for prescaled in (False, True):
        torch.manual_seed(0)
        model = MnistLSTM(hidden_size=32)
        sync = GradientSync(model.named_parameters(), comm, overlap=mode, accumulation_steps=k,
                            fusion_threshold_bytes=16 * KiB, first_bucket_bytes=KiB,
                            loss_prescaled=prescaled)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        got = []
        try:
            assert sync.divisor == (1 if prescaled else comm.world_size * k)
            for step in range(3):
                opt.zero_grad(set_to_none=(step == 1))
                for part in range(k):
                    g = torch.Generator().manual_seed(100 * step + 10 * part + comm.rank)
                    x = torch.randn(8, 28, 28, generator=g)
                    y = torch.randint(0, 10, (8,), generator=g)
                    loss = nn.functional.cross_entropy(model(x), y)
                    (loss * sync.loss_prescale if prescaled else loss).backward()
                    sync.synchronize()
                got.append(synced(model).clone())
                opt.step()
        finally:
            sync.close()
        grads[prescaled] = torch.stack(got)
    n = comm.world_size * k
    exact = n & (n - 1) == 0
    a, b = grads[False], grads[True]
    ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-8)
    all_ranks_ok(comm, ok, f"W*K={n}: max diff {(a - b).abs().max().item():.3g}")


def test_loss_prescaled_refuses_a_divisor(comm):
    with pytest.raises(ValueError, match="does not take a divisor"):
        GradientSync(small_net().named_parameters(), comm, loss_prescaled=True, divisor=2)


@pytest.mark.parametrize("mode", ("thread", "nonblocking"))
def test_accumulation_over_k_micro_batches_equals_one_k_times_batch(comm, mode):
    k, b = 4, 6
    model = small_net()
    big = copy.deepcopy(model)
    xs, ys = data(comm, n=k * b, seed=3)
    sync_big = GradientSync(big.named_parameters(), comm, overlap=mode)
    nn.functional.cross_entropy(big(xs), ys).backward()  # one step, k x b samples per rank
    sync_big.synchronize()
    sync_big.close()
    sync = GradientSync(model.named_parameters(), comm, overlap=mode, accumulation_steps=k,
                        fusion_threshold_bytes=4 * KiB, first_bucket_bytes=KiB)
    try:
        flags = []
        for epoch in range(2):  # the window restarts at the epoch boundary
            assert sync.reset_epoch() == 0
            model.zero_grad(set_to_none=False)
            for i in range(k):
                sl = slice(i * b, (i + 1) * b)
                nn.functional.cross_entropy(model(xs[sl]), ys[sl]).backward()
                flags.append(sync.synchronize())
        got = synced(model).clone()
        # an unfinished window is dropped by reset_epoch
        nn.functional.cross_entropy(model(xs[:b]), ys[:b]).backward()
        partial = sync.synchronize()
        dropped = sync.reset_epoch()
    finally:
        sync.close()
    ref = synced(big)
    ok = torch.allclose(got, ref, rtol=1e-5, atol=1e-7)
    all_ranks_ok(comm, ok and flags == [False] * (k - 1) + [True] + [False] * (k - 1) + [True]
                 and partial is False and dropped == 1,
                 f"max diff {(got - ref).abs().max().item():.3g}, flags {flags}, "
                 f"dropped {dropped}")


def test_an_empty_share_is_skipped_explicitly_and_counted(comm):
    """hpclb train's loop: K micro-batches (a backward, or skip_micro_batch() where this rank
    has no samples), then one synchronize(): the skip counts in the window, whose K-th ends it
    (divided by world_size * K); loss_weight is the factor that makes it the global mean."""
    k = 2
    model = small_net()
    big = copy.deepcopy(model)
    xs, ys = data(comm, n=6, seed=5)
    sync_big = GradientSync(big.named_parameters(), comm)
    nn.functional.cross_entropy(big(xs), ys).backward()
    sync_big.synchronize()
    sync_big.close()
    sync = GradientSync(model.named_parameters(), comm, accumulation_steps=k)
    try:
        nn.functional.cross_entropy(model(xs), ys).backward()
        sync.skip_micro_batch()  # the second micro-batch: no samples on this rank
        reduced = sync.synchronize()
        weight = sync.loss_weight(6, 6 * comm.world_size * k)
    finally:
        sync.close()
    got, ref = synced(model), synced(big) / k
    ok = reduced is True and torch.allclose(got, ref, rtol=1e-5, atol=1e-7) and weight == 1.0
    all_ranks_ok(comm, ok, f"reduced {reduced}, weight {weight}, max diff "
                           f"{(got - ref).abs().max().item():.3g}")


def test_unused_parameters_are_reduced_as_zeros(comm):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.never = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, use_b: bool):
            return self.b(self.a(x)) if use_b else self.a(x)

    model = Branchy()
    use_b = comm.rank % 2 == 0  # b is used on even ranks only
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(comm.rank))
    ref_model = copy.deepcopy(model)
    ref_model(x, use_b).sum().backward()
    ref = [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
           for p in ref_model.parameters()]
    expected = flat_mean(comm, ref)
    sync = GradientSync(model.named_parameters(), comm, fusion_threshold_bytes=300,
                        first_bucket_bytes=300)
    try:
        for _ in range(2):  # stale gradients from the first step must not leak into the second
            model.zero_grad(set_to_none=False)
            model(x, use_b).sum().backward()
            sync.synchronize()
    finally:
        sync.close()
    got = synced(model)
    never = model.never.weight.grad
    all_ranks_ok(comm, torch.allclose(got, expected, rtol=1e-6, atol=1e-8)
                 and torch.count_nonzero(never) == 0,
                 f"max diff {(got - expected).abs().max().item():.3g}")


@pytest.mark.parametrize("how", ("min", "max"))
def test_uneven_shards_terminate(comm, how):
    model = small_net(16)
    sync = GradientSync(model.named_parameters(), comm)
    my_batches = 3 + 2 * comm.rank  # every rank has a different shard length
    t0 = time.monotonic()
    try:
        steps = agree_num_steps(my_batches, comm, how=how)
        done = 0
        for i in range(steps):
            model.zero_grad(set_to_none=False)
            if i < my_batches:  # out of data ("max"): contribute zeros
                x, y = data(comm, n=4, seed=i)
                nn.functional.cross_entropy(model(x), y).backward()
            sync.synchronize()
            done += 1
    finally:
        sync.close()
    counts = comm.allgather_object(done)
    want = 3 if how == "min" else 3 + 2 * (comm.world_size - 1)
    all_ranks_ok(comm, counts == [want] * comm.world_size and time.monotonic() - t0 < 60,
                 f"steps per rank {counts}, wanted {want}")


@pytest.mark.mpi(min_size=2)
def test_model_that_differs_across_ranks_fails_fast_naming_the_parameter(comm):
    last = comm.world_size - 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                          nn.Linear(8, 6 if comm.rank == last else 5))
    t0 = time.monotonic()
    messages = []
    for check in (lambda: check_model_consistency(model, comm),
                  lambda: GradientSync(model.named_parameters(), comm)):
        try:
            check()
            messages.append("no error")
        except ModelMismatchError as e:
            messages.append(str(e))
    ok = all("2.weight" in m and f"rank {last}" in m for m in messages)
    all_ranks_ok(comm, ok and time.monotonic() - t0 < 30, " | ".join(messages))


@pytest.mark.mpi(min_size=2)
def test_settings_that_differ_across_ranks_fail_fast(comm):
    model = small_net(16)
    threshold = 4 * KiB if comm.rank == comm.world_size - 1 else 8 * KiB
    try:
        GradientSync(model.named_parameters(), comm, fusion_threshold_bytes=threshold).close()
        msg = "no error"
    except ModelMismatchError as e:
        msg = str(e)
    all_ranks_ok(comm, "fusion_threshold_bytes" in msg, msg)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ("thread", "nonblocking"))
def test_stall_watchdog_names_the_sleeping_rank(comm, mode):
    sleeper = comm.world_size - 1
    reports = []
    model = small_net(16)
    sync = GradientSync(model.named_parameters(), comm, overlap=mode, stall_timeout_s=0.5,
                        on_stall=reports.append)
    x, y = data(comm, n=4)
    try:
        comm.barrier()
        if comm.rank == sleeper:
            time.sleep(4.0)  # the others wait in the first bucket's allreduce meanwhile
        nn.functional.cross_entropy(model(x), y).backward()
        sync.synchronize()
    finally:
        sync.close()
    if comm.rank == sleeper:
        ok, detail = True, "slept"
    else:
        first = reports[0] if reports else None
        ok = first is not None and first.missing == [sleeper] and \
            f"rank(s) {sleeper} have not joined" in first.message
        detail = first.message if first else "no report"
    all_ranks_ok(comm, ok, detail)


@pytest.mark.parametrize("compression", ("fp16", "bf16"))
@pytest.mark.parametrize("mode", ("thread", "nonblocking"))
def test_compressed_large_gradients_do_not_overflow(comm, compression, mode):
    """Each rank's gradient is 6e4, near fp16's largest finite value (65504): summing the
    ranks' fp16 shares without pre-division would give inf at 2 or more ranks."""
    model = nn.Linear(64, 64)
    sync = GradientSync(model.named_parameters(), comm, compression=compression, overlap=mode)
    try:
        model.zero_grad(set_to_none=False)
        (model.weight.sum() * 6e4 + model.bias.sum() * (comm.rank + 1) * 1e4).backward()
        sync.synchronize()
    finally:
        sync.close()
    w = model.weight.grad
    mean_bias = 1e4 * (comm.world_size + 1) / 2
    rel = 1e-2 if compression == "bf16" else 2e-3
    ok = bool(torch.isfinite(w).all()) and torch.allclose(w, torch.full_like(w, 6e4), rtol=rel) \
        and torch.allclose(model.bias.grad, torch.full((64,), mean_bias), rtol=rel) \
        and w.dtype == torch.float32
    all_ranks_ok(comm, ok, f"{compression}: weight grad {w.flatten()[:2].tolist()}, bias "
                 f"{model.bias.grad[:2].tolist()} (want {mean_bias})")
