"""The layout the kernels read: constants shared with the .cu file, the per-tensor descriptor
table, the chunk-to-tensor map, and which chunks take the 16-byte vector path."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily so kernels/testing can run this under ASan
    import torch

__all__ = [
    "BF16", "DEFAULT_BLOCK", "DEFAULT_CHUNK", "DESC_WORDS", "D_FIRST", "D_G", "D_M", "D_META",
    "D_NUMEL", "D_ROW", "D_V", "D_W", "F16", "F32", "HP_BC1", "HP_BC2", "HP_BETA1", "HP_BETA2",
    "HP_EPS", "HP_ETA", "HP_LR", "HP_OMB1", "HP_OMB2", "HP_TMAX", "HP_TMIN", "HP_WD", "HP_WORDS",
    "MODE_LAMB_FUSED", "MODE_LAMB_NORMS", "MODE_LARS", "Table", "build_layout", "dtype_code",
    "upload", "vector_chunks"]

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


def upload(host: np.ndarray, device: "torch.device", pinned: bool) -> tuple["torch.Tensor",
                                                                            "torch.Tensor"]:
    """``(on_device, source)``: a copy of ``host`` on ``device``, queued on the device's current
    stream without waiting (``non_blocking``). With ``pinned`` (a CUDA device) the source is a
    page-locked copy of ``host``, so the copy is truly asynchronous (from pageable memory CUDA
    stages it and the host waits). The caller keeps ``source`` alive until the copy is done
    (:class:`Table` keeps it as long as the table lives)."""
    import torch

    src = torch.from_numpy(np.ascontiguousarray(host))
    if pinned:
        src = src.pin_memory()
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    dst.copy_(src, non_blocking=True)
    return dst, src


class Table:
    """Device-side tables for one parameter list (see the module docstring), and the number of
    vectorised chunks per kernel (``vector[kernel]``). Uploaded once, at construction, from
    pinned host memory when ``pinned`` (:func:`upload`); the host copies live as long as the
    table (``host``)."""

    def __init__(self, desc: np.ndarray, chunk_tensor: np.ndarray, device: "torch.device",
                 chunk_size: int, stream: int = 0, *, pinned: bool = False):
        import torch

        self.n = desc.shape[0]
        self.n_chunks = int(chunk_tensor.shape[0])
        self.stream = stream
        self.vector = {k: vector_chunks(desc, chunk_tensor, chunk_size, slots)
                       for k, slots in _KERNEL_SLOTS.items()}
        self.desc, desc_host = upload(desc.reshape(-1), device, pinned)
        self.chunk_tensor, chunk_host = upload(chunk_tensor, device, pinned)
        self.host = (desc_host, chunk_host)
        self.partials = torch.empty(2 * self.n_chunks, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(self.n, dtype=torch.int32, device=device)

