"""Per-step and per-epoch run metrics: ``metrics.jsonl`` lines and TensorBoard event files.

A run directory's ``metrics.jsonl`` holds one JSON object per line, told apart by ``kind``:

- ``{"kind": "step", "step": S, <scalar>: float, ...}``: one line per logged optimizer step
  (every ``--log-every`` steps). ``step`` is the global step count after the update (1-based,
  the unit of the epoch lines' ``step``). Scalars the training loop writes (all optional):
  ``loss``, ``lr``, ``grad_norm``, ``trust_min``/``trust_median``/``trust_max`` (LARS/LAMB
  trust ratios over the adapted layers), ``samples_per_s``, ``step_time_s``, ``compute_s``,
  ``comm_wait_s`` (exposed communication), ``skipped_steps`` (non-finite steps skipped so far;
  a skipped step adds nothing to ``loss``, and a non-finite ``grad_norm`` or trust ratio of a
  skipped last step is written as null), ``max_memory_bytes`` (peak device memory, on a GPU).
- ``{"kind": "epoch", "epoch": E, "step": S, ...}``: the per-epoch row of ``hpclb train``
  (train/test metrics, ``lr``, ``samples_per_s``, optionally ``noise``: the gradient noise
  scale summary of :mod:`hpclb.noise`). Lines without ``kind`` (runs made before per-step
  logging) are epoch lines; :func:`read_metrics` reads both.
- ``{"kind": "diverged", "step": S, "error": "..."}``: the last line of a run that stopped on
  non-finite values (exit 3) at global step ``S`` (``hpclb compare`` shows it).

:class:`RunLogger` writes both on rank 0 (``enabled=False`` makes every call a no-op on the other
ranks) and mirrors every number into TensorBoard (``<run>/tb``) through
``torch.utils.tensorboard.SummaryWriter`` when the ``tensorboard`` package is installed
(``pip install 'hpclb[tensorboard]'``). Nothing here touches a device: the caller converts
tensors on the steps it logs, so unlogged steps cost no host synchronisation.
"""
from __future__ import annotations

import json
import logging
import math
import numbers
from pathlib import Path
from typing import Any, Iterable, Mapping

from hpclb._io import json_lines, write_text_atomic
from hpclb.config.outputs import RUN_KEPT, mark_run
from hpclb.errors import DISK_FULL_ERRNOS, DiskFull

__all__ = ["METRICS_FILE", "TENSORBOARD_DIR", "TENSORBOARD_HINT", "STEP_TAGS",
           "tensorboard_tag", "RunLogger", "read_metrics", "finite"]

log = logging.getLogger("hpclb")

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
TENSORBOARD_HINT = ("TensorBoard is not installed, so this run writes metrics.jsonl only; "
                    "`pip install 'hpclb[tensorboard]'` to also get event files under <run>/tb")
# Step scalars -> TensorBoard tags. Other keys: "train_loss" -> "train/loss" (first "_" -> "/").
STEP_TAGS = {
    "loss": "train/loss", "lr": "lr", "grad_norm": "grad/norm", "trust_min": "trust/min",
    "trust_median": "trust/median", "trust_max": "trust/max",
    "samples_per_s": "perf/samples_per_s", "step_time_s": "time/step_s",
    "compute_s": "time/compute_s", "comm_wait_s": "time/comm_exposed_s",
    "skipped_steps": "train/skipped_steps", "max_memory_bytes": "device/max_memory_bytes",
}
_hint_given = False


def tensorboard_tag(key: str, kind: str = "step") -> str:
    """The TensorBoard tag of a metrics key: :data:`STEP_TAGS` for step scalars, else the key
    with its first ``_`` made a ``/`` (``train_loss`` -> ``train/loss``, ``noise_b_simple`` ->
    ``noise/b_simple``); epoch rows' keys get an ``epoch/`` prefix (``epoch/test/accuracy``)."""
    if kind == "step" and key in STEP_TAGS:
        return STEP_TAGS[key]
    tag = key.replace("_", "/", 1) if "_" in key else key
    return tag if kind == "step" else f"epoch/{tag}"


def _plain(value: Any) -> Any:
    """JSON-ready copy: 0-d tensors / numpy scalars -> Python numbers, mappings recursively."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # torch / numpy scalar
        return value.item()
    return value


def _numbers(row: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    """(key, value) for every finite-or-nan number of ``row``, nested mappings flattened with
    ``_`` (``{"noise": {"g2": 1}}`` -> ``noise_g2``); bools, None and strings skipped."""
    for key, value in row.items():
        if isinstance(value, Mapping):
            yield from _numbers(value, f"{prefix}{key}_")
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value)


def _load_writer(log_dir: Path, tensorboard: bool | None, purge_step: int | None):
    """A SummaryWriter, or None (after the one-line hint) when tensorboard is off or missing."""
    global _hint_given
    if tensorboard is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _hint_given:
            (log.warning if tensorboard else log.info)(TENSORBOARD_HINT)
            _hint_given = True
        return None
    mark_run(log_dir.parent, log_dir.name)  # the run directory's marker: tb/ is hpclb's
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _truncate_after(path: Path, resume_step: int) -> int:
    """Rewrite ``path`` (atomically, once) without the lines of a killed run past global step
    ``resume_step`` (lines with no ``step`` are kept; a torn last line is dropped). Returns the
    number of lines dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line, row in json_lines(path):
        if row is None or (isinstance(row.get("step"), numbers.Real) and
                           row["step"] > resume_step):
            dropped += 1
        else:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept), RUN_KEPT)
    return dropped


class RunLogger:
    """Writes a run's ``metrics.jsonl`` and TensorBoard events; every call is a no-op unless
    ``enabled`` (pass ``comm.rank == 0``).

    Args:
        out_dir: the run directory (created); the JSONL goes to ``out_dir/metrics.jsonl``, the
            event files to ``out_dir/tb``.
        enabled: write at all (rank 0 only).
        tensorboard: True/False force it on/off; None (default) uses it when importable. Without
            the package one log line says ``pip install 'hpclb[tensorboard]'``.
        resume_step: continuing a run from a checkpoint taken at this global step: lines (and
            TensorBoard events, via ``purge_step``) beyond it, written by the killed run after
            its checkpoint, are dropped; the file is rewritten once. None starts a new file.
    """

    def __init__(self, out_dir: str | Path, *, enabled: bool, tensorboard: bool | None = None,
                 resume_step: int | None = None):
        self.enabled = bool(enabled)
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / METRICS_FILE
        self._file = None
        self.writer = None
        if not self.enabled:
            return
        if resume_step is not None and (isinstance(resume_step, bool) or
                                        not isinstance(resume_step, int) or resume_step < 0):
            raise ValueError(f"resume_step must be a global step >= 0 or None, got "
                             f"{resume_step!r}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self._file = open(self.path, "w", buffering=1)
        else:
            _truncate_after(self.path, resume_step)
            self._file = open(self.path, "a", buffering=1)
        self.writer = _load_writer(self.out_dir / TENSORBOARD_DIR, tensorboard,
                                   None if resume_step is None else resume_step + 1)

    @property
    def tensorboard(self) -> bool:
        """Whether event files are being written."""
        return self.writer is not None

    def _write(self, row: dict) -> None:
        """Append ``row`` as a line. Raises DiskFull on a full disk (the lines before are whole;
        a torn last one is dropped on ``--resume``)."""
        try:
            self._file.write(json.dumps(row) + "\n")
        except OSError as e:
            if e.errno in DISK_FULL_ERRNOS:
                raise DiskFull(self.path, e, f"its lines before are whole; {RUN_KEPT}") from e
            raise

    def log_step(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Append ``{"kind": "step", "step": step, **scalars}`` (values: floats, ints, 0-d
        tensors; ``step``: global step after the update) and the same scalars to TensorBoard
        under :func:`tensorboard_tag` names at x = ``step``."""
        if not self.enabled:
            return
        scalars = _plain(scalars)
        self._write({"kind": "step", "step": int(step), **scalars})
        if self.writer is not None:
            for key, value in _numbers(scalars):
                self.writer.add_scalar(tensorboard_tag(key, "step"), value, int(step))

    def log_epoch(self, row: Mapping[str, Any]) -> None:
        """Append ``{"kind": "epoch", **row}`` (the epoch row of ``hpclb train``; its ``step``,
        the global step at the epoch's end, is TensorBoard's x) and flush. Nested numbers (e.g.
        ``noise``) go to TensorBoard flattened (``epoch/noise/b_simple``)."""
        if not self.enabled:
            return
        row = _plain(row)
        self._write({"kind": "epoch", **row})
        if self.writer is not None:
            x = int(row.get("step", row.get("epoch", 0)))
            for key, value in _numbers(row):
                if key not in ("epoch", "step"):
                    self.writer.add_scalar(tensorboard_tag(key, "epoch"), value, x)
        self.flush()

    def log_diverged(self, step: int, message: str) -> None:
        """Append ``{"kind": "diverged", "step": step, "error": message}``: the run stopped on
        non-finite values at global step ``step`` (a resume from an earlier checkpoint drops
        the line with the steps after it)."""
        if self.enabled:
            self._write({"kind": "diverged", "step": int(step), "error": message})
            self.flush()

    def histogram(self, tag: str, values: Any, step: int) -> None:
        """TensorBoard histogram of ``values`` (a tensor or array of any shape, e.g. the
        per-layer trust ratios, one per adapted layer) at global step ``step``. TensorBoard
        only; no JSONL line."""
        if not self.enabled or self.writer is None:
            return
        if hasattr(values, "detach"):
            values = values.detach().to("cpu")
        self.writer.add_histogram(tag, values, int(step))

    def flush(self) -> None:
        """Push buffered TensorBoard events to disk (JSONL lines are written as they come)."""
        if self._file is not None:
            self._file.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush and close; further calls are no-ops."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.enabled = False

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(epoch rows, step rows) of a run, each in file order, from ``run_dir/metrics.jsonl``
    (``run_dir`` may also be the file itself). Lines without ``kind`` are epoch rows (runs
    made before per-step logging); other kinds are skipped; ``kind`` is removed from the rows.
    A torn last line (a killed run) is ignored.

    Raises FileNotFoundError naming the file when it is missing; ValueError naming the line
    when a line other than the last is not JSON.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file; is {path.parent} a run directory "
                                f"written by `hpclb train --out`?")
    epochs, steps = [], []
    for _, row in json_lines(path):
        if row is None:
            continue
        kind = row.pop("kind", "epoch")
        if kind == "epoch":
            epochs.append(row)
        elif kind == "step":
            steps.append(row)
    return epochs, steps


def finite(x: Any) -> bool:
    """A real, finite number (not a bool, not None)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
