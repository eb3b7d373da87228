"""GradientSync and the stall watchdog in one process: a pretend world (``ScaledComm``: N identical
ranks, a sum multiplies by N in the tensor's own dtype) and a scripted side channel."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hpclb.comm.base import SideChannel
from hpclb.comm.local import SelfCommunicator
from hpclb.comm.testing import ScaledComm
from hpclb.comm.watchdog import StallWatchdog
from hpclb.errors import ModelMismatchError
from hpclb.sync.agree import agree_num_steps
from hpclb.sync.gradients import GradientSync
from hpclb.sync.options import DEFAULT_FUSION_THRESHOLD_BYTES, MiB

pytestmark = pytest.mark.timeout(60, method="thread")
MODES = ("none", "thread", "nonblocking")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 300), nn.ReLU(), nn.Linear(300, 200), nn.ReLU(),
                         nn.Linear(200, 4))


def loss(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(5, 10, generator=g)).pow(2).mean()


def test_buckets_cover_every_gradient_once_within_their_byte_caps():
    model = net()
    sync = GradientSync(model.named_parameters(), ScaledComm(2), fusion_threshold_bytes=100_000,
                        first_bucket_bytes=1_000)
    try:
        assert sync.fusion_threshold_bytes == 100_000
        names = [n for b in sync.buckets for n in b.names]
        assert names == [n for n, _ in reversed(list(model.named_parameters()))]
        sizes = sync.bucket_sizes_bytes
        assert sizes[0] <= 1_000 and len(sizes) >= 3
        for b, size in zip(sync.buckets[1:], sizes[1:]):
            assert size <= 100_000 or len(b.params) == 1  # a bigger tensor gets its own bucket
        assert sync.nbytes == sum(p.numel() * 4 for p in model.parameters())
        for b in sync.buckets:  # gradients are views of the bucket (no copies)
            for p in b.params:
                assert p.grad.untyped_storage().data_ptr() == \
                    b.buffer.untyped_storage().data_ptr()
    finally:
        sync.close()


def test_defaults_environment_and_bad_settings(monkeypatch):
    assert 25 * MiB <= DEFAULT_FUSION_THRESHOLD_BYTES <= 64 * MiB
    monkeypatch.setenv("HPCLB_FUSION_THRESHOLD_BYTES", "64MiB")
    monkeypatch.setenv("HPCLB_OVERLAP", "nonblocking")
    monkeypatch.setenv("HPCLB_COMPRESSION", "fp16")
    sync = GradientSync(net().parameters(), SelfCommunicator())
    assert (sync.fusion_threshold_bytes, sync.overlap, sync.compression) == \
        (64 * MiB, "nonblocking", torch.float16)
    monkeypatch.setenv("HPCLB_FUSION_THRESHOLD_BYTES", "lots")
    with pytest.raises(ValueError, match="HPCLB_FUSION_THRESHOLD_BYTES"):
        GradientSync(net().parameters(), SelfCommunicator())
    monkeypatch.delenv("HPCLB_FUSION_THRESHOLD_BYTES")
    for bad in (dict(overlap="sometimes"), dict(accumulation_steps=0),
                dict(compression="int8"), dict(fusion_threshold_bytes=0)):
        with pytest.raises(ValueError):
            GradientSync(net().parameters(), SelfCommunicator(), **bad)


def test_auto_overlap_uses_no_thread_for_one_bucket(monkeypatch):
    """auto picks the communication thread for MPI-like backends (progress only inside their
    calls) when there are buckets to overlap with backward; for gradients that make one bucket
    nothing can overlap, so it takes the non-blocking call from the hook (the same matching
    rules as the thread's, none of its hand-off); an explicit mode is kept."""
    monkeypatch.delenv("HPCLB_OVERLAP", raising=False)
    several = dict(fusion_threshold_bytes=100_000, first_bucket_bytes=1_000)
    async_comm = ScaledComm(2)
    async_comm.async_progress = True   # Gloo/NCCL/Horovod: non-blocking at any bucket count
    cases = [(ScaledComm(2), dict(), nn.Linear(4, 4), 1, "nonblocking"),   # 80 bytes
             (ScaledComm(2), several, net(), 4, "thread"),
             (ScaledComm(2), dict(overlap="thread"), nn.Linear(4, 4), 1, "thread"),
             (async_comm, several, net(), 4, "nonblocking")]
    for comm, kwargs, model, buckets, want in cases:
        sync = GradientSync(model.parameters(), comm, **kwargs)
        try:
            assert (len(sync.buckets) > 1, sync.overlap) == (buckets > 1, want), kwargs
        finally:
            sync.close()


@pytest.mark.parametrize("mode", MODES)
def test_bucketed_mean_equals_flat_mean_in_a_pretend_world(mode):
    model, ref = net(), net()
    comm = ScaledComm(4)
    sync = GradientSync(model.named_parameters(), comm, overlap=mode,
                        fusion_threshold_bytes=50_000, first_bucket_bytes=500)
    try:
        for step in range(2):
            model.zero_grad(set_to_none=False)
            loss(model, step).backward()
            assert sync.synchronize() is True
            ref.zero_grad()
            loss(ref, step).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
            flat.mul_(4).div_(4)
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert torch.equal(got, flat)
        assert comm.calls == 2 * len(sync.buckets)
    finally:
        sync.close()


@pytest.mark.parametrize("compression", ("fp16", "bf16"))
def test_compression_predivides_so_large_gradients_stay_finite(compression):
    model = nn.Linear(32, 32)
    sync = GradientSync(model.named_parameters(), ScaledComm(8), compression=compression)
    try:
        (model.weight.sum() * 3e4).backward()  # 8 x 3e4 overflows fp16 (max 65504)
        sync.synchronize()
    finally:
        sync.close()
    assert model.weight.grad.dtype == torch.float32
    assert torch.isfinite(model.weight.grad).all()
    assert torch.allclose(model.weight.grad, torch.full((32, 32), 3e4), rtol=1e-2)
    assert torch.count_nonzero(model.bias.grad) == 0


def test_accumulation_in_one_process_equals_the_big_batch():
    k = 3
    model, big = net(), net()
    sync = GradientSync(model.parameters(), SelfCommunicator(), accumulation_steps=k)
    x = torch.randn(3 * 4, 10, generator=torch.Generator().manual_seed(1))
    flags = []
    for i in range(k):
        model(x[4 * i:4 * (i + 1)]).pow(2).mean().backward()
        flags.append(sync.synchronize())
    big(x).pow(2).mean().backward()
    assert flags == [False, False, True]
    for p, q in zip(model.parameters(), big.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_replaced_gradients_are_adopted_and_misuse_is_refused():
    model = net()
    comm = ScaledComm(2)
    sync = GradientSync(model.named_parameters(), comm, overlap="nonblocking")
    try:
        model.zero_grad(set_to_none=True)  # autograd then makes fresh tensors: hooks copy them
        loss(model).backward()
        sync.synchronize()
        ref = net()
        loss(ref).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        with pytest.raises(ValueError, match="already synchronised"):
            GradientSync(model.named_parameters(), comm)
        # a second backward before synchronize(): before, refused ("arrived after its bucket
        # was sent"); under DDP's contract each backward ends reduced, so the second adds to
        # the first's mean and is reduced again: the sum of both, as under DDP / plain torch
        model.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
        out, ref_out = loss(model, 3), loss(ref, 3)
        out.backward(retain_graph=True)
        out.backward()
        ref_out.backward(retain_graph=True)
        ref_out.backward()
        assert sync.synchronize() is True
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-7)
    finally:
        sync.close()
    GradientSync(model.named_parameters(), comm).close()  # after close() it may be re-wrapped


def test_start_up_agreement_compares_names_shapes_dtypes():
    class TwoFaced(ScaledComm):
        def allgather_object(self, obj):
            other = copy.deepcopy(obj)
            other["params"][1] = ("0.bias", (301,), "float32")
            return [obj, other]

    with pytest.raises(ModelMismatchError, match=r"rank 1 .*0\.bias \[301\] float32"):
        GradientSync(net().named_parameters(), TwoFaced(2))


def test_agree_num_steps_validates():
    c = SelfCommunicator()
    assert agree_num_steps(7, c) == 7 and agree_num_steps(7, c, how="max") == 7
    with pytest.raises(ValueError):
        agree_num_steps(3, c, how="mean")


class ScriptedPeers(SideChannel):
    """Answers every question with the given ranks' states."""

    def __init__(self, states):
        self.states, self.inbox, self.asked = states, [], 0

    def send(self, obj, dest=None):
        if obj.get("kind") == "ask":
            self.asked += 1
            self.inbox += [(r, {"kind": "state", "id": obj["id"], **st})
                           for r, st in self.states.items()]

    def poll(self):
        out, self.inbox = self.inbox, []
        return out


def test_watchdog_names_ranks_that_have_not_joined():
    peers = ScriptedPeers({
        1: {"entered": 5, "entered_label": "b5", "entered_ago_s": 0.1, "waiting": (5, "b5", 0.3)},
        3: {"entered": 3, "entered_label": "b3", "entered_ago_s": 2.0, "idle_s": 1.9}})
    wd = StallWatchdog(ScaledComm(4, side=peers))
    wd.register_timeout(0.2)
    try:
        for _ in range(5):
            seq = wd.entered("bucket")
        reports = []
        with wd.waiting(seq, "bucket 5", 0.2, on_stall=reports.append):
            deadline = time.monotonic() + 10
            while not reports and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        wd.stop()
    r = reports[0]
    assert r.seq == 5 and r.missing == [2, 3] and r.waited_s >= 0.2
    assert "joined" in r.details[1] and "no reply" in r.details[2]
    assert "last started #3 'b3'" in r.details[3] and "rank(s) 2, 3 have not joined" in r.message


def test_watchdog_without_side_channel_reports_and_aborts():
    class Aborting(ScaledComm):
        aborted = None

        def abort(self, code=1):
            Aborting.aborted = code

    wd = StallWatchdog(Aborting(2))
    wd.register_timeout(0.1)
    reports = []
    try:
        with wd.waiting(wd.entered("x"), "x", 0.1, on_stall=reports.append, abort_s=0.3):
            deadline = time.monotonic() + 10
            while Aborting.aborted is None and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        wd.stop()
    assert reports and reports[0].missing is None and "cannot tell" in reports[0].message
    assert Aborting.aborted == 1


def test_plan_buckets_and_the_scaling_model_fit():
    from hpclb.bench.model import Calibration, comm_time, fit_alpha_beta, workloads
    from hpclb.sync.buckets import plan_buckets
    assert plan_buckets([10, 10, 10, 30, 5], fusion_threshold_bytes=25,
                        first_bucket_bytes=12) == [[4], [3], [2, 1], [0]]
    alpha, beta = 3e-6, 1 / 5e9
    pts = [(n, p, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta)
           for p in (2, 4) for n in (4096, 2 ** 20, 2 ** 24)]
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    cal = Calibration(alpha, beta, 1.0, 0.5, "test", len(pts), 0.0)
    w = workloads()["resnet50"]
    assert w.gradient_bytes == 25_557_032 * 4
    t = [comm_time(w, n, 200, cal, 25 * MiB, "hierarchical") for n in (1, 16, 256)]
    assert 0 < t[0] < t[1] < t[2]  # more nodes: more latency terms, more bytes over the links


def test_one_live_gradient_sync_per_communicator():
    """Two GradientSyncs on one communicator would order their collectives by whichever backward
    runs (a GAN); the second is refused with the fix, and allowed once the first is closed."""
    comm = ScaledComm(2)
    d, g = net(), net()
    first = GradientSync(d.named_parameters(), comm)
    try:
        with pytest.raises(ValueError, match="one GradientSync / hpclb.DistributedOptimizer"):
            GradientSync(g.named_parameters(), comm)
    finally:
        first.close()
    GradientSync(g.named_parameters(), comm).close()
    dropped = GradientSync(d.named_parameters(), comm)  # a dropped one is not in the way
    del dropped
    GradientSync(g.named_parameters(), comm).close()
    GradientSync(d.named_parameters(), SelfCommunicator()).close()  # one process: no collectives


def test_byte_settings_name_their_unit_and_forms(monkeypatch):
    from hpclb.sync.options import parse_bytes

    assert [parse_bytes(s) for s in ("26214400", "25MiB", "64 MB", "1GiB", "512k")] == \
        [26214400, 25 * MiB, 64 * 10 ** 6, 2 ** 30, 512 * 1024]
    with pytest.warns(UserWarning, match="unit is bytes"):
        GradientSync(net().parameters(), SelfCommunicator(), fusion_threshold_bytes=64).close()
    monkeypatch.setenv("HPCLB_FUSION_THRESHOLD_BYTES", "64 megs")
    with pytest.raises(ValueError, match=r"HPCLB_FUSION_THRESHOLD_BYTES.*25MiB, 64MB"):
        GradientSync(net().parameters(), SelfCommunicator())
    monkeypatch.delenv("HPCLB_FUSION_THRESHOLD_BYTES")
    for bad, word in ((dict(stall_timeout_s=0), "seconds"), (dict(fusion_threshold_bytes=-5), "bytes"),
                      (dict(stall_timeout_s=5, stall_abort_s=1), "abort after the report")):
        with pytest.raises(ValueError, match=word):
            GradientSync(net().parameters(), SelfCommunicator(), **bad)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.float64))
def test_gradient_views_start_16_byte_aligned(dtype):
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 1)).to(dtype)
    sync = GradientSync(model.named_parameters(), ScaledComm(2), fusion_threshold_bytes=4096)
    try:
        for b in sync.buckets:
            base = b.buffer.data_ptr()
            for v in b.views:
                assert (v.data_ptr() - base) % 16 == 0
        model(torch.randn(4, 3, dtype=dtype)).sum().backward()
        sync.synchronize()
        ref = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 1)).to(dtype)
        ref.load_state_dict(model.state_dict())
        x = torch.randn(4, 3, dtype=dtype, generator=torch.Generator().manual_seed(0))
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()
        sync.synchronize()
        ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    finally:
        sync.close()


def test_buckets_are_registered_with_the_communicator_while_the_sync_lives():
    """The communicator keeps staging buffers for the gradient buckets only (others are
    transient), so GradientSync names them on start and withdraws them on close."""
    class Recording(ScaledComm):
        def __init__(self):
            super().__init__(2)
            self.registered = []

        def register_buckets(self, tensors):
            self.registered.append([t.data_ptr() for t in tensors])

    comm = Recording()
    sync = GradientSync(net().named_parameters(), comm, fusion_threshold_bytes=100_000,
                        first_bucket_bytes=1_000)
    assert comm.registered == [[b.comm_buffer.data_ptr() for b in sync.buckets]]
    assert len(sync.buckets) > 1
    sync.close()
    assert comm.registered[-1] == []


@pytest.mark.parametrize("divisor, fp16, expected", [
    (1, False, False), (2, False, True), (4, False, True), (256, False, True),
    (3, False, False), (6, False, False), (2, True, False)])
def test_the_loop_prescales_the_loss_only_where_it_is_exact(divisor, fp16, expected):
    """hpclb train folds 1/(world_size * accumulation_steps) into the loss (no division pass
    over the gradients) only for a power of two (an exact scaling: the same bits as dividing)
    and never under an fp16 loss scaler."""
    from hpclb.train.setup import prescale_exactly
    assert prescale_exactly(divisor, object() if fp16 else None) is expected


def _thp_eligible(lo: int, hi: int) -> list[int]:
    """``THPeligible`` of every mapping of this process that overlaps ``[lo, hi)``."""
    out, cur = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and all(c in "0123456789abcdef-" for c in head[0]):
            a, b = (int(x, 16) for x in head[0].split("-"))
            cur = a < hi and b > lo
        elif cur and head[0] == "THPeligible:":
            out.append(int(head[1]))
    return out


def test_large_cpu_buckets_may_use_huge_pages():
    """A CPU bucket of >= 4 MiB is allocated so that the kernel may back it with transparent huge
    pages (numpy's madvise; torch's allocator does not ask): MPI copies each bucket through
    shared memory, measured 15 % faster here (docs/results.md). Smaller and non-CPU buckets are
    torch's own zeros; every dtype keeps its size and reads as zeros."""
    from hpclb.sync.buckets import HUGE_PAGE_MIN_BYTES, bucket_zeros
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for n in (10, HUGE_PAGE_MIN_BYTES):
            b = bucket_zeros(n, dtype, torch.device("cpu"))
            assert (b.shape, b.dtype, b.is_contiguous(), int(b.count_nonzero())) == \
                ((n,), dtype, True, 0)
    assert bucket_zeros(5, torch.float32, torch.device("meta")).device.type == "meta"
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine: nothing to ask for")
    big = bucket_zeros(8 * 2 ** 20, torch.float32, torch.device("cpu"))   # 32 MiB
    eligible = _thp_eligible(big.data_ptr(), big.data_ptr() + 32 * 2 ** 20)
    if not eligible:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert 1 in eligible, eligible
