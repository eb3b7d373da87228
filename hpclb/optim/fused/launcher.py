"""Running the kernels on a GPU: CuPy compiles ``kernels/trust_ratio.cu`` (NVRTC) and launches
it on torch's current stream. CuPy is imported only when something asks for it.

Compiled with :data:`~hpclb.optim.fused.source.NVRTC_OPTIONS`, which include the option CuPy
appends to every compile (``-ftz=true``), so the binary that runs is the one the compile gate
checks. CuPy caches the binary on disk in ``$CUPY_CACHE_DIR``; where that is unset this module
points it at :func:`cupy_cache_dir` (CuPy's default when writable, else a directory under the
temporary directory) before CuPy is imported (CuPy reads it then), so a read-only home does not
fail the first step. The grid of a launch is
what stays resident on the GPU at once (:func:`resident_blocks_per_sm` from the kernel's
registers and shared memory), not a guess.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any, Sequence

from hpclb.errors import KernelCompileError
from hpclb.optim.fused.source import KERNELS, NVRTC_OPTIONS, kernel_source

if TYPE_CHECKING:
    import torch

__all__ = ["CUPY_CACHE_ENV", "CupyLauncher", "cupy_available", "cupy_cache_dir",
           "resident_blocks_per_sm"]

log = logging.getLogger(__name__)

CUPY_CACHE_ENV = "CUPY_CACHE_DIR"


@functools.lru_cache(maxsize=1)
def _cupy() -> Any:
    # before the import: CuPy reads $CUPY_CACHE_DIR as it is imported
    os.environ.setdefault(CUPY_CACHE_ENV, cupy_cache_dir())
    import cupy  # noqa: F401  (the `gpu` extra)

    return cupy


_CUPY_OK: bool | None = None


def cupy_available() -> bool:
    """True when CuPy imports (it is never imported before something asks; the answer is
    remembered for the process)."""
    global _CUPY_OK
    if _CUPY_OK is None:
        try:
            _cupy()
            _CUPY_OK = True
        except Exception as e:  # ImportError, or a CuPy that finds no CUDA runtime
            log.debug("CuPy unavailable: %s", e)
            _CUPY_OK = False
    return _CUPY_OK


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False


def cupy_cache_dir() -> str:
    """Where CuPy keeps compiled kernels: ``$CUPY_CACHE_DIR`` when set (the user's choice,
    untested here); else CuPy's default ``~/.cupy/kernel_cache`` when it can be written (shared
    by later jobs: compiled once); else ``<temporary directory>/hpclb-cupy-<uid>``."""
    chosen = os.environ.get(CUPY_CACHE_ENV)
    if chosen:
        return chosen
    default = os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    if _writable(default):
        return default
    return os.path.join(tempfile.gettempdir(), f"hpclb-cupy-{os.getuid()}")


def resident_blocks_per_sm(num_regs: int, block: int, smem_bytes: int = 0, *,
                           regs_per_sm: int = 65536, max_threads_per_sm: int = 2048,
                           max_blocks_per_sm: int = 32, smem_per_sm: int = 233472) -> int:
    """Blocks of ``block`` threads that fit on one SM at once (>= 1), limited by registers
    (``num_regs`` per thread, allocated per warp in units of 256), threads, blocks and static
    shared memory (``smem_bytes`` per block). Defaults: an H100/H200 SM (sm_90). Source: the
    CUDA occupancy calculator's rules (CUDA C Programming Guide, "Occupancy")."""
    warps = -(-block // 32)
    regs_per_warp = -(-num_regs * 32 // 256) * 256
    by_regs = (regs_per_sm // regs_per_warp) // warps if regs_per_warp else max_blocks_per_sm
    by_threads = max_threads_per_sm // (warps * 32)
    by_smem = smem_per_sm // smem_bytes if smem_bytes else max_blocks_per_sm
    return max(1, min(by_regs, by_threads, by_smem, max_blocks_per_sm))


class CupyLauncher:
    """Runs the kernels on one CUDA device with CuPy, on torch's current stream."""

    name = "cupy"

    def __init__(self, device: "torch.device"):
        import torch

        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        props = torch.cuda.get_device_properties(self.index)
        self.sm_count = props.multi_processor_count
        self._module = None
        self._functions: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}
        self._resident: dict[tuple[str, int], int] = {}

    def module(self) -> Any:
        """The compiled ``cupy.RawModule`` (compiled on first use; raises KernelCompileError,
        or OSError when CuPy cannot write its cache directory)."""
        if self._module is None:
            cp = _cupy()
            os.environ.setdefault(CUPY_CACHE_ENV, cupy_cache_dir())   # CuPy imported elsewhere
            with cp.cuda.Device(self.index):
                mod = cp.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
                try:
                    self._functions = {k: mod.get_function(k) for k in KERNELS}
                except cp.cuda.compiler.CompileException as e:
                    raise KernelCompileError("CuPy failed to compile kernels/trust_ratio.cu",
                                             str(e)) from e
            self._module = mod
        return self._module

    def blocks_per_sm(self, kernel: str, block: int) -> int:
        """Resident blocks per SM of ``kernel`` at ``block`` threads, from its compiled
        attributes and the device's limits (cached)."""
        key = (kernel, block)
        if key not in self._resident:
            self.module()
            attrs = self._functions[kernel].attributes
            dev = _cupy().cuda.Device(self.index).attributes
            self._resident[key] = resident_blocks_per_sm(
                attrs["num_regs"], min(block, attrs["max_threads_per_block"]),
                attrs["shared_size_bytes"],
                regs_per_sm=dev.get("MaxRegistersPerMultiprocessor", 65536),
                max_threads_per_sm=dev.get("MaxThreadsPerMultiProcessor", 2048),
                max_blocks_per_sm=dev.get("MaxBlocksPerMultiprocessor", 32),
                smem_per_sm=dev.get("MaxSharedMemoryPerMultiprocessor", 233472))
        return self._resident[key]

    def grid_for(self, n_chunks: int, block: int, kernel: str | None = None) -> int:
        """Blocks to launch: one per chunk, at most what is resident at once (the kernels loop
        over chunks). Without ``kernel``: 2048 threads per SM."""
        per_sm = self.blocks_per_sm(kernel, block) if kernel else max(1, 2048 // block)
        return max(1, min(n_chunks, self.sm_count * per_sm))

    def stream_key(self) -> int:
        """The handle of torch's current stream on this device (keys the table cache)."""
        import torch

        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def _stream(self) -> Any:
        import torch

        ts = torch.cuda.current_stream(self.device)
        handle = ts.cuda_stream
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = cupy_stream_of(_cupy(), ts, self.index)
        return s

    def launch(self, name: str, grid: int, block: int, args: Sequence) -> None:
        self.module()
        cp = _cupy()
        with cp.cuda.Device(self.index), self._stream():
            self._functions[name]((int(grid),), (int(block),), tuple(args))


def cupy_stream_of(cp: Any, torch_stream: Any, index: int) -> Any:
    """CuPy's view of ``torch_stream``: ``cupy.cuda.Stream.from_external`` where CuPy has it and
    the torch stream speaks the ``__cuda_stream__`` protocol, else
    ``cupy.cuda.ExternalStream(handle, device)``."""
    if hasattr(cp.cuda.Stream, "from_external") and hasattr(torch_stream, "__cuda_stream__"):
        return cp.cuda.Stream.from_external(torch_stream)
    return cp.cuda.ExternalStream(torch_stream.cuda_stream, index)
