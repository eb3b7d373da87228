"""Fused per-layer norms, trust ratios and LARS/LAMB updates: ``kernels/trust_ratio.cu`` on GPU.

The CUDA C in ``kernels/trust_ratio.cu`` is compiled at run time by CuPy (``cupy.RawModule``,
NVRTC; cached by CuPy on disk and here per process) and launched on **torch's current stream**
with raw device pointers (``np.uint64``) and ``np.int32``/``np.float32`` scalars, so torch
tensors are used in place: nothing is copied, nothing is converted through DLPack, and no call
synchronises with the host (no ``.item()``). CuPy is imported lazily, only when a CUDA tensor
asks for the fused path; it is the ``gpu`` extra (``pip install -e '.[gpu]'``), absent in CI.

Scheme (NVIDIA apex's multi_tensor_apply / multi_tensor_l2norm design, written anew): every
tensor is cut into chunks of ``chunk_size`` elements; a table in device memory holds, per tensor,
its pointers (w, g, m, v), numel, first chunk, dtype, exclusion flag and hyper-parameter row, and
a second table maps every chunk to its tensor; the table is built once per parameter list (keyed
by pointers, sizes, dtypes, flags, rows and the current stream, so that two streams never
share one table's scratch space) and cached. Pass 1 (one launch) writes per-chunk partial sums of
squares and finalises each tensor in the block that completes it; pass 2 (one launch) applies
the LARS momentum update or the LAMB update, leaving a layer whose norms are not finite (and its
optimizer state) untouched. See the .cu file for formulas.

Every launch is counted in :attr:`FusedTrust.counters`, with how many of its chunks take the
kernel's 16-byte vector path (the kernel's own alignment rule, evaluated on the host from the
table's pointers), so that a test can assert that padded gradient buckets are vectorised.

Sources: LARS, You, Gitman, Ginsburg 2017 (arXiv 1708.03888); LAMB, You et al., ICLR 2020
(arXiv 1904.00962); chunked multi-tensor launches, NVIDIA apex ``multi_tensor_apply``.

Everything here takes torch tensors; the launcher decides where kernels run: ``CupyLauncher``
on a GPU, or (tests only) the CPU emulator of ``kernels/testing`` on CPU tensors, so the host
logic below is exercised without a GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import numpy as np

from hpclb.errors import KernelCompileError

if TYPE_CHECKING:  # torch is imported lazily so kernels/testing can run this under ASan
    import torch
    from torch import Tensor

log = logging.getLogger(__name__)

#: Where the .cu source is looked for, in order: $HPCLB_KERNELS_DIR, the installed package's copy
#: (``hpclb/_kernels/``, put there by setup.py when a wheel is built), the repository's ``kernels/``.
PACKAGE_KERNELS_DIR = Path(__file__).resolve().parents[2] / "_kernels"
REPO_KERNELS_DIR = Path(__file__).resolve().parents[3] / "kernels"
KERNELS_DIR = Path(os.environ.get("HPCLB_KERNELS_DIR")
                   or next((d for d in (PACKAGE_KERNELS_DIR, REPO_KERNELS_DIR)
                            if (d / "trust_ratio.cu").is_file()), REPO_KERNELS_DIR))
KERNEL_PATH = KERNELS_DIR / "trust_ratio.cu"
#: NVRTC options hpclb hands CuPy (CuPy adds the architecture); the compile gate uses them too.
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)
#: kernel name -> the most threads per block its __launch_bounds__ allows
KERNELS: dict[str, int] = {"hl_norms_pass1": 1024, "hl_lars_apply": 1024,
                           "hl_lamb_pass1": 512, "hl_lamb_apply": 512}

# Layout constants shared with the .cu file (tests check that both agree).
DESC_WORDS = 8
HP_WORDS = 16
D_W, D_G, D_M, D_V, D_NUMEL, D_FIRST, D_META, D_ROW = range(8)
HP_LR, HP_ETA, HP_WD, HP_EPS, HP_BETA1, HP_BETA2, HP_BC1, HP_BC2, HP_OMB1, HP_OMB2 = range(10)
HP_TMIN, HP_TMAX = 10, 11   # trust-ratio clamp [min, max]; HP_TMAX = 0 means no clamp
F32, F16, BF16 = 0, 1, 2
MODE_LARS, MODE_LAMB_NORMS, MODE_LAMB_FUSED = 0, 1, 2

#: elements per chunk: 128 KiB of fp32 per array, 16 vector loads per thread at 512 threads
DEFAULT_CHUNK = 32768
DEFAULT_BLOCK = 512
_TABLE_CACHE_SIZE = 8


def kernel_source() -> str:
    """The exact text handed to NVRTC (``kernels/trust_ratio.cu``, unchanged), read from
    :data:`KERNEL_PATH`: ``$HPCLB_KERNELS_DIR``, else the wheel's ``hpclb/_kernels/``, else the
    repository's ``kernels/`` (editable install).

    Raises FileNotFoundError when none holds it (reinstall hpclb from a wheel or its repository,
    or point ``HPCLB_KERNELS_DIR`` at a ``kernels/`` directory)."""
    try:
        return KERNEL_PATH.read_text()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{KERNEL_PATH} not found: reinstall hpclb (a wheel ships "
                                "hpclb/_kernels/trust_ratio.cu; pip install -e . reads kernels/) "
                                "or set HPCLB_KERNELS_DIR to a directory holding it") from e


# ---------------------------------------------------------------------------------------------
# NVRTC through ctypes (no GPU needed): the compile gate, and a check users can run anywhere
# ---------------------------------------------------------------------------------------------

def find_nvrtc() -> str | None:
    """Path of libnvrtc: $HPCLB_NVRTC, the ``nvidia-cuda-nvrtc`` wheel, $CUDA_HOME, the system."""
    env = os.environ.get("HPCLB_NVRTC")
    if env:
        return env
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for pattern in ("cu13/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"):
            hits = sorted(p for p in glob.glob(os.path.join(root, pattern))
                          if "builtins" not in p and ".alt." not in p)
            if hits:
                return hits[0]
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                              "/usr/local/cuda")):
        hits = sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
        hits = [p for p in hits if "builtins" not in p and ".alt." not in p]
        if hits:
            return hits[0]
    return ctypes.util.find_library("nvrtc")


@functools.lru_cache(maxsize=None)
def _nvrtc(path: str) -> ctypes.CDLL:
    # NVRTC dlopens libnvrtc-builtins by soname; load the one beside it first so that a wheel's
    # copy (not on the loader's search path) is found.
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path),
                                                  "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
    lib = ctypes.CDLL(path)
    p, c = ctypes.c_void_p, ctypes.c_char_p
    lib.nvrtcGetErrorString.restype = c
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), c, c, ctypes.c_int, p, p]
    lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(c)]
    lib.nvrtcGetProgramLogSize.argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcGetCUBINSize.argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetCUBIN.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    return lib


def nvrtc_version(path: str | None = None) -> tuple[int, int]:
    """(major, minor) of the libnvrtc at ``path`` (default :func:`find_nvrtc`)."""
    lib = _nvrtc(path or _require_nvrtc())
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _require_nvrtc() -> str:
    path = find_nvrtc()
    if not path:
        raise FileNotFoundError("libnvrtc not found: pip install nvidia-cuda-nvrtc (the `test` "
                                "extra pins it) or set HPCLB_NVRTC")
    return path


def nvrtc_compile(source: str, arch: str = "sm_90", options: Sequence[str] = NVRTC_OPTIONS, *,
                  name: str = "trust_ratio.cu", nvrtc: str | None = None) -> tuple[bytes, str]:
    """Compile ``source`` with NVRTC for ``arch`` (e.g. ``"sm_80"``, ``"sm_90a"``); no GPU needed.

    Returns ``(cubin, log)``. Raises KernelCompileError (with NVRTC's log) when compilation
    fails, FileNotFoundError when no libnvrtc is found.
    """
    lib = _nvrtc(nvrtc or _require_nvrtc())
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc != 0:
        raise KernelCompileError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(rc).decode()}")
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        text = buf.value.decode(errors="replace")
        if rc != 0:
            raise KernelCompileError(f"NVRTC failed to compile {name} for {arch}: "
                                     f"{lib.nvrtcGetErrorString(rc).decode()}", text)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

_DTYPE_CODES: dict[Any, int] = {}


def dtype_code(dtype: "torch.dtype") -> int | None:
    """The kernel's code for a torch dtype (fp32, fp16, bf16), None for any other."""
    if not _DTYPE_CODES:
        import torch

        _DTYPE_CODES.update({torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16})
    return _DTYPE_CODES.get(dtype)


def build_layout(numels: Sequence[int] | np.ndarray, chunk_size: int) -> tuple[np.ndarray,
                                                                                np.ndarray]:
    """``(first_chunk int64[n], chunk_tensor int32[total])``: tensor i owns chunks
    ``first_chunk[i] : first_chunk[i] + max(1, ceil(numel_i / chunk_size))`` (an empty tensor
    owns one, so that it is finalised). Raises ValueError for a bad chunk size or > 2^31 chunks.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    numels = np.asarray(numels, dtype=np.int64)
    counts = np.maximum(1, -(-numels // chunk_size))
    first = np.zeros(len(numels), dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    total = int(counts.sum())
    if total >= 2 ** 31:
        raise ValueError(f"{total} chunks: more than a 32-bit grid index; raise chunk_size")
    return first, np.repeat(np.arange(len(numels), dtype=np.int32), counts)


class TrustResult(NamedTuple):
    """fp32 ``[n]`` tensors ``ratio``, ``w_norm``, ``o_norm`` (‖g‖ for LARS, ‖u‖ for LAMB) and
    ``nonfinite``, int32 ``[1]``: how many layers had a non-finite norm (device-side flag)."""

    ratio: "Tensor"
    w_norm: "Tensor"
    o_norm: "Tensor"
    nonfinite: "Tensor"


#: which arrays (desc slots) each kernel reads or writes, for the vector-path rule
_KERNEL_SLOTS: dict[str, tuple[int, ...]] = {
    "hl_norms_pass1": (D_W, D_G), "hl_lamb_pass1": (D_W, D_G, D_M, D_V),
    "hl_lars_apply": (D_W, D_G, D_M), "hl_lamb_apply": (D_W, D_G, D_M, D_V)}
_ELEMENT_BYTES = np.array([4, 2, 2], dtype=np.int64)   # indexed by F32, F16, BF16


def vector_chunks(desc: np.ndarray, chunk_tensor: np.ndarray, chunk_size: int,
                  slots: Sequence[int]) -> int:
    """How many chunks take the kernel's 16-byte vector path: those where every array of
    ``slots`` that is present (pointer != 0) is 16-byte aligned at the chunk's first element
    (``hl_chunk`` in the .cu file). ``desc``: int64 ``[n, DESC_WORDS]``; ``chunk_tensor``:
    int32 ``[n_chunks]``. Returns a count in ``[0, n_chunks]``."""
    owner = chunk_tensor.astype(np.int64)
    k = np.arange(len(owner), dtype=np.int64) - desc[owner, D_FIRST]
    size = _ELEMENT_BYTES[desc[:, D_META] & 0xFF]
    offset = (k * chunk_size * size[owner]).astype(np.uint64)
    ok = np.ones(len(owner), dtype=bool)
    for slot in slots:
        ptr = desc[owner, slot].view(np.uint64)
        ok &= (ptr == 0) | ((ptr + offset) % np.uint64(16) == 0)
    return int(ok.sum())


class _Table:
    """Device-side tables for one parameter list (see the module docstring), and the number of
    vectorised chunks per kernel (``vector[kernel]``)."""

    def __init__(self, desc: np.ndarray, chunk_tensor: np.ndarray, device: "torch.device",
                 chunk_size: int, stream: int = 0):
        import torch

        self.n = desc.shape[0]
        self.n_chunks = int(chunk_tensor.shape[0])
        self.stream = stream
        self.vector = {k: vector_chunks(desc, chunk_tensor, chunk_size, slots)
                       for k, slots in _KERNEL_SLOTS.items()}
        self.desc = torch.from_numpy(desc.reshape(-1)).to(device, non_blocking=True)
        self.chunk_tensor = torch.from_numpy(chunk_tensor).to(device, non_blocking=True)
        self.partials = torch.empty(2 * self.n_chunks, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(self.n, dtype=torch.int32, device=device)


def _ptr(t: "Tensor | None") -> int:
    return 0 if t is None else t.data_ptr()


def _u64(x: int) -> np.uint64:
    return np.uint64(x)


def _hp_vector(x: Any, n: int) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim == 0:
        return np.full(n, a, dtype=np.float32)
    if a.shape != (n,):
        raise ValueError(f"hyper-parameter of shape {a.shape}, expected a scalar or ({n},)")
    return a


class FusedTrust:
    """All layers' norms, trust ratios and LARS/LAMB updates in one or two kernel launches.

    Args:
        launcher: where kernels run (CupyLauncher, or the tests' CPU emulator).
        chunk_size: elements per chunk (>= 1). block: threads per block, a multiple of 32, at
            most 1024 (512 for the LAMB kernels, which then use 512).
    Tensors passed to any method must be on ``launcher.device``, contiguous, fp32/fp16/bf16
    (:meth:`why_not` says what is wrong; float64 is refused: the kernel accumulates in fp32);
    per layer, w/g/m/v share shape and dtype. Raises ValueError otherwise, before any launch.
    Methods never synchronise with the host.

    ``counters``: ``launches``, ``chunks`` and ``vector_chunks`` (chunks on the 16-byte vector
    path) summed over launches, and ``vector_launches`` (launches whose every chunk was
    vectorised). Tables and their scratch space are cached per stream
    (``launcher.stream_key()``, 0 for a launcher without streams).
    """

    def __init__(self, launcher: Any, *, chunk_size: int = DEFAULT_CHUNK,
                 block: int = DEFAULT_BLOCK):
        if block % 32 or not 32 <= block <= 1024:
            raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.launcher = launcher
        self.device = launcher.device
        self.chunk_size = int(chunk_size)
        self.block = int(block)
        self._layouts: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._tables: OrderedDict[bytes, _Table] = OrderedDict()
        self.counters = {"launches": 0, "vector_launches": 0, "chunks": 0, "vector_chunks": 0}

    # -- checks and tables ----------------------------------------------------------------------
    def why_not(self, *lists: Sequence["Tensor | None"],
                names: Sequence[str] | None = None) -> str | None:
        """None when the kernel takes these layer-aligned lists (weights first): every tensor on
        this device, dense, contiguous, fp32/fp16/bf16, each layer's tensors of one numel and
        dtype. Otherwise the first reason, naming the layer (``names[i]`` or its index)."""
        import torch

        first = lists[0] if lists else ()
        for ts in lists:
            if len(ts) != len(first):
                return f"lists of {len(first)} and {len(ts)} tensors"
            for i, (w, t) in enumerate(zip(first, ts)):
                if t is None:
                    continue
                layer = f"layer {names[i]!r}" if names else f"layer {i}"
                if dtype_code(t.dtype) is None:
                    return (f"{layer} is {t.dtype}; the fused kernel takes float32, float16 and "
                            "bfloat16 (it accumulates in fp32)")
                if t.device != self.device:
                    return f"{layer} is on {t.device}, the kernel's device is {self.device}"
                if t.layout != torch.strided or not t.is_contiguous():
                    return f"{layer} is not a dense contiguous tensor"
                if t.dtype != w.dtype or t.numel() != w.numel():
                    return f"{layer}: its tensors differ in dtype or size"
        return None

    def supports(self, *lists: Sequence["Tensor | None"]) -> bool:
        """True when :meth:`why_not` finds nothing against these lists."""
        return self.why_not(*lists) is None

    def _layout(self, numels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = (numels.tobytes(), self.chunk_size)
        hit = self._layouts.get(key)
        if hit is None:
            hit = build_layout(numels, self.chunk_size)
            self._layouts[key] = hit
            while len(self._layouts) > _TABLE_CACHE_SIZE:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return hit

    def table(self, w: Sequence["Tensor"], g: Sequence["Tensor | None"] | None = None,
              m: Sequence["Tensor"] | None = None, v: Sequence["Tensor"] | None = None, *,
              adapt: Sequence[bool] | None = None, rows: Sequence[int] | None = None) -> _Table:
        """The cached device table for these tensors (built and uploaded on a miss)."""
        n = len(w)
        for name, other in (("g", g), ("m", m), ("v", v)):
            if other is not None and len(other) != n:
                raise ValueError(f"{n} weights but {len(other)} {name} tensors")
        reason = self.why_not(w, *(x for x in (g, m, v) if x is not None))
        if reason is not None:
            raise ValueError(f"fused trust-ratio kernel: {reason}; use the torch path "
                             "(hpclb.optim.trust, or HPCLB_TRUST_BACKEND=torch)")
        numels = np.fromiter((t.numel() for t in w), dtype=np.int64, count=n)
        desc = np.zeros((n, DESC_WORDS), dtype=np.int64)
        desc[:, D_NUMEL] = numels
        desc[:, D_FIRST], chunk_tensor = self._layout(numels)
        codes = np.fromiter((dtype_code(t.dtype) for t in w), dtype=np.int64, count=n)
        flags = np.ones(n, dtype=np.int64) if adapt is None else \
            np.fromiter((bool(a) for a in adapt), dtype=np.int64, count=n)
        if len(flags) != n:
            raise ValueError(f"{n} weights but {len(flags)} adapt flags")
        desc[:, D_META] = codes | (flags << 8)
        desc[:, D_ROW] = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)
        for slot, ts in ((D_W, w), (D_G, g), (D_M, m), (D_V, v)):
            if ts is None:
                continue
            for i, t in enumerate(ts):
                if t is None:
                    continue
                if t.numel() != numels[i] or dtype_code(t.dtype) != codes[i]:
                    raise ValueError(f"layer {i}: tensors of one layer differ in size or dtype "
                                     f"({tuple(w[i].shape)} {w[i].dtype} vs {tuple(t.shape)} "
                                     f"{t.dtype})")
            desc[:, slot] = np.fromiter((_ptr(t) for t in ts), dtype=np.uint64,
                                        count=n).view(np.int64)
        stream = int(getattr(self.launcher, "stream_key", lambda: 0)())
        key = desc.tobytes() + np.int64(self.chunk_size).tobytes() + np.int64(stream).tobytes()
        tab = self._tables.get(key)
        if tab is None:
            tab = _Table(desc, chunk_tensor, self.device, self.chunk_size, stream)
            self._tables[key] = tab
            while len(self._tables) > _TABLE_CACHE_SIZE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return tab

    def _upload_hp(self, hp: "np.ndarray | Tensor") -> "Tensor":
        import torch

        if isinstance(hp, torch.Tensor):
            return hp.to(self.device, torch.float32).contiguous()
        return torch.from_numpy(np.ascontiguousarray(hp, dtype=np.float32)).to(
            self.device, non_blocking=True)

    def _outputs(self, n: int, out: TrustResult | None) -> TrustResult:
        import torch

        if out is not None:
            if any(t.device != self.device or not t.is_contiguous() for t in out) or \
                    out.nonfinite.dtype != torch.int32 or \
                    any(t.dtype != torch.float32 or t.numel() != n for t in out[:3]):
                raise ValueError("out: contiguous fp32 [n] x3 and int32 [1] on the device")
            out.nonfinite.zero_()
            return out
        buf = torch.empty(3 * n, dtype=torch.float32, device=self.device)
        return TrustResult(buf[:n], buf[n:2 * n], buf[2 * n:],
                           torch.zeros(1, dtype=torch.int32, device=self.device))

    def _block(self, kernel: str) -> int:
        return min(self.block, KERNELS[kernel])

    def _count(self, kernel: str, tab: _Table) -> None:
        vec = tab.vector[kernel]
        c = self.counters
        c["launches"] += 1
        c["chunks"] += tab.n_chunks
        c["vector_chunks"] += vec
        c["vector_launches"] += vec == tab.n_chunks

    def _pass1(self, kernel: str, tab: _Table, hp: "Tensor", mode: int,
               res: TrustResult) -> None:
        self._count(kernel, tab)
        block = self._block(kernel)
        self.launcher.launch(kernel, self.launcher.grid_for(tab.n_chunks, block), block, (
            _u64(tab.desc.data_ptr()), _u64(tab.chunk_tensor.data_ptr()),
            np.int32(tab.n_chunks), np.int32(self.chunk_size), _u64(hp.data_ptr()),
            np.int32(mode), _u64(tab.partials.data_ptr()), _u64(tab.tickets.data_ptr()),
            _u64(res.ratio.data_ptr()), _u64(res.w_norm.data_ptr()),
            _u64(res.o_norm.data_ptr()), _u64(res.nonfinite.data_ptr())))

    def _pass2(self, kernel: str, tab: _Table, hp: "Tensor", res: TrustResult) -> None:
        self._count(kernel, tab)
        block = self._block(kernel)
        self.launcher.launch(kernel, self.launcher.grid_for(tab.n_chunks, block), block, (
            _u64(tab.desc.data_ptr()), _u64(tab.chunk_tensor.data_ptr()),
            np.int32(tab.n_chunks), np.int32(self.chunk_size), _u64(hp.data_ptr()),
            _u64(res.ratio.data_ptr()), _u64(res.w_norm.data_ptr()),
            _u64(res.o_norm.data_ptr())))

    def _empty(self) -> TrustResult:
        import torch

        z = torch.zeros(0, dtype=torch.float32, device=self.device)
        return TrustResult(z, z.clone(), z.clone(),
                           torch.zeros(1, dtype=torch.int32, device=self.device))

    # -- public operations -----------------------------------------------------------------------
    def norms(self, tensors: Sequence["Tensor"], *, out: TrustResult | None = None) -> "Tensor":
        """fp32 ``[n]`` L2 norms of ``tensors`` (fp32 accumulation)."""
        return self.lars_ratios(tensors, None, trust_coefficient=1.0, weight_decay=0.0, eps=0.0,
                                adapt=[False] * len(tensors), out=out).w_norm

    def lars_ratios(self, weights: Sequence["Tensor"], grads: Sequence["Tensor | None"] | None,
                    *, trust_coefficient: Any, weight_decay: Any, eps: Any,
                    adapt: Sequence[bool], clamp_min: Any = 0.0, clamp_max: Any = 0.0,
                    out: TrustResult | None = None) -> TrustResult:
        """LARS ``eta*|w|/(|g| + wd*|w| + eps)`` per layer (1 when excluded or a norm is 0),
        clamped to ``[clamp_min, clamp_max]`` where ``clamp_max > 0`` (0: no clamp).

        Hyper-parameters: floats or length-n sequences (or fp32 tensors [n]). A missing
        gradient (None, or ``grads`` None) counts as zeros. ``out``: preallocated outputs.
        """
        n = len(weights)
        if n == 0:
            return self._empty()
        tab = self.table(weights, grads, adapt=adapt)
        hp = self._layer_hp(n, {HP_ETA: trust_coefficient, HP_WD: weight_decay, HP_EPS: eps,
                                HP_TMIN: clamp_min, HP_TMAX: clamp_max})
        res = self._outputs(n, out)
        self._pass1("hl_norms_pass1", tab, hp, MODE_LARS, res)
        return res

    def lamb_ratios(self, weights: Sequence["Tensor"], updates: Sequence["Tensor"], *,
                    adapt: Sequence[bool], clamp_min: Any = 0.0, clamp_max: Any = 0.0,
                    out: TrustResult | None = None) -> TrustResult:
        """LAMB ``|w|/|u|`` per layer for given updates ``u`` (1 when excluded or a norm is 0),
        clamped as in :meth:`lars_ratios`."""
        n = len(weights)
        if n == 0:
            return self._empty()
        tab = self.table(weights, updates, adapt=adapt)
        hp = self._layer_hp(n, {HP_TMIN: clamp_min, HP_TMAX: clamp_max})
        res = self._outputs(n, out)
        self._pass1("hl_norms_pass1", tab, hp, MODE_LAMB_NORMS, res)
        return res

    def _layer_hp(self, n: int, values: dict[int, Any]) -> "Tensor":
        import torch

        if any(isinstance(v, torch.Tensor) for v in values.values()):
            hp = torch.zeros(n, HP_WORDS, dtype=torch.float32, device=self.device)
            for slot, v in values.items():
                hp[:, slot] = torch.as_tensor(v, dtype=torch.float32, device=self.device)
            return hp
        hp = np.zeros((n, HP_WORDS), dtype=np.float32)
        for slot, v in values.items():
            hp[:, slot] = _hp_vector(v, n)
        return self._upload_hp(hp)

    def lars_step(self, params: Sequence["Tensor"], grads: Sequence["Tensor"],
                  momentum_buffers: Sequence["Tensor"], hp_rows: np.ndarray,
                  rows: Sequence[int], adapt: Sequence[bool], *,
                  out: TrustResult | None = None) -> TrustResult:
        """One LARS step for every layer, in place (pass 1 + pass 2; hpclb/optim/lars.py math):
        ``v <- m*v + lr*ratio*(g + wd*w); w <- w - v``; excluded layers: ratio 1, wd 0; a layer
        whose ``|w|`` or ``|g|`` is not finite keeps its ``w`` and ``v``.

        ``hp_rows``: float32 ``[R, HP_WORDS]`` (HP_LR, HP_ETA, HP_WD, HP_EPS, HP_BETA1 =
        momentum, HP_TMIN/HP_TMAX = trust-ratio clamp or 0); ``rows[i]``: layer i's row.
        Returns the pass-1 results (``nonfinite``: how many layers were left untouched).
        """
        n = len(params)
        if n == 0:
            return self._empty()
        tab = self.table(params, grads, momentum_buffers, adapt=adapt, rows=rows)
        hp = self._upload_hp(hp_rows)
        res = self._outputs(n, out)
        self._pass1("hl_norms_pass1", tab, hp, MODE_LARS, res)
        self._pass2("hl_lars_apply", tab, hp, res)
        return res

    def lamb_step(self, params: Sequence["Tensor"], grads: Sequence["Tensor"],
                  exp_avgs: Sequence["Tensor"], exp_avg_sqs: Sequence["Tensor"],
                  hp_rows: np.ndarray, rows: Sequence[int], adapt: Sequence[bool], *,
                  out: TrustResult | None = None) -> TrustResult:
        """One LAMB step for every layer, in place (hpclb/optim/lamb.py math): pass 1 forms the
        new moments and ``u`` (storing neither) and the norms; pass 2 stores the moments and
        applies ``w <- w - lr*ratio*u``, except for a layer whose ``|w|`` or ``|u|`` is not
        finite, whose ``w``, ``m`` and ``v`` stay as they were.

        ``hp_rows``: float32 ``[R, HP_WORDS]`` with HP_LR, HP_WD, HP_EPS, HP_BETA1, HP_BETA2,
        HP_BC1 = 1-beta1^t, HP_BC2 = 1-beta2^t, HP_OMB1 = 1-beta1, HP_OMB2 = 1-beta2,
        HP_TMIN/HP_TMAX (trust-ratio clamp, or 0).
        """
        n = len(params)
        if n == 0:
            return self._empty()
        tab = self.table(params, grads, exp_avgs, exp_avg_sqs, adapt=adapt, rows=rows)
        hp = self._upload_hp(hp_rows)
        res = self._outputs(n, out)
        self._pass1("hl_lamb_pass1", tab, hp, MODE_LAMB_FUSED, res)
        self._pass2("hl_lamb_apply", tab, hp, res)
        return res


# ---------------------------------------------------------------------------------------------
# Which devices get the fused path
# ---------------------------------------------------------------------------------------------

_FUSED: dict[str, FusedTrust] = {}
_OVERRIDES: dict[str, FusedTrust] = {}


def fused_for(device: "torch.device | str") -> FusedTrust | None:
    """The FusedTrust serving ``device``: an installed override (tests), else CuPy's for a CUDA
    device when CuPy imports; None means the torch path. Respects ``HPCLB_TRUST_BACKEND=torch``.
    """
    import torch

    device = torch.device(device)
    key = str(device)
    if key in _OVERRIDES:
        return _OVERRIDES[key]
    if os.environ.get("HPCLB_TRUST_BACKEND", "auto") == "torch" or device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
    hit = _FUSED.get(key)
    if hit is None:
        if not cupy_available():
            return None
        hit = _FUSED[key] = FusedTrust(CupyLauncher(device))
    return hit


@contextlib.contextmanager
def use_fused(device: "torch.device | str", fused: FusedTrust | None) -> Iterator[None]:
    """Within the block, ``fused_for(device)`` returns ``fused`` (e.g. the CPU emulator in the
    tests; None removes an override only)."""
    import torch

    key = str(torch.device(device))
    before = _OVERRIDES.get(key)
    if fused is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = fused
    try:
        yield
    finally:
        if before is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = before
