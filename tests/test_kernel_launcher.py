"""CupyLauncher's host decisions without a GPU, against a stand-in CuPy that behaves like CuPy
where it matters (it writes its kernel cache under $CUPY_CACHE_DIR when compiling, exposes the
kernels' attributes and the device's limits): the compile options are the gate's, a cache that
cannot be written falls back to the torch path with one warning, the grid is what stays
resident, and torch's stream reaches CuPy by the protocol it speaks."""
from __future__ import annotations

import inspect
import logging
import os
import types

import pytest
import torch

import hpclb.optim.fused.launcher as L
import hpclb.optim.fused.trust as T
from hpclb.optim import fused as K

pytestmark = pytest.mark.timeout(120)

H200 = {"MaxRegistersPerMultiprocessor": 65536, "MaxThreadsPerMultiProcessor": 2048,
        "MaxBlocksPerMultiprocessor": 32, "MaxSharedMemoryPerMultiprocessor": 233472}
#: (registers, static shared bytes) per kernel as ptxas reported them for sm_90 with NVRTC 13.0
#: and NVRTC_OPTIONS (2026-12-01)
PTXAS = {"hl_norms_pass1": (46, 784), "hl_lars_apply": (55, 0), "hl_lamb_pass1": (90, 784),
         "hl_lamb_apply": (96, 0)}


class FakeFunction:
    def __init__(self, name):
        self.attributes = {"num_regs": PTXAS[name][0], "max_threads_per_block": K.KERNELS[name],
                           "shared_size_bytes": PTXAS[name][1]}


class FakeCupy(types.SimpleNamespace):
    """The parts of CuPy that CupyLauncher touches; ``compiles`` and ``streams`` record calls."""

    def __init__(self, from_external=True):
        fake = self
        self.compiles, self.streams = [], []

        class CompileException(Exception):
            pass

        class Device:
            attributes = H200

            def __init__(self, index=0):
                self.index = index

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class RawModule:
            def __init__(self, code, options):
                self.code, self.options = code, options

            def get_function(self, name):
                d = os.environ["CUPY_CACHE_DIR"]     # CuPy: makedirs + a temporary file there
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"{name}.cubin"), "wb") as f:
                    f.write(b"\x7fELF")
                fake.compiles.append((name, self.options))
                return FakeFunction(name)

        class Stream:
            pass

        if from_external:
            Stream.from_external = staticmethod(lambda s: ("from_external", s))
        cuda = types.SimpleNamespace(
            Device=Device, Stream=Stream, compiler=types.SimpleNamespace(
                CompileException=CompileException),
            ExternalStream=lambda handle, index: ("ExternalStream", handle, index))
        super().__init__(RawModule=RawModule, cuda=cuda, compiles=self.compiles,
                         streams=self.streams)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A faked GPU (132 SMs) and CuPy; a writable home; no fused state from other tests."""
    cp = FakeCupy()
    monkeypatch.setattr(L, "_cupy", lambda: cp)
    monkeypatch.setattr(L, "_CUPY_OK", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(T, "_FUSED", {})
    monkeypatch.setattr(T, "_REFUSED", {})
    monkeypatch.delenv("HPCLB_TRUST_BACKEND", raising=False)
    monkeypatch.delenv("CUPY_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return cp


def test_cupy_gets_the_options_the_compile_gate_uses(gpu):
    K.CupyLauncher(torch.device("cuda", 0)).module()
    assert {opts for _, opts in gpu.compiles} == {K.NVRTC_OPTIONS}
    assert inspect.signature(K.nvrtc_compile).parameters["options"].default == K.NVRTC_OPTIONS
    # CuPy appends -ftz=true to every compile; stated in hpclb's own options, it changes nothing
    from hpclb.optim.fused.source import CUPY_APPENDED_OPTIONS
    assert set(CUPY_APPENDED_OPTIONS) <= set(K.NVRTC_OPTIONS)


@pytest.mark.skipif(K.find_nvrtc() is None, reason="libnvrtc not found")
def test_what_cupy_compiles_is_the_gates_binary():
    """NVRTC itself: the gate's options plus what CuPy appends give the gate's cubin; without
    -ftz=true the binary differs (so the option had to be in the gate)."""
    from hpclb.optim.fused.source import CUPY_APPENDED_OPTIONS
    src = K.kernel_source()
    gate, _ = K.nvrtc_compile(src, "sm_90")
    cupy, _ = K.nvrtc_compile(src, "sm_90", K.NVRTC_OPTIONS + CUPY_APPENDED_OPTIONS)
    plain, _ = K.nvrtc_compile(src, "sm_90", tuple(o for o in K.NVRTC_OPTIONS
                                                   if o not in CUPY_APPENDED_OPTIONS))
    assert gate == cupy and gate != plain


def test_cache_dir_defaults_to_cupys_when_writable_else_a_temporary_one(gpu, tmp_path,
                                                                        monkeypatch):
    assert L.cupy_cache_dir() == str(tmp_path / "home" / ".cupy" / "kernel_cache")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))   # cannot be created
    fallback = L.cupy_cache_dir()
    assert fallback.startswith(os.path.realpath(__import__("tempfile").gettempdir()))
    K.CupyLauncher(torch.device("cuda", 0)).module()
    assert os.environ["CUPY_CACHE_DIR"] == fallback and os.path.isdir(fallback)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "mine"))
    assert L.cupy_cache_dir() == str(tmp_path / "mine")


def test_unwritable_cache_falls_back_to_torch_with_one_warning(gpu, tmp_path, monkeypatch,
                                                               caplog):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "file" / "cache"))
    caplog.set_level(logging.WARNING)
    assert [K.fused_for("cuda:0") for _ in range(3)] == [None] * 3
    warned = [r.getMessage() for r in caplog.records if "kernel cache" in r.getMessage()]
    assert len(warned) == 1 and "CUPY_CACHE_DIR" in warned[0] and "torch path" in warned[0]
    assert gpu.compiles == []                               # tried once, nothing compiled
    monkeypatch.setattr(T, "_REFUSED", {})
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "ok"))
    assert K.fused_for("cuda:0") is not None                # a writable cache: the kernel


@pytest.mark.parametrize("regs, block, smem, blocks", [
    (64, 512, 0, 2), (128, 512, 0, 1), (96, 512, 256, 1), (40, 512, 256, 3),
    (64, 1024, 0, 1), (32, 256, 0, 8), (16, 128, 0, 16), (16, 32, 0, 32), (32, 256, 100_000, 2)])
def test_resident_blocks_per_sm(regs, block, smem, blocks):
    assert L.resident_blocks_per_sm(regs, block, smem) == blocks


def test_grid_is_what_stays_resident(gpu):
    launcher = K.CupyLauncher(torch.device("cuda", 0))
    # was 4 blocks per SM for every kernel at 512 threads
    assert launcher.grid_for(10_000, 512, "hl_lamb_pass1") == 132        # 90 registers: 1/SM
    assert launcher.grid_for(10_000, 512, "hl_lamb_apply") == 132        # 96 registers: 1/SM
    assert launcher.grid_for(10_000, 512, "hl_lars_apply") == 132 * 2    # 55 registers: 2/SM
    assert launcher.grid_for(10_000, 512, "hl_norms_pass1") == 132 * 2   # 46 registers: 2/SM
    assert launcher.grid_for(10_000, 256, "hl_norms_pass1") == 132 * 5
    assert launcher.grid_for(5, 512, "hl_lamb_pass1") == 5


class _TorchStream:
    cuda_stream = 0xABC


class _ProtocolStream(_TorchStream):
    def __cuda_stream__(self):
        return (0, self.cuda_stream)


@pytest.mark.parametrize("stream, from_external, want", [
    (_ProtocolStream(), True, "from_external"),
    (_TorchStream(), True, "ExternalStream"),       # CuPy has it, torch's stream lacks it
    (_ProtocolStream(), False, "ExternalStream"),   # an older CuPy
])
def test_torch_stream_reaches_cupy_by_what_both_speak(stream, from_external, want):
    got = L.cupy_stream_of(FakeCupy(from_external), stream, 3)
    assert got[0] == want
    if want == "ExternalStream":
        assert got[1:] == (0xABC, 3)
