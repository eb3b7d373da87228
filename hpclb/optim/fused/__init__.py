"""Fused per-layer norms, trust ratios and LARS/LAMB updates: ``kernels/trust_ratio.cu`` on GPU.

The CUDA C in ``kernels/trust_ratio.cu`` is compiled at run time by CuPy (``cupy.RawModule``,
NVRTC; cached by CuPy on disk and here per process) and launched on **torch's current stream**
with raw device pointers (``np.uint64``) and ``np.int32``/``np.float32`` scalars, so torch
tensors are used in place: nothing is copied, nothing is converted through DLPack, and no call
synchronises with the host (no ``.item()``). CuPy is imported lazily, only when a CUDA tensor
asks for the fused path; it is the ``gpu-cuda12`` / ``gpu-cuda13`` extra (``pip install -e
'.[gpu-cuda13]'``, the one of torch's CUDA major version), absent in CI.

Scheme (NVIDIA apex's multi_tensor_apply / multi_tensor_l2norm design, written anew): every
tensor is cut into chunks of ``chunk_size`` elements; a table in device memory holds, per tensor,
its pointers (w, g, m, v), numel, first chunk, dtype, exclusion flag and hyper-parameter row, and
a second table maps every chunk to its tensor; the tensors are checked and the table is built
once per tensor set (keyed by the tensors' addresses, flags, rows and the current stream, so
that two streams never share one table's scratch space) and cached. Pass 1 (one launch)
writes per-chunk partial sums of squares and finalises each tensor in the block that completes
it; pass 2 (one launch) applies the LARS momentum update or the LAMB update, leaving a layer
whose norms are not finite (and its optimizer state) untouched. See the .cu file for formulas.

Every launch is counted in :attr:`FusedTrust.counters`, with how many of its chunks take the
kernel's 16-byte vector path (the kernel's own alignment rule, evaluated on the host from the
table's pointers), so that a test can assert that padded gradient buckets are vectorised.

Sources: LARS, You, Gitman, Ginsburg 2017 (arXiv 1708.03888); LAMB, You et al., ICLR 2020
(arXiv 1904.00962); chunked multi-tensor launches, NVIDIA apex ``multi_tensor_apply``.

Everything here takes torch tensors; the launcher decides where kernels run: ``CupyLauncher``
on a GPU, or (tests only) the CPU emulator of ``kernels/testing`` on CPU tensors, so the host
logic is exercised without a GPU.

The pieces, one concept a module: :mod:`.source` (where the .cu file is), :mod:`.nvrtc` (compiling
it with NVRTC through ctypes, no GPU), :mod:`.launcher` (CuPy on a GPU), :mod:`.layout` (tables and
constants shared with the .cu file), :mod:`.trust` (FusedTrust, fused_for, use_fused).
"""
from __future__ import annotations

from hpclb.errors import KernelCompileError
from hpclb.optim.fused.launcher import CupyLauncher, cupy_available
from hpclb.optim.fused.layout import (
    BF16,
    D_FIRST,
    D_G,
    D_M,
    D_META,
    D_NUMEL,
    D_ROW,
    D_V,
    D_W,
    DESC_WORDS,
    F16,
    F32,
    HP_BC1,
    HP_BC2,
    HP_BETA1,
    HP_BETA2,
    HP_EPS,
    HP_ETA,
    HP_LR,
    HP_OMB1,
    HP_OMB2,
    HP_TMAX,
    HP_TMIN,
    HP_WD,
    HP_WORDS,
    MODE_LAMB_FUSED,
    MODE_LAMB_NORMS,
    MODE_LARS,
    build_layout,
    vector_chunks,
)
from hpclb.optim.fused.nvrtc import find_nvrtc, nvrtc_compile, nvrtc_version
from hpclb.optim.fused.source import (
    KERNEL_PATH,
    KERNELS,
    NVRTC_OPTIONS,
    kernel_source,
)
from hpclb.optim.fused.trust import (
    SERVED,
    FusedTrust,
    TrustResult,
    fused_for,
    is_backend_error,
    refuse,
    use_fused,
)

__all__ = [
    "BF16", "D_FIRST", "D_G", "D_M", "D_META", "D_NUMEL", "D_ROW", "D_V", "D_W", "DESC_WORDS",
    "F16", "F32", "HP_BC1", "HP_BC2", "HP_BETA1", "HP_BETA2", "HP_EPS", "HP_ETA", "HP_LR",
    "HP_OMB1", "HP_OMB2", "HP_TMAX", "HP_TMIN", "HP_WD", "HP_WORDS", "KERNEL_PATH", "KERNELS",
    "MODE_LAMB_FUSED", "MODE_LAMB_NORMS", "MODE_LARS", "NVRTC_OPTIONS", "SERVED", "CupyLauncher",
    "FusedTrust", "KernelCompileError", "TrustResult", "build_layout", "cupy_available",
    "find_nvrtc", "fused_for", "is_backend_error", "kernel_source", "nvrtc_compile",
    "nvrtc_version", "refuse", "use_fused", "vector_chunks"]
