"""Counting the device-to-host reads a training step makes, on any device (a diagnostic).

On a GPU every read of a device value by the host (``.item()``, ``bool(t)``, ``float(t)``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ...) waits until the device has finished the work queued
before it, so a step with one stalls the host once per step. :class:`HostReadCounter` is a
``torch.overrides.TorchFunctionMode`` that records every such call made while it is active, with
where it was made (the innermost frame outside torch, ``file:line``), so that the count can be
asserted on the CPU, where no read costs anything; on a GPU the same count can be compared with
``torch.cuda.set_sync_debug_mode("warn")``'s warnings. :func:`reads_per_step` trains a run
under both and reports them per global step.

Reads of tensors that live on the host by construction are not counted: the data readers and a
task's batch builders (``hpclb/data/``, ``Task.batch`` and its helpers: the batch is built on the
host and copied to the device afterwards), torch's packed-sequence code (``batch_sizes`` is a
CPU tensor by contract) and torch's optimizers' ``_get_value`` (their step counts stay on the
host unless ``capturable`` or ``fused``). :data:`HOST_SIDE` lists them.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["READS", "HOST_SIDE", "HostRead", "HostReadCounter", "StepWindow", "reads_per_step"]

#: Tensor methods and torch functions whose result is a host value read from the tensor.
READS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
    "__complex__", "__format__", "__array__", "equal", "allclose", "is_nonzero", "nonzero",
    "masked_select", "unique", "argwhere",
})

#: ``(path fragment, function name or "*")`` of frames whose reads are of host tensors.
HOST_SIDE = (
    (f"hpclb{os.sep}data{os.sep}", "*"),
    (f"hpclb{os.sep}tasks{os.sep}", "batch"),
    (f"hpclb{os.sep}tasks{os.sep}", "_part_indices"),
    (f"hpclb{os.sep}tasks{os.sep}", "micro_batches"),
    (f"hpclb{os.sep}tasks{os.sep}", "part_size"),
    (f"hpclb{os.sep}tasks{os.sep}", "global_size"),
    (f"torch{os.sep}nn{os.sep}utils{os.sep}rnn.py", "*"),
    (f"torch{os.sep}nn{os.sep}modules{os.sep}rnn.py", "*"),
    (f"torch{os.sep}optim{os.sep}optimizer.py", "_get_value"),
)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class HostRead:
    """One counted read: ``name`` (``"item"``, ``"__bool__"``, ...) and ``where``
    (``file:line`` of the innermost calling frame outside torch)."""

    name: str
    where: str


class HostReadCounter(TorchFunctionMode):
    """``with HostReadCounter() as reads: ...`` records each device-to-host read in
    ``reads.reads`` (a list of :class:`HostRead`); ``len(reads)`` is the count. ``host_side``:
    the frames whose reads are not counted (default :data:`HOST_SIDE`)."""

    def __init__(self, host_side: tuple = HOST_SIDE):
        super().__init__()
        self.host_side = host_side
        self.reads: list[HostRead] = []

    def __len__(self) -> int:
        return len(self.reads)

    def clear(self) -> None:
        """Forget the reads recorded so far."""
        self.reads.clear()

    def __torch_function__(self, func, _types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            where = self._caller()
            if where is not None:
                self.reads.append(HostRead(name, where))
        return func(*args, **(kwargs or {}))

    def _caller(self) -> str | None:
        """``file:line`` of the innermost frame outside torch, or None when any frame on the
        stack is host-side (:data:`HOST_SIDE`)."""
        frame, where = sys._getframe(2), None
        while frame is not None:
            path, fn = frame.f_code.co_filename, frame.f_code.co_name
            if any(part in path and want in ("*", fn) for part, want in self.host_side):
                return None
            if where is None and not path.startswith(_TORCH_DIR) and path != __file__:
                where = f"{path}:{frame.f_lineno}"
            frame = frame.f_back
        return where or "?"


@dataclass(frozen=True)
class StepWindow:
    """What one global step did, from its start to the next step's start (so a log line or an
    epoch end falls in the window of the step it follows): ``reads`` (:class:`HostRead` list)
    and ``syncs`` (CUDA synchronisations torch's sync debug mode reported; 0 off CUDA)."""

    reads: list
    syncs: int


def reads_per_step(cfg, comm, **train_kw) -> dict[int, StepWindow]:
    """Train ``cfg`` (a :class:`~hpclb.config.RunConfig`) on ``comm`` with
    :func:`hpclb.train.loop.train` under a :class:`HostReadCounter` and, on a CUDA device,
    ``torch.cuda.set_sync_debug_mode("warn")``; returns each global step's
    :class:`StepWindow` (1-based). Collective like ``train``; raises what it raises."""
    from hpclb.train import loop

    counter, windows, state = HostReadCounter(), {}, {"step": None, "seen": 0}
    step = loop.train_step
    cuda = torch.cuda.is_available() and cfg.device in ("auto", "cuda")

    def close(caught: list) -> None:
        if state["step"] is not None:
            syncs = sum("synchroniz" in str(w.message) for w in caught[state["seen"]:])
            windows[state["step"]] = StepWindow(list(counter.reads), syncs)
        counter.clear()
        state["seen"] = len(caught)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def counted_step(run, *args):
            close(caught)
            state["step"] = run.pos.global_step + 1
            return step(run, *args)

        loop.train_step = counted_step
        try:
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            with counter:
                loop.train(cfg, comm, quiet=True, **train_kw)
            close(caught)
        finally:
            loop.train_step = step
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return windows
