"""The gradient-sync communication thread on a GPU, proven on the CPU with a stand-in device API
that logs every stream/event call with the thread that made it: the thread binds the gradients'
device before any CUDA work, and a bucket's collective waits for the event the backward hook
recorded, not for the backward kernels enqueued after it."""
from __future__ import annotations

import threading

import pytest
import torch

from hpclb.comm.streams import TorchCudaAPI
from hpclb.sync.buckets import make_bucket
from hpclb.sync.reduction import ThreadDriver

pytestmark = pytest.mark.timeout(60, method="thread")


def _thread() -> str:
    return threading.current_thread().name


class Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.id, _thread()))


class Event:
    count = 0

    def __init__(self, log):
        Event.count += 1
        self.id, self.log = Event.count, log

    def record(self, stream):
        self.log.append(("record", stream.name, self.id, _thread()))


class DeviceAPI:
    """TorchCudaAPI's shape; CPU tensors play device memory (``device`` is theirs); ``binds``
    says which device the calling thread was bound to."""

    def __init__(self, log, binds_as="cuda:3"):
        self.device, self.log, self.binds_as = torch.device("cpu"), log, binds_as
        self.compute = Stream("compute", log)

    def bind_thread(self):
        self.log.append(("bind", self.binds_as, _thread()))

    def new_stream(self):
        return Stream("side", self.log)

    def new_event(self):
        return Event(self.log)

    def current_stream(self):
        return self.compute


class GatedComm:
    """A backend that, like the real ones, records its own "ready" event on the stream it is
    handed, when it is called (in the thread); it waits for ``go`` first."""

    async_progress, world_size = True, 2

    def __init__(self, api):
        self.api, self.go, self.streams = api, threading.Event(), []

    def allreduce_(self, tensor, op="sum", *, stream=None):
        self.go.wait(10)
        self.streams.append(stream.name)
        self.api.new_event().record(stream)
        tensor.mul_(2)
        return tensor


def _bucket():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return make_bucket(0, [p], ["w"], None)


def test_the_thread_binds_the_device_and_waits_for_the_hook_event_only():
    log: list = []
    api = DeviceAPI(log)
    comm = GatedComm(api)
    driver = ThreadDriver(comm, 0.0, device=torch.device("cuda", 3), api=api)
    try:
        b = _bucket()
        driver.launch(b)                                  # from the hook, on the main thread
        log.append(("kernel", "compute", "later backward work", _thread()))
        comm.go.set()
        driver.wait(b)
    finally:
        driver.close()
    assert torch.equal(b.views[0], torch.full((3,), 2.0))
    assert ("bind", "cuda:3", "hpclb-comm") in log
    assert log.index(("bind", "cuda:3", "hpclb-comm")) < \
        min(i for i, e in enumerate(log) if e[-1] == "hpclb-comm" and e[0] != "bind")
    later = log.index(("kernel", "compute", "later backward work", "MainThread"))
    # the stream handed to the backend is the side stream; what it waits on was recorded on the
    # training stream in the hook, before the later backward kernels
    assert comm.streams == ["side"]
    waited = [e[2] for e in log if e[0] == "wait" and e[1] == "side"]
    assert len(waited) == 1
    rec = next(i for i, e in enumerate(log) if e[0] == "record" and e[2] == waited[0])
    assert log[rec][1:2] == ("compute",) and log[rec][3] == "MainThread" and rec < later
    # no event on the training stream is recorded after the later kernels (the old defect)
    assert not any(e[0] == "record" and e[1] == "compute" for e in log[later:])
    # the optimizer's stream waits for the event recorded on the side stream after the reduce
    reduced = [e for e in log if e[0] == "record" and e[1] == "side"][-1]
    assert log[-1] == ("wait", "compute", reduced[2], "MainThread")


def test_cpu_buckets_take_no_device_path():
    log: list = []
    comm = GatedComm(DeviceAPI(log))
    comm.go.set()
    comm.allreduce_ = lambda t, op="sum", **kw: (log.append(("plain", kw)), t.mul_(2))[1]
    driver = ThreadDriver(comm, 0.0)              # no device: no bind, no events
    try:
        b = _bucket()
        driver.launch(b)
        driver.wait(b)
    finally:
        driver.close()
    assert log == [("plain", {})] and torch.equal(b.views[0], torch.full((3,), 2.0))


def test_torch_api_binds_the_thread_to_its_device(monkeypatch):
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append((d, _thread())))
    api = TorchCudaAPI(torch.device("cuda", 2))
    t = threading.Thread(target=api.bind_thread, name="hpclb-comm")
    t.start()
    t.join()
    assert bound == [(torch.device("cuda", 2), "hpclb-comm")]


def test_thread_driver_builds_the_torch_api_for_a_cuda_device(monkeypatch):
    """With a CUDA device and no stand-in the driver uses TorchCudaAPI: its thread binds that
    device (set_device and the stream faked: no GPU here)."""
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append((d, _thread())))
    monkeypatch.setattr(TorchCudaAPI, "new_stream", lambda self: "side")
    driver = ThreadDriver(GatedComm(None), 0.0, device=torch.device("cuda", 1))
    driver.close()
    assert isinstance(driver.api, TorchCudaAPI) and driver.api.device == torch.device("cuda", 1)
    assert bound == [(torch.device("cuda", 1), "hpclb-comm")]
