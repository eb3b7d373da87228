"""The settings of :class:`hpclb.sync.gradients.GradientSync`, read from arguments and the
environment in one place and validated with their units.

Every setting may come from an argument or from an ``HPCLB_*`` environment variable (the argument
wins); :meth:`SyncOptions.resolve` returns them checked. Units are in the names: bytes and seconds.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from dataclasses import dataclass

__all__ = [
    "AGREED_ENVIRONMENT", "SYNC_VARIABLES", "BYTES_FORMS", "COMPRESSIONS",
    "DEFAULT_COMM_POLL_S", "DEFAULT_FIRST_BUCKET_BYTES",
    "DEFAULT_FUSION_THRESHOLD_BYTES", "DEFAULT_STALL_TIMEOUT_S", "OVERLAP_MODES",
    "LIBRARY_STALL_ABORT_S", "TRAIN_STALL_ABORT_S", "SMALL_FUSION_BYTES", "MiB", "SyncOptions",
    "check_environment", "in_force", "parse_bytes", "set_default_stall_abort_s"]

MiB = 2 ** 20
DEFAULT_FUSION_THRESHOLD_BYTES = 25 * MiB
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB
DEFAULT_STALL_TIMEOUT_S = 60.0
DEFAULT_COMM_POLL_S = 2e-4
# hpclb.init's default: a collective that waits this long ends the job (library scripts have no
# supervisor that would notice a hang; the command line aborts on its own failures).
LIBRARY_STALL_ABORT_S = 300.0
# hpclb train's default: a stalled job ends with the diagnosis after 10 minutes (NCCL's default
# collective timeout under torchrun); HPCLB_STALL_ABORT_S=never waits forever.
TRAIN_STALL_ABORT_S = 600.0
_default_stall_abort_s: list[float | None] = [None]  # set by hpclb.init (library mode)
OVERLAP_MODES = ("auto", "thread", "nonblocking", "none")
# names of torch dtypes (torch is imported only when a dtype is asked for: this module is torch-free
# so that config can check the environment at start-up)
COMPRESSIONS = {None: None, "none": None, "fp16": "float16", "bf16": "bfloat16"}
# Below this a fusion threshold is almost surely a unit mistake (Horovod's CLI takes MB, its env
# var bytes): it makes about one bucket per tensor.
SMALL_FUSION_BYTES = 1024

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
BYTES_FORMS = ("an integer number of bytes (26214400) or a number with a unit: 25MiB, 64MB, "
               "1GiB, 512KiB")


def parse_bytes(raw: str) -> int:
    """``"26214400"``, ``"25MiB"``, ``"64 MB"``, ``"1GiB"``, ``"512k"`` -> bytes (int).

    KB/MB/GB are decimal (10**3...), KiB/MiB/GiB and K/M/G binary. Raises ValueError listing the
    accepted forms."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(raw))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{raw!r} is not a size: use {BYTES_FORMS}")
    return int(float(m.group(1)) * _UNITS[unit])


def _env(name: str, default, conv):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return conv(raw)
    except ValueError as e:
        raise ValueError(f"${name}={raw!r}: {e}") from e


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError("must be a finite number of seconds (e.g. 60)")
    return value


def _positive_seconds(raw: str) -> float:
    value = _seconds(raw)
    if not value > 0:
        raise ValueError("must be a number of seconds > 0 (e.g. 60)")
    return value


def _abort_seconds(raw: str) -> float:
    """``HPCLB_STALL_ABORT_S``: seconds > 0, or ``never`` (infinity: the job is never ended)."""
    if raw.strip().lower() == "never":
        return math.inf
    try:
        return _positive_seconds(raw)
    except ValueError:
        raise ValueError("must be a number of seconds > 0 (e.g. 600) or never") from None


def _nonnegative_seconds(raw: str) -> float:
    value = _seconds(raw)
    if not value >= 0:
        raise ValueError("must be a number of seconds >= 0 (e.g. 0.0002)")
    return value


def _choice(valid: tuple[str, ...]):
    def conv(raw: str) -> str:
        if raw not in valid:
            raise ValueError(f"choose one of {', '.join(valid)}")
        return raw
    return conv


_OVERLAP_ENV = _choice(OVERLAP_MODES)
_BOOL_WORDS = ("0", "1", "false", "true", "no", "yes", "off", "on")
_COMPRESSION_ENV = _choice(("none", "fp16", "bf16"))


#: the ``HPCLB_*`` variables every rank must set alike, each ``(value when unset, parser)``: the
#: gradient-sync settings and the trust-ratio backend of LARS/LAMB (not ``HPCLB_CUDA_AWARE_MPI``:
#: how a buffer reaches MPI, never the sum; nor the library-only ``HPCLB_ABORT_ON_EXCEPTION``).
#: ``hpclb train`` compares their values in force (:mod:`hpclb.config.agreement`); a
#: GradientSync the settings they resolve to (:data:`SYNC_VARIABLES`) and the others in force.
#: docs/cli.md ("Environment variables") lists them; tests/test_silent_answers.py compares.
AGREED_ENVIRONMENT = {
    "HPCLB_FUSION_THRESHOLD_BYTES": (DEFAULT_FUSION_THRESHOLD_BYTES, parse_bytes),
    "HPCLB_OVERLAP": ("auto", str),
    "HPCLB_COMPRESSION": ("none", str),
    "HPCLB_STALL_TIMEOUT_S": (DEFAULT_STALL_TIMEOUT_S, float),
    "HPCLB_STALL_ABORT_S": (None, float),
    "HPCLB_COMM_POLL_S": (DEFAULT_COMM_POLL_S, float),
    "HPCLB_TRUST_BACKEND": ("auto", str),
}
#: the :class:`SyncOptions` field each ``HPCLB_*`` variable sets (an argument wins over it)
SYNC_VARIABLES = {"fusion_threshold_bytes": "HPCLB_FUSION_THRESHOLD_BYTES",
                  "overlap": "HPCLB_OVERLAP", "compression": "HPCLB_COMPRESSION",
                  "stall_timeout_s": "HPCLB_STALL_TIMEOUT_S",
                  "stall_abort_s": "HPCLB_STALL_ABORT_S", "comm_poll_s": "HPCLB_COMM_POLL_S"}


def in_force(name: str):
    """``$name`` (of :data:`AGREED_ENVIRONMENT`) parsed (its raw text where it does not parse:
    the start-up check names it), its default when unset or empty."""
    default, parse = AGREED_ENVIRONMENT[name]
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        return raw


def check_environment() -> None:
    """Check every ``HPCLB_*`` gradient-sync variable that is set (and ``HPCLB_CUDA_AWARE_MPI``,
    ``HPCLB_TRUST_BACKEND``, ``HPCLB_ABORT_ON_EXCEPTION``), and ``HPCLB_STALL_ABORT_S`` against
    ``HPCLB_STALL_TIMEOUT_S`` (or its default), at start-up (before any rank trains): raises
    ValueError naming the variable(s), the value(s) and the valid values."""
    _env("HPCLB_FUSION_THRESHOLD_BYTES", None,
         lambda raw: _as_bytes("a fusion threshold", parse_bytes(raw)))
    _env("HPCLB_OVERLAP", None, _OVERLAP_ENV)
    _env("HPCLB_COMPRESSION", None, _COMPRESSION_ENV)
    timeout = _env("HPCLB_STALL_TIMEOUT_S", None, _positive_seconds)
    abort = _env("HPCLB_STALL_ABORT_S", None, _abort_seconds)
    _env("HPCLB_COMM_POLL_S", None, _nonnegative_seconds)
    # read elsewhere, lazily (on a GPU, in library mode): checked here so that a typo is caught
    # on any machine, at start-up
    _env("HPCLB_CUDA_AWARE_MPI", None, _choice(("0", "1")))
    _env("HPCLB_TRUST_BACKEND", None, _choice(("auto", "torch")))
    _env("HPCLB_ABORT_ON_EXCEPTION", None, lambda raw: _choice(_BOOL_WORDS)(raw.strip().lower()))
    if abort is not None and abort < (DEFAULT_STALL_TIMEOUT_S if timeout is None else timeout):
        shown = (f"$HPCLB_STALL_TIMEOUT_S={os.environ['HPCLB_STALL_TIMEOUT_S']!r}"
                 if timeout is not None else
                 f"the stall timeout ($HPCLB_STALL_TIMEOUT_S unset: {DEFAULT_STALL_TIMEOUT_S:g})")
        raise ValueError(
            f"$HPCLB_STALL_ABORT_S={os.environ['HPCLB_STALL_ABORT_S']!r} is below {shown} "
            f"seconds: a stalled collective is reported after the timeout and the job ended "
            f"after the abort time; set HPCLB_STALL_ABORT_S to "
            f"{timeout or DEFAULT_STALL_TIMEOUT_S:g} or more, or lower HPCLB_STALL_TIMEOUT_S")


@dataclass(frozen=True)
class SyncOptions:
    """Resolved GradientSync settings (see :class:`hpclb.sync.gradients.GradientSync` for meanings).

    Units: ``*_bytes`` bytes, ``*_s`` seconds. ``overlap`` is still ``"auto"`` here; the
    communicator decides it (:meth:`overlap_for`)."""

    fusion_threshold_bytes: int
    first_bucket_bytes: int
    overlap: str
    compression: str | None
    stall_timeout_s: float
    stall_abort_s: float | None
    comm_poll_s: float

    @classmethod
    def resolve(cls, *, fusion_threshold_bytes=None, first_bucket_bytes=None, overlap=None,
                compression=None, stall_timeout_s=None, stall_abort_s=None) -> "SyncOptions":
        """Arguments, else ``$HPCLB_FUSION_THRESHOLD_BYTES``, ``$HPCLB_OVERLAP``,
        ``$HPCLB_COMPRESSION``, ``$HPCLB_STALL_TIMEOUT_S``, ``$HPCLB_STALL_ABORT_S``,
        ``$HPCLB_COMM_POLL_S``, else the defaults (``stall_abort_s``: the default
        :func:`set_default_stall_abort_s` set, at least ``stall_timeout_s``, else never;
        ``HPCLB_STALL_ABORT_S=never``: never).
        Raises ValueError naming the setting and its unit; warns (UserWarning) for a fusion
        threshold under 1 KiB."""
        opts = cls(
            fusion_threshold_bytes=_as_bytes("fusion_threshold_bytes", fusion_threshold_bytes
                                             if fusion_threshold_bytes is not None else
                                             _env("HPCLB_FUSION_THRESHOLD_BYTES",
                                                  DEFAULT_FUSION_THRESHOLD_BYTES, parse_bytes)),
            first_bucket_bytes=_as_bytes("first_bucket_bytes", first_bucket_bytes
                                         if first_bucket_bytes is not None
                                         else DEFAULT_FIRST_BUCKET_BYTES),
            overlap=overlap or _env("HPCLB_OVERLAP", "auto", _OVERLAP_ENV),
            compression=compression if compression is not None else
            _env("HPCLB_COMPRESSION", None, _COMPRESSION_ENV),
            stall_timeout_s=float(stall_timeout_s if stall_timeout_s is not None else
                                  _env("HPCLB_STALL_TIMEOUT_S", DEFAULT_STALL_TIMEOUT_S,
                                       _positive_seconds)),
            stall_abort_s=stall_abort_s if stall_abort_s is not None else
            _env("HPCLB_STALL_ABORT_S", None, _abort_seconds),
            comm_poll_s=float(_env("HPCLB_COMM_POLL_S", DEFAULT_COMM_POLL_S,
                                   _nonnegative_seconds)))
        if opts.stall_abort_s is None and _default_stall_abort_s[0] is not None:
            opts = dataclasses.replace(opts, stall_abort_s=max(_default_stall_abort_s[0],
                                                               opts.stall_timeout_s))
        if opts.stall_abort_s == math.inf:  # HPCLB_STALL_ABORT_S=never
            opts = dataclasses.replace(opts, stall_abort_s=None)
        opts._check()
        return opts

    def _check(self) -> None:
        if self.fusion_threshold_bytes < SMALL_FUSION_BYTES:
            warnings.warn(f"fusion_threshold_bytes={self.fusion_threshold_bytes} bytes makes about "
                          f"one bucket per tensor; the unit is bytes (64 MiB is 67108864 or "
                          f"'64MiB' in $HPCLB_FUSION_THRESHOLD_BYTES)", UserWarning, stacklevel=4)
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap={self.overlap!r}: choose one of {OVERLAP_MODES}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}: choose None, 'fp16' or 'bf16'")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s={self.stall_timeout_s} must be > 0 seconds")
        if self.stall_abort_s is not None and not self.stall_abort_s >= self.stall_timeout_s:
            raise ValueError(f"stall_abort_s={self.stall_abort_s} (argument or "
                             f"$HPCLB_STALL_ABORT_S) must be >= stall_timeout_s="
                             f"{self.stall_timeout_s} (argument or $HPCLB_STALL_TIMEOUT_S) "
                             f"seconds (abort after the report)")

    @property
    def compression_dtype(self):
        """The torch dtype buckets travel in, or None (no compression)."""
        name = COMPRESSIONS[self.compression]
        if name is None:
            return None
        import torch
        return getattr(torch, name)

    def overlap_for(self, comm, n_buckets: int) -> str:
        """``auto``: ``thread`` for MPI (progress only inside MPI calls), ``nonblocking`` where
        the library progresses on its own threads, and for gradients that make one bucket
        (``n_buckets``: complete only when backward ends, nothing to overlap, so no thread
        hand-off); ``thread`` falls back to ``nonblocking`` for a communicator that is not
        thread safe."""
        mode = self.overlap
        if mode == "auto":
            mode = "nonblocking" if comm.async_progress or n_buckets <= 1 else "thread"
        if mode == "thread" and not comm.thread_safe:
            mode = "nonblocking"
        return mode


def set_default_stall_abort_s(seconds: float | None) -> None:
    """The ``stall_abort_s`` of every later GradientSync whose argument and
    ``$HPCLB_STALL_ABORT_S`` are unset: end the job after a collective waited this many seconds
    (None: wait forever). :func:`hpclb.init` sets :data:`LIBRARY_STALL_ABORT_S`. Raises
    ValueError unless None or a positive finite number of seconds."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and
                                    math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"stall_abort_s={seconds!r} must be None or a positive number of "
                         f"seconds")
    _default_stall_abort_s[0] = None if seconds is None else float(seconds)


def _as_bytes(field: str, value) -> int:
    if isinstance(value, str):
        value = parse_bytes(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
            or value <= 0:
        raise ValueError(f"{field}={value!r} must be a positive number of bytes ({BYTES_FORMS})")
    return int(value)
