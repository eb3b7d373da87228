"""CUDA tensors through the mpi backend without a GPU: the staging/ordering logic
(hpclb/comm/mpi.py HostStaging) runs with CPU stand-ins for streams and events that record the
order of record/wait/copy calls; CUDA-aware MPI detection; the torch backend's routing of CPU
tensors and objects to a Gloo group. MPI-marked tests pass at any world size."""
from __future__ import annotations

import pytest
import torch
from conftest import all_ranks_ok

from hpclb.comm.mpi import HostStaging, _DeviceBuffer, _MPIHandle, cuda_aware_mpi

pytestmark = pytest.mark.timeout(60, method="thread")


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        self.log.append(("wait", self.name, event.id))


class FakeEvent:
    count = 0

    def __init__(self, log: list):
        FakeEvent.count += 1
        self.id, self.log, self.stream = FakeEvent.count, log, None

    def record(self, stream) -> None:
        self.stream = stream.name
        self.log.append(("record", stream.name, self.id))

    def synchronize(self) -> None:
        self.log.append(("sync", self.stream, self.id))


class FakeCudaAPI:
    """Stand-in for TorchCudaAPI: CPU tensors play device memory; every call is logged."""

    def __init__(self, log: list, allow_current: bool = False):
        self.log, self.allow_current, self.pinned_buffers = log, allow_current, []

    def new_stream(self):
        return FakeStream("copy", self.log)

    def new_event(self):
        return FakeEvent(self.log)

    def current_stream(self):
        if not self.allow_current:
            raise AssertionError("the current stream was used although a stream was passed")
        return FakeStream("current", self.log)

    def pinned(self, numel, dtype):
        buf = torch.empty(numel, dtype=dtype)
        self.pinned_buffers.append(buf)
        return buf

    def copy(self, dst, src, stream):
        kind = "d2h" if any(dst is b for b in self.pinned_buffers) else "h2d"
        self.log.append(("copy", kind, stream.name))
        dst.copy_(src)

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name))


def _index(log, entry):
    assert entry in log, f"{entry} not in {log}"
    return log.index(entry)


def test_d2h_waits_on_the_producer_event_and_h2d_precedes_the_consumer_wait():
    log: list = []
    staging = HostStaging(FakeCudaAPI(log))
    producer = FakeStream("compute", log)
    grad = torch.arange(6.0).reshape(2, 3)
    host = staging.to_host(grad, producer)
    assert torch.equal(host, torch.arange(6.0)) and host.shape == (6,)
    ready = log[0][2]
    # producer's event -> the copy stream waits on it -> d2h on the copy stream -> host waits
    assert log[0] == ("record", "compute", ready)
    i_wait = _index(log, ("wait", "copy", ready))
    i_d2h = _index(log, ("copy", "d2h", "copy"))
    copied = next(e[2] for e in log[i_d2h:] if e[0] == "record" and e[1] == "copy")
    i_sync = _index(log, ("sync", "copy", copied))
    assert i_wait < i_d2h < i_sync == len(log) - 1
    host.mul_(2)  # MPI reduces the host buffer
    mark = len(log)
    staging.to_device(host, grad, producer)
    after = log[mark:]
    back = after[1][2]
    assert after == [("copy", "h2d", "copy"), ("record", "copy", back),
                     ("wait", "compute", back)]
    assert torch.equal(grad, 2 * torch.arange(6.0).reshape(2, 3))


def test_pinned_buffers_are_reused_per_bucket():
    log: list = []
    api = FakeCudaAPI(log)
    staging = HostStaging(api)
    s = FakeStream("compute", log)
    a, b = torch.ones(100), torch.ones(50, dtype=torch.float16)
    staging.keep([a, b])  # the gradient buckets
    first = staging.to_host(a, s)
    for _ in range(3):
        assert staging.to_host(a, s) is first
    other = staging.to_host(b, s)
    assert other is not first and other.dtype == torch.float16
    assert len(api.pinned_buffers) == 2
    # the next step's d2h of a bucket is ordered after its last h2d on the one copy stream
    staging.to_device(first, a, s)
    staging.to_host(a, s)
    copies = [e for e in log if e[0] == "copy"]
    assert copies[-2:] == [("copy", "h2d", "copy"), ("copy", "d2h", "copy")]
    assert staging.cached_bytes == 100 * 4 + 50 * 2


def test_tensors_not_kept_get_transient_buffers_and_the_cache_stays_bounded():
    """A parameter broadcast stages every parameter once: none of them may stay pinned."""
    api = FakeCudaAPI([])
    staging = HostStaging(api)
    s = FakeStream("compute", api.log)
    grads = torch.ones(64)
    staging.keep([grads])
    params = [torch.full((1000 + i,), float(i)) for i in range(20)]
    for p in params:
        host = staging.to_host(p, s)
        assert torch.equal(host, p)
        staging.to_device(host, p, s)
    assert staging.cached_bytes == 0 and len(api.pinned_buffers) == 20
    first = staging.to_host(grads, s)
    assert staging.to_host(grads, s) is first and staging.cached_bytes == 64 * 4
    staging.keep([])  # the GradientSync closed: its buffers go too
    assert staging.cached_bytes == 0


def test_handle_finishes_once():
    calls = []

    class Req:
        def __init__(self):
            self.n = 0

        def Test(self):
            self.n += 1
            return self.n > 1

        def Wait(self):
            calls.append("Wait")

    t = torch.zeros(2)
    h = _MPIHandle(Req(), t, lambda: calls.append("finish"))
    assert not h.test() and calls == []
    assert h.test() and calls == ["finish"]
    assert h.wait() is t and h.test() and calls == ["finish"]


def test_cuda_aware_override_and_detection(monkeypatch):
    class Aware:
        @staticmethod
        def Query_cuda_support():
            return True

    monkeypatch.setenv("HPCLB_CUDA_AWARE_MPI", "0")
    assert cuda_aware_mpi(Aware) is False
    monkeypatch.setenv("HPCLB_CUDA_AWARE_MPI", "1")
    assert cuda_aware_mpi(object()) is True
    monkeypatch.setenv("HPCLB_CUDA_AWARE_MPI", "yes")
    with pytest.raises(ValueError, match="HPCLB_CUDA_AWARE_MPI='yes'"):
        cuda_aware_mpi(Aware)
    monkeypatch.delenv("HPCLB_CUDA_AWARE_MPI")
    assert cuda_aware_mpi(Aware) is True


def test_ctypes_query_finds_the_loaded_mpi(monkeypatch):
    from mpi4py import MPI

    from hpclb.comm.mpi import _ctypes_cuda_support
    monkeypatch.delenv("HPCLB_CUDA_AWARE_MPI", raising=False)
    found = _ctypes_cuda_support()
    assert isinstance(found, bool), "no loaded libmpi has MPIX_Query_cuda_support"
    if not hasattr(MPI, "Query_cuda_support"):
        assert cuda_aware_mpi(MPI) is found


def test_device_buffer_interface():
    t = torch.arange(8, dtype=torch.float16)
    cai = _DeviceBuffer(t).__cuda_array_interface__
    assert cai == {"shape": (8,), "typestr": "<f2", "data": (t.data_ptr(), False),
                   "strides": None, "version": 3, "stream": None}
    with pytest.raises(TypeError, match="bfloat16"):
        _DeviceBuffer(t.to(torch.bfloat16))


def _mpi_comm(comm):
    if comm.backend == "mpi":
        return comm
    from hpclb.comm.mpi import MPICommunicator
    return MPICommunicator()  # one process with --with-mpi: the fixture is the self backend


def _as_device(monkeypatch, c, log, aware=False, allow_current=False):
    """Make ``c`` treat CPU tensors as device tensors, staged through the fakes."""
    api = FakeCudaAPI(log, allow_current)
    monkeypatch.setattr(c, "_is_device_tensor", lambda t: True)
    monkeypatch.setattr(c, "_cuda_api", lambda device: api)
    monkeypatch.setattr(c, "_stagings", {})
    monkeypatch.setattr(c, "_cuda_aware", aware)
    return api


@pytest.mark.mpi
def test_staged_collectives_reduce_and_order_by_the_passed_stream(comm, monkeypatch):
    c = _mpi_comm(comm)
    W, r, log = c.world_size, c.rank, []
    api = _as_device(monkeypatch, c, log)
    compute = FakeStream("compute", log)
    bad = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        t = torch.full((300,), r + 1, dtype=dtype)
        c.allreduce_(t, "sum", stream=compute)
        if not torch.equal(t, torch.full((300,), W * (W + 1) // 2, dtype=dtype)):
            bad.append(f"{dtype} sum {t[:2].tolist()}")
    t = torch.full((64,), float(r + 1))
    h = c.iallreduce_(t, "max", stream=compute)
    if log[-1][0] != "sync" or ("copy", "h2d", "copy") in log[log.index(log[-1]):]:
        bad.append("iallreduce_ copied back before completion")
    h.wait()
    if not torch.equal(t, torch.full((64,), float(W))) or log[-1][:2] != ("wait", "compute"):
        bad.append(f"iallreduce max {t[:2].tolist()} / last {log[-1]}")
    b = c.broadcast_(torch.full((5,), float(r + 3)), root=W - 1, stream=compute)
    if b.tolist() != [float(W + 2)] * 5:
        bad.append(f"broadcast {b.tolist()}")
    waits = [e for e in log if e[0] == "wait"]
    if {e[1] for e in waits} != {"copy", "compute"} or any(e[1] == "current" for e in log):
        bad.append(f"streams used: {sorted({e[1] for e in log})}")
    if len(api.pinned_buffers) != 6:  # one per bucket: 4 dtypes, the iallreduce, broadcast
        bad.append(f"{len(api.pinned_buffers)} pinned buffers")
    all_ranks_ok(c, not bad, "; ".join(bad))


@pytest.mark.mpi
def test_broadcast_parameters_pins_no_model_and_buckets_keep_theirs(comm, monkeypatch):
    from hpclb.sync.agree import broadcast_parameters
    c = _mpi_comm(comm)
    api = _as_device(monkeypatch, c, [], allow_current=True)
    torch.manual_seed(c.rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    if c.world_size > 1:
        broadcast_parameters(model, c)
    else:  # one process: broadcast_parameters returns at once; its calls, one by one
        for p in model.parameters():
            c.broadcast_(p.data, root=0)
    stager = c._stager(torch.device("cpu"))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    ok = stager.cached_bytes == 0 and len(api.pinned_buffers) == 4
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    ok = ok and all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    bucket = torch.ones(1000)
    c.register_buckets([bucket])
    for _ in range(3):
        c.allreduce_(bucket)
    ok = ok and stager.cached_bytes == 4000 and len(api.pinned_buffers) == 5
    c.register_buckets([])
    all_ranks_ok(c, ok and stager.cached_bytes == 0,
                 f"cached {stager.cached_bytes} of a {nbytes}-byte model, "
                 f"{len(api.pinned_buffers)} pinned")


@pytest.mark.mpi
def test_default_stream_is_the_callers_current_one(comm, monkeypatch):
    c = _mpi_comm(comm)
    log: list = []
    _as_device(monkeypatch, c, log, allow_current=True)
    t = torch.ones(4)
    c.allreduce_(t)
    ok = log[0][:2] == ("record", "current") and log[-1][:2] == ("wait", "current")
    all_ranks_ok(c, ok and torch.equal(t, torch.full((4,), float(c.world_size))), str(log))


@pytest.mark.mpi
def test_cuda_aware_path_hands_the_device_buffer_after_the_producer(comm, monkeypatch):
    c = _mpi_comm(comm)
    log: list = []
    _as_device(monkeypatch, c, log, aware=True)
    compute = FakeStream("compute", log)
    t = torch.ones(16)
    buf, _, finish = c._prepare(t, "sum", compute)
    ok = (isinstance(buf, _DeviceBuffer) and buf.tensor is t and finish is None
          and [e[:2] for e in log] == [("record", "compute"), ("sync", "compute")])
    _, _, finish16 = c._prepare(t.to(torch.bfloat16), "sum", compute)  # bf16: staged
    ok = ok and finish16 is not None
    # mpi4py takes the __cuda_array_interface__ (host memory stands in for device memory)
    W = c.world_size
    for dtype in (torch.float32, torch.float16, torch.int64):
        x = torch.full((7,), c.rank + 1, dtype=dtype)
        c.allreduce_(x, "sum", stream=compute)
        ok = ok and torch.equal(x, torch.full((7,), W * (W + 1) // 2, dtype=dtype))
    all_ranks_ok(c, ok, f"{type(buf).__name__} {log}")


@pytest.mark.mpi
def test_torch_backend_routes_cpu_tensors_and_objects_to_its_gloo_group(comm):
    import torch.distributed as dist

    from hpclb.comm.torch_dist import TorchCommunicator
    tc = TorchCommunicator(device="cpu")
    tc._cpu_group = dist.new_group(backend="gloo")  # as beside an NCCL default group
    W, r = tc.world_size, tc.rank
    t = torch.full((10,), float(r + 1))
    tc.allreduce_(t)
    h = tc.iallreduce_(torch.full((3,), float(r)), "max")
    got = tc.allgather_object(r)
    tc.barrier()
    ok = (tc._group(t) is tc._cpu_group and tc._group(torch.empty(1, device="meta")) is None
          and torch.equal(t, torch.full((10,), W * (W + 1) / 2))
          and h.wait().tolist() == [float(W - 1)] * 3 and got == list(range(W))
          and tc.broadcast_object(f"r{r}", root=0) == "r0")
    all_ranks_ok(comm, ok, f"{t[:2].tolist()} {got}")


def _fake_gpus(monkeypatch, n):
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(torch.device(d)))
    return bound


def test_horovod_binds_its_local_ranks_gpu(monkeypatch):
    import sys
    import types
    hvd = types.ModuleType("horovod.torch")
    hvd.init = lambda: None
    hvd.rank, hvd.size, hvd.local_rank, hvd.local_size = (lambda: 5), (lambda: 8), \
        (lambda: 3), (lambda: 4)
    hvd.Sum, hvd.Max, hvd.Min = "sum", "max", "min"
    monkeypatch.setitem(sys.modules, "horovod", types.ModuleType("horovod"))
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)
    from hpclb.comm.horovod import HorovodCommunicator
    assert HorovodCommunicator(device="cpu").device == torch.device("cpu")
    bound = _fake_gpus(monkeypatch, 2)
    c = HorovodCommunicator(device="auto")
    assert c.device == torch.device("cuda", 1) and bound == [torch.device("cuda", 1)]
    assert HorovodCommunicator(device="cuda:0").device == torch.device("cuda", 0)


def test_torch_backend_picks_the_local_ranks_gpu(monkeypatch):
    from hpclb.comm.torch_dist import bind_local_gpu  # what the torch backend binds with
    local_rank = 5
    bound = _fake_gpus(monkeypatch, 4)
    assert bind_local_gpu("cuda", local_rank) == torch.device("cuda", 1) == bound[-1]
    assert bind_local_gpu(torch.device("cuda", 3), local_rank) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bind_local_gpu("auto", local_rank) == torch.device("cpu") and len(bound) == 2
