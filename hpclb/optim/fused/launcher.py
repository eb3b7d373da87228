"""Running the kernels on a GPU: CuPy compiles ``kernels/trust_ratio.cu`` (NVRTC) and launches
it on torch's current stream. CuPy is imported only when something asks for it."""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Sequence

from hpclb.errors import KernelCompileError
from hpclb.optim.fused.source import KERNELS, NVRTC_OPTIONS, kernel_source

if TYPE_CHECKING:
    import torch

__all__ = ["CupyLauncher", "cupy_available"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _cupy() -> Any:
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

    def module(self) -> Any:
        """The compiled ``cupy.RawModule`` (compiled on first use; raises KernelCompileError)."""
        if self._module is None:
            cp = _cupy()
            with cp.cuda.Device(self.index):
                mod = cp.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
                try:
                    self._functions = {k: mod.get_function(k) for k in KERNELS}
                except cp.cuda.compiler.CompileException as e:
                    raise KernelCompileError("CuPy failed to compile kernels/trust_ratio.cu",
                                             str(e)) from e
            self._module = mod
        return self._module

    def grid_for(self, n_chunks: int, block: int) -> int:
        return max(1, min(n_chunks, self.sm_count * max(1, 2048 // block)))

    def stream_key(self) -> int:
        """The handle of torch's current stream on this device (keys the table cache)."""
        import torch

        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def _stream(self) -> Any:
        import torch

        cp = _cupy()
        ts = torch.cuda.current_stream(self.device)
        handle = ts.cuda_stream
        s = self._streams.get(handle)
        if s is None:
            if hasattr(cp.cuda.Stream, "from_external"):
                s = cp.cuda.Stream.from_external(ts)
            else:  # CuPy < 14
                s = cp.cuda.ExternalStream(handle, self.index)
            self._streams[handle] = s
        return s

    def launch(self, name: str, grid: int, block: int, args: Sequence) -> None:
        self.module()
        cp = _cupy()
        with cp.cuda.Device(self.index), self._stream():
            self._functions[name]((int(grid),), (int(block),), tuple(args))
