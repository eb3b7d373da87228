"""FusedTrust (all layers' norms, trust ratios and LARS/LAMB updates in one or two launches) and
which devices get it (:func:`fused_for`, :func:`use_fused`)."""
from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import numpy as np

from hpclb.errors import KernelCompileError
from hpclb.optim.fused.launcher import CUPY_CACHE_ENV, CupyLauncher, cupy_available
from hpclb.optim.fused.layout import (
    D_FIRST,
    D_G,
    D_M,
    D_META,
    D_NUMEL,
    D_ROW,
    D_V,
    D_W,
    DEFAULT_BLOCK,
    DEFAULT_CHUNK,
    DESC_WORDS,
    HP_EPS,
    HP_ETA,
    HP_TMAX,
    HP_TMIN,
    HP_WD,
    HP_WORDS,
    MODE_LAMB_FUSED,
    MODE_LAMB_NORMS,
    MODE_LARS,
    Table,
    build_layout,
    dtype_code,
    upload,
)
from hpclb.optim.fused.source import KERNELS

if TYPE_CHECKING:  # torch is imported lazily so kernels/testing can run this under ASan
    import torch
    from torch import Tensor

__all__ = ["SERVED", "FusedTrust", "TrustResult", "fused_for", "is_backend_error", "refuse",
           "use_fused"]

_TABLE_CACHE_SIZE = 8
#: kind -> (pass-1 kernel, pass-2 kernel, pass-1 mode)
_STEPS = {"lars": ("hl_norms_pass1", "hl_lars_apply", MODE_LARS),
          "lamb": ("hl_lamb_pass1", "hl_lamb_apply", MODE_LAMB_FUSED)}
log = logging.getLogger(__name__)


class TrustResult(NamedTuple):
    """fp32 ``[n]`` tensors ``ratio``, ``w_norm``, ``o_norm`` (‖g‖ for LARS, ‖u‖ for LAMB) and
    ``nonfinite``, int32 ``[1]``: how many layers had a non-finite norm (device-side flag)."""

    ratio: "Tensor"
    w_norm: "Tensor"
    o_norm: "Tensor"
    nonfinite: "Tensor"



def _ptr(t: "Tensor | None") -> int:
    return 0 if t is None else t.data_ptr()


def _addresses(lists: Sequence[Sequence["Tensor | None"] | None]) -> tuple | None:
    """Every tensor's address, list by list (None for a missing list, 0 for a missing tensor):
    the cache key of the checks and tables; None when a tensor has no address (sparse)."""
    try:
        return tuple(None if ts is None else tuple([0 if t is None else t.data_ptr()
                                                    for t in ts]) for ts in lists)
    except RuntimeError:
        return None


def _remember(cache: OrderedDict, key: tuple, value: Any) -> None:
    cache[key] = value
    while len(cache) > _TABLE_CACHE_SIZE:
        cache.popitem(last=False)


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
    path) summed over launches, ``vector_launches`` (launches whose every chunk was
    vectorised), ``validations`` (full checks of the tensors, :meth:`why_not`), ``tables``
    (descriptor tables built and uploaded, :meth:`table`) and ``hp_uploads`` (hyper-parameter
    rows copied to the device, :meth:`upload_hp`).

    Caching: a step passes the same tensors every time (parameters, bucket views, optimizer
    state), so the checks and the table are done once per *tensor set*, keyed by every tensor's
    address (``data_ptr``, in list order; one cheap call per tensor), the layer flags and rows,
    and the stream (``launcher.stream_key()``, 0 for a launcher without streams): tables and
    their scratch space are per stream. A new tensor set (a model moved, cast or rebuilt, a
    ``set_to_none`` gradient at a new address) is checked and tabled again. Not seen: an
    in-place metadata change that keeps every address (``resize_``, ``t_()`` on a parameter).
    """

    def __init__(self, launcher: Any, *, chunk_size: int = DEFAULT_CHUNK,
                 block: int = DEFAULT_BLOCK):
        if block % 32 or not 32 <= block <= 1024:
            raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.launcher = launcher
        self.device = launcher.device
        #: host-to-device copies (tables, hyper-parameters) from pinned memory: a CUDA device,
        #: unless the launcher says otherwise (``pinned_uploads``)
        self.pinned = bool(getattr(launcher, "pinned_uploads", self.device.type == "cuda"))
        self.chunk_size = int(chunk_size)
        self.block = int(block)
        self._layouts: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._tables: OrderedDict[tuple, Table] = OrderedDict()
        self._valid: OrderedDict[tuple, None] = OrderedDict()
        self.counters = {"launches": 0, "vector_launches": 0, "chunks": 0, "vector_chunks": 0,
                         "validations": 0, "tables": 0, "hp_uploads": 0}

    # -- checks and tables ----------------------------------------------------------------------
    def why_not(self, *lists: Sequence["Tensor | None"],
                names: Sequence[str] | None = None) -> str | None:
        """None when the kernel takes these layer-aligned lists (weights first): every tensor on
        this device, dense, contiguous, fp32/fp16/bf16, each layer's tensors of one numel and
        dtype. Otherwise the first reason, naming the layer (``names[i]`` or its index).
        A tensor set found fit is remembered (class docstring): checked once, not per step."""
        key = _addresses(lists)
        if key is not None and key in self._valid:
            self._valid.move_to_end(key)
            return None
        self.counters["validations"] += 1
        reason = self._check(lists, names)
        if reason is None and key is not None:
            _remember(self._valid, key, None)
        return reason

    def _check(self, lists, names) -> str | None:
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
              adapt: Sequence[bool] | None = None, rows: Sequence[int] | None = None) -> Table:
        """The cached device table for these tensors (checked, built and uploaded on a miss;
        see the class docstring for the key). Raises ValueError when the kernel cannot take
        them (:meth:`why_not`) or the lists' lengths differ."""
        stream = int(getattr(self.launcher, "stream_key", lambda: 0)())
        key = (_addresses((w, g, m, v)), None if adapt is None else tuple(adapt),
               None if rows is None else tuple(rows), stream, self.chunk_size)
        tab = self._tables.get(key) if key[0] is not None else None
        if tab is not None:
            self._tables.move_to_end(key)
            return tab
        tab = self._build_table(w, g, m, v, adapt, rows, stream)
        self.counters["tables"] += 1
        if key[0] is not None:
            _remember(self._tables, key, tab)
        return tab

    def _build_table(self, w, g, m, v, adapt, rows, stream: int) -> Table:
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
        return Table(desc, chunk_tensor, self.device, self.chunk_size, stream,
                     pinned=self.pinned)

    def upload_hp(self, hp: "np.ndarray | Tensor") -> tuple["Tensor", Any]:
        """``(on_device, source)``: hyper-parameter rows (float32 ``[R, HP_WORDS]``) on the
        device, copied from pinned memory without waiting (:func:`~.layout.upload`); keep
        ``source`` alive until the copy is done (the next upload, or the step's end)."""
        import torch

        self.counters["hp_uploads"] += 1
        if isinstance(hp, torch.Tensor):
            return hp.to(self.device, torch.float32).contiguous(), hp
        return upload(np.ascontiguousarray(hp, dtype=np.float32), self.device, self.pinned)

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

    def _count(self, kernel: str, tab: Table) -> None:
        vec = tab.vector[kernel]
        c = self.counters
        c["launches"] += 1
        c["chunks"] += tab.n_chunks
        c["vector_chunks"] += vec
        c["vector_launches"] += vec == tab.n_chunks

    def _pass1(self, kernel: str, tab: Table, hp: "Tensor", mode: int,
               res: TrustResult, found_inf: int = 0) -> None:
        self._count(kernel, tab)
        block = self._block(kernel)
        self.launcher.launch(kernel, self.launcher.grid_for(tab.n_chunks, block, kernel), block, (
            _u64(tab.desc.data_ptr()), _u64(tab.chunk_tensor.data_ptr()),
            np.int32(tab.n_chunks), np.int32(self.chunk_size), _u64(hp.data_ptr()),
            np.int32(mode), _u64(tab.partials.data_ptr()), _u64(tab.tickets.data_ptr()),
            _u64(res.ratio.data_ptr()), _u64(res.w_norm.data_ptr()),
            _u64(res.o_norm.data_ptr()), _u64(res.nonfinite.data_ptr()), _u64(found_inf)))

    def _pass2(self, kernel: str, tab: Table, hp: "Tensor", res: TrustResult,
               found_inf: int) -> None:
        self._count(kernel, tab)
        block = self._block(kernel)
        self.launcher.launch(kernel, self.launcher.grid_for(tab.n_chunks, block, kernel), block, (
            _u64(tab.desc.data_ptr()), _u64(tab.chunk_tensor.data_ptr()),
            np.int32(tab.n_chunks), np.int32(self.chunk_size), _u64(hp.data_ptr()),
            _u64(res.ratio.data_ptr()), _u64(res.w_norm.data_ptr()),
            _u64(res.o_norm.data_ptr()), _u64(found_inf)))

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
        return self.upload_hp(hp)[0]

    def lars_step(self, params: Sequence["Tensor"], grads: Sequence["Tensor"],
                  momentum_buffers: Sequence["Tensor"], hp_rows: np.ndarray,
                  rows: Sequence[int], adapt: Sequence[bool], *, found_inf: "Tensor | None" = None,
                  out: TrustResult | None = None) -> TrustResult:
        """One LARS step for every layer, in place (pass 1 + pass 2; hpclb/optim/lars.py math):
        ``v <- m*v + lr*ratio*(g + wd*w); w <- w - v``; excluded layers: ratio 1, wd 0; a layer
        whose ``|w|`` or ``|g|`` is not finite keeps its ``w`` and ``v``.

        ``hp_rows``: float32 ``[R, HP_WORDS]`` (HP_LR, HP_ETA, HP_WD, HP_EPS, HP_BETA1 =
        momentum, HP_TMIN/HP_TMAX = trust-ratio clamp or 0); ``rows[i]``: layer i's row.
        ``found_inf``: see :meth:`run_step`. Returns the pass-1 results (``nonfinite``: how many
        layers were left untouched).
        """
        n = len(params)
        if n == 0:
            return self._empty()
        tab = self.table(params, grads, momentum_buffers, adapt=adapt, rows=rows)
        return self.run_step("lars", tab, self.upload_hp(hp_rows)[0], found_inf=found_inf, out=out)

    def run_step(self, kind: str, tab: Table, hp: "Tensor", *, found_inf: "Tensor | None" = None,
                 out: TrustResult | None = None) -> TrustResult:
        """Both passes of one ``kind`` (``"lars"`` or ``"lamb"``) step over the tensors of
        ``tab`` (a :meth:`table` of weights, gradients and state, held by the caller's step
        plan) with the device hyper-parameter rows ``hp``: what :meth:`lars_step` and
        :meth:`lamb_step` do once the table is found. ``found_inf``: torch's found-inf flag
        (0-d tensor; not 0 = skip), handed to both kernels: when set, the norms and ratios are
        still written, every layer is counted in ``nonfinite`` and nothing is updated (decided
        on the device, no host read). Returns the pass-1 results."""
        import torch

        pass1, pass2, mode = _STEPS[kind]
        res = self._outputs(tab.n, out)
        flag = None if found_inf is None else found_inf.to(self.device, torch.float32)
        ptr = 0 if flag is None else flag.data_ptr()
        self._pass1(pass1, tab, hp, mode, res, ptr)
        self._pass2(pass2, tab, hp, res, ptr)
        return res

    def lamb_step(self, params: Sequence["Tensor"], grads: Sequence["Tensor"],
                  exp_avgs: Sequence["Tensor"], exp_avg_sqs: Sequence["Tensor"],
                  hp_rows: np.ndarray, rows: Sequence[int], adapt: Sequence[bool], *,
                  found_inf: "Tensor | None" = None,
                  out: TrustResult | None = None) -> TrustResult:
        """One LAMB step for every layer, in place (hpclb/optim/lamb.py math): pass 1 forms the
        new moments and ``u`` (storing neither) and the norms; pass 2 stores the moments and
        applies ``w <- w - lr*ratio*u``, except for a layer whose ``|w|`` or ``|u|`` is not
        finite, whose ``w``, ``m`` and ``v`` stay as they were.

        ``hp_rows``: float32 ``[R, HP_WORDS]`` with HP_LR, HP_WD, HP_EPS, HP_BETA1, HP_BETA2,
        HP_BC1 = 1-beta1^t, HP_BC2 = 1-beta2^t, HP_OMB1 = 1-beta1, HP_OMB2 = 1-beta2,
        HP_TMIN/HP_TMAX (trust-ratio clamp, or 0). ``found_inf``: see :meth:`run_step`.
        """
        n = len(params)
        if n == 0:
            return self._empty()
        tab = self.table(params, grads, exp_avgs, exp_avg_sqs, adapt=adapt, rows=rows)
        return self.run_step("lamb", tab, self.upload_hp(hp_rows)[0], found_inf=found_inf,
                             out=out)


# ---------------------------------------------------------------------------------------------
# Which devices get the fused path
# ---------------------------------------------------------------------------------------------

_FUSED: dict[str, FusedTrust] = {}
_REFUSED: dict[str, str] = {}  # device -> why CuPy's kernel could not be had (warned once)
_OVERRIDES: dict[str, FusedTrust] = {}
#: ``[n]``: how many times :func:`fused_for`'s answer may have changed (an override installed or
#: removed, a device refused); an optimizer's step plan keeps the count it chose its path under
#: and chooses again when it differs (one list read per step, no call)
SERVED = [0]


def is_backend_error(e: BaseException) -> bool:
    """True for an error of the GPU stack under the fused kernel, for which the torch path is the
    answer: CuPy's compile, NVRTC, driver and runtime errors (``cupy``/``cupy_backends``
    exception types), :class:`~hpclb.errors.KernelCompileError`, and ``OSError`` (a kernel
    cache that cannot be written)."""
    module = type(e).__module__ or ""
    return isinstance(e, (OSError, KernelCompileError)) or module.split(".")[0] in (
        "cupy", "cupy_backends")


def refuse(device: "torch.device | str", error: BaseException, when: str) -> None:
    """From now on :func:`fused_for` returns None for ``device`` (the torch path); warns once,
    naming the error and what to do. ``when``: what failed (``"compile"`` or ``"launch"``)."""
    import torch

    key = str(torch.device(device))
    if key in _REFUSED:
        return
    _REFUSED[key] = f"{type(error).__name__}: {error}"
    SERVED[0] += 1
    hint = (f"CuPy could not write its kernel cache: set {CUPY_CACHE_ENV} to a writable "
            "directory" if isinstance(error, OSError) else
            "check the CUDA driver, CuPy and NVRTC versions (docs/clusters-gpu.md), or set "
            "HPCLB_TRUST_BACKEND=torch")
    log.warning("fused trust-ratio kernel unavailable on %s (%s failed: %s); %s. The torch "
                "path runs instead, from now on.", key, when, _REFUSED[key], hint)


def fused_for(device: "torch.device | str") -> FusedTrust | None:
    """The FusedTrust serving ``device``: an installed override (tests), else CuPy's for a CUDA
    device when CuPy imports and the kernel compiles (compiled here, on first use); None means
    the torch path. Respects ``HPCLB_TRUST_BACKEND=torch``. When the kernel cannot be had (a
    compile, NVRTC, driver or CuPy error, or a kernel cache that cannot be written:
    :func:`is_backend_error`), or a launch failed (:func:`refuse`), it warns once and returns
    None from then on; any other error propagates."""
    import torch

    device = torch.device(device)
    key = str(device)
    if key in _REFUSED:
        return None
    if key in _OVERRIDES:
        return _OVERRIDES[key]
    if os.environ.get("HPCLB_TRUST_BACKEND", "auto") == "torch" or device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
    hit = _FUSED.get(key)
    if hit is None:
        if key in _REFUSED or not cupy_available():
            return None
        launcher = CupyLauncher(device)
        try:
            launcher.module()  # compile now, so that a failure falls back here, once
        except Exception as e:
            if not is_backend_error(e):
                raise
            refuse(device, e, "compile")
            return None
        hit = _FUSED[key] = FusedTrust(launcher)
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
    SERVED[0] += 1
    try:
        yield
    finally:
        SERVED[0] += 1
        if before is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = before
