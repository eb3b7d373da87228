"""The settings of :class:`hpclb.sync.gradients.GradientSync`, declared once
(:data:`SYNC_SETTINGS`) and parsed and validated with their units in one place
(:func:`resolve_sync`), for the library and ``hpclb train`` alike.

Every setting may come from an argument (a flag), an ``HPCLB_*`` environment variable or the
recipe's ``sync:`` section, in that order; :meth:`SyncOptions.resolve` returns them checked.
Units are in the names: bytes and seconds. Torch-free: ``hpclb train --help`` builds its flags
from here.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from hpclb.errors import ConfigError

__all__ = [
    "AGREED_ENVIRONMENT", "SYNC_VARIABLES", "BYTES_FORMS", "COMPRESSIONS",
    "DEFAULT_COMM_POLL_S", "DEFAULT_FIRST_BUCKET_BYTES",
    "DEFAULT_FUSION_THRESHOLD_BYTES", "DEFAULT_STALL_TIMEOUT_S", "OVERLAP_MODES",
    "LIBRARY_STALL_ABORT_S", "TRAIN_STALL_ABORT_S", "SMALL_FUSION_BYTES", "SYNC_SETTINGS",
    "MiB", "SyncOptions", "SyncSetting", "check_environment", "in_force", "parse_bytes",
    "parse_sync", "resolve_sync", "shares_per_step", "small_bucket_warning"]

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
OVERLAP_MODES = ("auto", "thread", "nonblocking", "none")
# names of torch dtypes (torch is imported only when a dtype is asked for: this module is torch-free
# so that config can check the environment at start-up)
COMPRESSIONS = {"none": None, "fp16": "float16", "bf16": "bfloat16"}
# Below this a fusion threshold is almost surely a unit mistake (Horovod's CLI takes MB, its env
# var bytes): it makes about one bucket per tensor.
SMALL_FUSION_BYTES = 1024


def shares_per_step(world_size: int, accumulation_steps: int) -> int:
    """The shares one optimizer step averages over: ``world_size * accumulation_steps`` (each
    rank's micro-batches of a window). The default divisor of the reduced sum, the loss
    weights' scale and the global batch's divisibility all use it."""
    return world_size * accumulation_steps


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
    if m is None or unit not in _UNITS or not math.isfinite(float(m.group(1)) * _UNITS[unit]):
        raise ValueError(f"{raw!r} is not a size: use {BYTES_FORMS}")
    return int(float(m.group(1)) * _UNITS[unit])


def _env(name: str, default, conv):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return conv(raw)
    except ValueError as e:
        raise ValueError(f"${name}: must be {e}, got {raw!r}") from e


def _number(value: Any) -> float:
    """A finite number, from a number or its text (not a bool); nan otherwise."""
    try:
        n = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        n = math.nan
    return n if math.isfinite(n) else math.nan


def _poll_seconds(raw: str) -> float:
    value = _number(raw)
    if not value >= 0:
        raise ValueError("a number of seconds >= 0 (e.g. 0.0002)")
    return value


def _choice(valid: tuple[str, ...]):
    def conv(raw: str) -> str:
        if raw not in valid:
            raise ValueError(f"one of {', '.join(valid)}")
        return raw
    return conv


def _bytes(value: Any) -> int:
    n = parse_bytes(value) if isinstance(value, str) else value
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) \
            or n != int(n) or n <= 0:
        raise ValueError
    return int(n)


def _seconds(value: Any, never: bool = False) -> float | None:
    """A number of seconds > 0 (from a number or its text); with ``never``: also ``never`` or
    infinity (-> None: wait forever)."""
    if never and (value == math.inf or str(value).strip().lower() == "never"):
        return None
    seconds = _number(value)
    if not seconds > 0:
        raise ValueError
    return seconds


_BOOL_WORDS = ("0", "1", "false", "true", "no", "yes", "off", "on")


class SyncSetting(NamedTuple):
    """One declared gradient-sync setting (a :class:`SyncOptions` field, the recipe's ``sync:``
    section of ``hpclb train``): ``default``; ``shown`` (the default as written); ``flag``;
    ``env`` (the ``HPCLB_*`` variable); ``parse(value)`` -> the value used (accepts an
    argument's, the recipe's, a flag's or a variable's value; ValueError otherwise); ``valid``
    (with its unit); ``help``; ``metavar``."""

    default: Any
    shown: str
    flag: str
    env: str
    parse: Callable[[Any], Any]
    valid: str
    help: str
    metavar: str


#: the gradient-sync settings (see :class:`hpclb.sync.gradients.GradientSync` for what each
#: does), parsed and checked by :func:`resolve_sync` alone; the argument or flag wins over
#: ``$HPCLB_*``, which wins over the recipe's ``sync.<name>``, which wins over the default
SYNC_SETTINGS: dict[str, SyncSetting] = {
    "fusion_threshold_bytes": SyncSetting(
        DEFAULT_FUSION_THRESHOLD_BYTES, "25MiB", "--fusion-threshold",
        "HPCLB_FUSION_THRESHOLD_BYTES", _bytes, f"a size > 0: {BYTES_FORMS}",
        "gradient bucket size: gradients are fused into buckets of about this many bytes, "
        "each allreduced as soon as it is complete", "BYTES"),
    "overlap": SyncSetting(
        "auto", "auto", "--overlap", "HPCLB_OVERLAP", _choice(OVERLAP_MODES),
        f"one of {', '.join(OVERLAP_MODES)} (how bucket allreduces overlap backward; auto: "
        f"thread for MPI, nonblocking for NCCL/gloo)",
        "how bucket allreduces overlap the backward pass", "MODE"),
    "compression": SyncSetting(
        "none", "none", "--compression", "HPCLB_COMPRESSION", _choice(("none", "fp16", "bf16")),
        "one of none, fp16, bf16 (the dtype buckets travel in; each share is divided by "
        "world_size x K before the cast)",
        "gradient compression on the wire (changes the numbers: recorded in config.json)",
        "DTYPE"),
    "stall_timeout_s": SyncSetting(
        DEFAULT_STALL_TIMEOUT_S, f"{DEFAULT_STALL_TIMEOUT_S:g}", "--stall-timeout",
        "HPCLB_STALL_TIMEOUT_S", _seconds, "a number of seconds > 0 (e.g. 60)",
        "report a collective that waited this long, naming the late ranks", "SECONDS"),
    "stall_abort_s": SyncSetting(
        TRAIN_STALL_ABORT_S, f"{TRAIN_STALL_ABORT_S:g}", "--stall-abort", "HPCLB_STALL_ABORT_S",
        lambda v: _seconds(v, never=True),
        "a number of seconds >= the stall timeout, or never (wait forever)",
        "end every rank, with the diagnosis, after a collective waited this long (never: "
        "wait forever)", "SECONDS"),
}


def parse_sync(name: str, value: Any, source: str) -> Any:
    """``value`` of gradient-sync setting ``name`` parsed; ConfigError (a ValueError)
    ``"<source>: must be <valid>, got <value>"``."""
    try:
        return SYNC_SETTINGS[name].parse(value)
    except ValueError:
        raise ConfigError(f"{source}: must be {SYNC_SETTINGS[name].valid}, got "
                          f"{value!r}") from None


def resolve_sync(section: dict | None, given: dict[str, Any], environ: Mapping[str, str],
                 where: str = "", *, flags: bool = True,
                 default_abort_s: float | None = TRAIN_STALL_ABORT_S) -> dict[str, Any]:
    """The gradient-sync settings in force, each from the first that sets it: ``given[name]``
    (the flag, ``flags``, or the argument; None: not given), the ``HPCLB_*`` variable in
    ``environ``, the recipe's ``sync:`` ``section`` (recipe ``where``), the default
    (``stall_abort_s``: ``default_abort_s``, raised to the stall timeout). ``stall_abort_s``
    None: never. Raises ConfigError (a ValueError) naming the source of a bad value, and both
    sources when the abort time is below the stall timeout."""
    values, sources = {}, {}
    for name, s in SYNC_SETTINGS.items():
        if given.get(name) is not None:
            raw, source = given[name], s.flag if flags else name
        elif environ.get(s.env, "") != "":
            raw, source = environ[s.env], f"${s.env}"
        elif name in (section or {}):
            raw, source = section[name], f"{where}: sync.{name}"
        else:
            values[name] = default_abort_s if name == "stall_abort_s" else s.default
            sources[name] = None
            continue
        values[name], sources[name] = parse_sync(name, raw, source), source
    abort, timeout = values["stall_abort_s"], values["stall_timeout_s"]
    if abort is not None and abort < timeout:
        if sources["stall_abort_s"] is None:  # a default ends the job after the report
            return {**values, "stall_abort_s": timeout}
        shown = sources["stall_timeout_s"] or (
            "the default of --stall-timeout" if flags else "the default stall_timeout_s")
        raise ConfigError(f"{sources['stall_abort_s']} {abort:g} is below {shown} {timeout:g} "
                          f"seconds: a stalled collective is reported after the timeout, the "
                          f"job ended after the abort time (abort after the report); raise the "
                          f"abort time to {timeout:g} or more (or never), or lower the timeout")
    return values


def small_bucket_warning(fusion_threshold_bytes: int) -> str | None:
    """The unit hint for a fusion threshold under :data:`SMALL_FUSION_BYTES` (about one bucket
    per tensor: a unit mistake, surely), else None; :class:`SyncOptions` warns it, and so does
    ``hpclb train --dry-run``."""
    if fusion_threshold_bytes >= SMALL_FUSION_BYTES:
        return None
    return (f"fusion_threshold_bytes={fusion_threshold_bytes} bytes makes about one bucket per "
            f"tensor; the unit is bytes (64 MiB is 67108864, or '64MiB' wherever it is set: "
            f"--fusion-threshold, $HPCLB_FUSION_THRESHOLD_BYTES, the recipe's sync: section)")


def check_environment() -> None:
    """Check every ``HPCLB_*`` gradient-sync variable that is set (:func:`resolve_sync`: also
    ``HPCLB_STALL_ABORT_S`` against ``HPCLB_STALL_TIMEOUT_S`` or its default) and
    ``HPCLB_COMM_POLL_S``, ``HPCLB_CUDA_AWARE_MPI``, ``HPCLB_TRUST_BACKEND``,
    ``HPCLB_ABORT_ON_EXCEPTION``, at start-up (before any rank trains): raises ValueError
    naming the variable(s), the value(s) and the valid values."""
    resolve_sync(None, {}, os.environ, flags=False, default_abort_s=None)
    _env("HPCLB_COMM_POLL_S", None, _poll_seconds)
    # read elsewhere, lazily (on a GPU, in library mode): checked here so that a typo is caught
    # on any machine, at start-up
    _env("HPCLB_CUDA_AWARE_MPI", None, _choice(("0", "1")))
    _env("HPCLB_TRUST_BACKEND", None, _choice(("auto", "torch")))
    _env("HPCLB_ABORT_ON_EXCEPTION", None, lambda raw: _choice(_BOOL_WORDS)(raw.strip().lower()))


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
    "HPCLB_STALL_ABORT_S": (None, lambda v: "never" if v.strip().lower() == "never" else float(v)),
    "HPCLB_COMM_POLL_S": (DEFAULT_COMM_POLL_S, float),
    "HPCLB_TRUST_BACKEND": ("auto", str),
}
#: the :class:`SyncOptions` field each ``HPCLB_*`` variable sets (an argument wins over it)
SYNC_VARIABLES = {**{name: s.env for name, s in SYNC_SETTINGS.items()},
                  "comm_poll_s": "HPCLB_COMM_POLL_S"}


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


@dataclass(frozen=True)
class SyncOptions:
    """Resolved GradientSync settings (see :class:`hpclb.sync.gradients.GradientSync` for meanings).

    Units: ``*_bytes`` bytes, ``*_s`` seconds. ``overlap`` is still ``"auto"`` here; the
    communicator decides it (:meth:`overlap_for`)."""

    fusion_threshold_bytes: int
    first_bucket_bytes: int
    overlap: str
    compression: str
    stall_timeout_s: float
    stall_abort_s: float | None
    comm_poll_s: float

    @classmethod
    def resolve(cls, *, fusion_threshold_bytes=None, first_bucket_bytes=None, overlap=None,
                compression=None, stall_timeout_s=None, stall_abort_s=None,
                default_abort_s: float | None = None) -> "SyncOptions":
        """Arguments, else ``$HPCLB_*`` (:data:`SYNC_VARIABLES`), else the defaults
        (``stall_abort_s``: ``default_abort_s``, at least ``stall_timeout_s``; None: never;
        ``never`` or infinity: never), by :func:`resolve_sync`. Raises ValueError naming the
        setting and its unit; warns (UserWarning) for a fusion threshold under 1 KiB."""
        given = {"fusion_threshold_bytes": fusion_threshold_bytes, "overlap": overlap,
                 "compression": compression, "stall_timeout_s": stall_timeout_s,
                 "stall_abort_s": stall_abort_s}
        opts = cls(**resolve_sync(None, given, os.environ, flags=False,
                                  default_abort_s=default_abort_s),
                   first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES if first_bucket_bytes is None
                   else parse_sync("fusion_threshold_bytes", first_bucket_bytes,
                                   "first_bucket_bytes"),
                   comm_poll_s=_env("HPCLB_COMM_POLL_S", DEFAULT_COMM_POLL_S, _poll_seconds))
        warning = small_bucket_warning(opts.fusion_threshold_bytes)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=3)
        return opts

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

