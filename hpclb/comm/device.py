"""One device per rank: which GPU a rank trains on, found before any CUDA or MPI work.

Each rank takes GPU ``local_rank % visible_gpus`` of its node (``CUDA_VISIBLE_DEVICES`` decides
what is visible: torch counts only those). The node-local rank comes from the launcher's
environment (:func:`env_local_rank`) so the device can be bound *before* MPI/NCCL initialise
(a CUDA-aware MPI or NCCL otherwise opens a context on GPU 0 from every rank); the
communicator's own node-local split confirms it afterwards (``hpclb.comm.world.get_communicator``).
More ranks than GPUs on a node is an error unless sharing is asked for (``--share-gpu``, or
``HPCLB_SHARE_GPU=1`` in the environment: :func:`share_gpu_requested`). GPUs are told apart by
UUID (:func:`visible_gpu_uuids`), not by ``CUDA_VISIBLE_DEVICES``, which is "0" in every task
of a site that confines each task to its GPU by cgroup. See docs/gpus.md.
"""
from __future__ import annotations

import os
import platform

import torch

from hpclb.errors import ConfigError

__all__ = ["DEVICES", "SHARE_GPU_ENV", "select_device", "visible_gpus", "device_info",
           "gpus_idle_warning", "bind_local_gpu", "share_gpu_requested", "visible_gpu_uuids"]

DEVICES = ("auto", "cpu", "cuda")
SHARE_GPU_ENV = "HPCLB_SHARE_GPU"


def share_gpu_requested(share_gpu: bool = False) -> bool:
    """Whether ranks may share GPUs: ``share_gpu`` (``--share-gpu``, the ``share_gpu=``
    argument) or ``$HPCLB_SHARE_GPU`` = 1 (for scripts that call :func:`get_communicator`
    themselves; unset, empty or 0: no). Raises ConfigError naming the variable for any other
    value."""
    raw = os.environ.get(SHARE_GPU_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{SHARE_GPU_ENV}={raw!r}: use 1 (ranks of a node may share GPUs, "
                          f"as --share-gpu), 0 or leave it unset")
    return bool(share_gpu) or raw == "1"

def _check_requested(requested: str) -> None:
    if requested not in DEVICES:
        raise ConfigError(f"--device {requested!r} is not a device choice; use one of "
                          f"{', '.join(DEVICES)} (auto = cuda when a GPU is visible)")


def select_device(requested: str, local_rank: int, local_size: int, *, share_gpu: bool = False,
                  device_count: int | None = None,
                  cuda_available: bool | None = None) -> torch.device:
    """The device this rank trains on, bound as the current CUDA device.

    requested: ``auto`` (cuda when a GPU is visible, else cpu), ``cpu`` or ``cuda``.
    local_rank, local_size: this rank's index and the number of ranks on its node that see the
    same GPUs. share_gpu: allow more ranks than visible GPUs (ranks then share GPUs round robin;
    for tests on one GPU); ``$HPCLB_SHARE_GPU=1`` allows it too (:func:`share_gpu_requested`).
    device_count, cuda_available: fake a GPU node in tests (then ``torch.cuda.set_device`` is
    not called); default torch's answers (``CUDA_VISIBLE_DEVICES``
    honoured).

    Returns ``torch.device("cpu")`` or ``torch.device("cuda", local_rank % visible_gpus)``.
    Raises ConfigError for an unknown ``requested`` (naming ``--device``), ``cuda`` without a
    CUDA build or without visible GPUs (naming the fix), a negative local rank, or
    ``local_size`` greater than the visible GPUs without ``share_gpu`` (naming
    ``--share-gpu``), or a bad ``$HPCLB_SHARE_GPU``.
    """
    _check_requested(requested)
    share_gpu = share_gpu_requested(share_gpu)
    if local_rank < 0 or local_size < 1:
        raise ConfigError(f"local_rank {local_rank} / local_size {local_size}: the node-local "
                          f"rank must be >= 0 and the node's rank count >= 1")
    faked = device_count is not None or cuda_available is not None
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    n = (device_count if device_count is not None
         else torch.cuda.device_count() if cuda_available else 0)
    if requested == "cpu" or (requested == "auto" and not (cuda_available and n > 0)):
        return torch.device("cpu")
    if not cuda_available:
        raise ConfigError(
            f"--device cuda, but this torch ({torch.__version__}) has no CUDA support or no "
            f"CUDA driver: install a CUDA build of torch (`make install-gpu`) or train with "
            f"--device cpu")
    if n == 0:
        raise ConfigError(
            f"--device cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give the job GPUs or use --device cpu")
    if local_size > n and not share_gpu:
        raise ConfigError(
            f"{local_size} ranks on this node but {n} visible GPU(s): launch at most {n} "
            f"rank(s) per node, or pass --share-gpu (or set {SHARE_GPU_ENV}=1) to let ranks "
            f"share GPUs (tests only: they then contend for one GPU's memory and compute)")
    device = torch.device("cuda", local_rank % n)
    if not faked:
        torch.cuda.set_device(device)
    return device


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def visible_gpus() -> int:
    """GPUs this process can use (0 without CUDA; ``CUDA_VISIBLE_DEVICES`` honoured)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu_uuids() -> tuple[str, ...] | None:
    """The UUIDs (``GPU-xxxxxxxx-...``, as ``nvidia-smi -L`` prints them) of the GPUs this
    process sees, in torch's order: ``()`` without CUDA; None where torch cannot tell (a build
    without ``uuid`` in its device properties). Queries device properties only: no CUDA context
    is created."""
    if not torch.cuda.is_available():
        return ()
    try:
        return tuple(f"GPU-{torch.cuda.get_device_properties(i).uuid}"
                     for i in range(torch.cuda.device_count()))
    except (AttributeError, RuntimeError):
        return None


def device_info(device: torch.device | str) -> dict:
    """What the header line and ``summary.json`` say about the device.

    Returns ``{"device": "cuda:0" | "cpu", "name": GPU model or CPU model (/proc/cpuinfo),
    "memory_bytes": the GPU's total memory or the host's physical memory (bytes; None where
    unknown), "count": visible GPUs}``.
    """
    device = torch.device(device)
    count = visible_gpus()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {"device": f"cuda:{index}", "name": props.name,
                "memory_bytes": int(props.total_memory), "count": count}
    if device.type == "cpu":
        return {"device": "cpu", "name": _cpu_name(), "memory_bytes": _host_memory_bytes(),
                "count": count}
    return {"device": str(device), "name": device.type, "memory_bytes": None, "count": count}


def gpus_idle_warning(device: torch.device | str, *, device_count: int | None = None) -> str | None:
    """The warning rank 0 prints when GPUs are visible but the run trains on the CPU; None
    otherwise. ``device_count`` fakes the visible GPUs in tests."""
    n = visible_gpus() if device_count is None else device_count
    if torch.device(device).type != "cpu" or n == 0:
        return None
    return (f"warning: {n} GPU(s) visible but training on the CPU (--device cpu); they stay "
            f"idle. Use --device auto or cuda to train on them.")


def bind_local_gpu(device, local_rank: int):
    """``device`` (None/"auto": CUDA when available, else CPU) made concrete for a rank whose
    node-local rank is ``local_rank``: a CUDA device without an index becomes
    ``cuda:<local_rank % visible GPUs>`` and is made current. For backends that learn the local
    rank only after their own initialisation (Horovod, torch.distributed under torchrun)."""
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    return device
