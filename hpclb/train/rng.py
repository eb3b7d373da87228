"""Per-rank random streams and their checkpointable state.

Every rank starts with the same seed so that the model is initialised identically (and then
broadcast from rank 0); after that each rank must draw *different* dropout masks and other noise,
or W ranks apply the same mask to W different shares of the batch (issue: every rank drew the
same masks). :func:`seed_rank` reseeds all generators a rank uses with a stream of its own,
reproducible from ``(seed, rank)``; :func:`rng_state` / :func:`set_rng_state` save and restore
them, one entry per rank in the checkpoint (gathered by the training loop).

Generators covered: torch's CPU generator, the CUDA generators of every visible device (when
CUDA is initialised), Python's :mod:`random` and NumPy's legacy global generator
(``numpy.random.*``). A state saved on a GPU machine loads on a CPU-only one (the CUDA part is
skipped) and the reverse (the CUDA generators keep their seeds).
"""
from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

__all__ = ["rank_seed", "seed_rank", "rng_state", "set_rng_state", "resume_rank_rng"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of rank ``rank``'s streams in a run seeded ``seed``: a 63-bit integer from
    NumPy's ``SeedSequence`` hash of ``(seed mod 2**64, rank)`` (distinct and well mixed for
    every pair; the same in every process and Python version); ``step`` > 0 (a global step, for
    fresh streams on a resume at another world size) is hashed in too. Raises ValueError naming
    the argument for a negative ``rank``/``step`` or a non-int."""
    for name, v in (("seed", seed), ("rank", rank), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int) or (name != "seed" and v < 0):
            raise ValueError(f"{name} must be an int{'' if name == 'seed' else ' >= 0'}, "
                             f"got {v!r}")
    entropy = [seed & _MASK64, rank] + ([step] if step else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 1


def seed_rank(seed: int, rank: int, step: int = 0) -> int:
    """Seed torch (CPU and every CUDA device), :mod:`random` and ``numpy.random`` with
    :func:`rank_seed`; return that seed. Call it on every rank after the parameter broadcast."""
    s = rank_seed(seed, rank, step)
    torch.manual_seed(s)  # also seeds all CUDA devices (lazily, if CUDA is not initialised)
    random.seed(s)
    np.random.seed([s & 0xFFFFFFFF, s >> 32])
    return s


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_state() -> dict[str, Any]:
    """This process's generator states, loadable with ``torch.load(weights_only=True)``:
    ``torch`` (uint8 CPU tensor), ``cuda`` (list of uint8 tensors, one per device; None when
    CUDA is absent or not initialised), ``python`` (:func:`random.getstate`'s tuple) and
    ``numpy`` (``(name, keys int64 [624], pos, has_gauss, gauss)``)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": [t.cpu() for t in torch.cuda.get_rng_state_all()] if _cuda_ready() else None,
        "python": random.getstate(),
        "numpy": (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a :func:`rng_state` dict. CUDA states load onto the first
    ``min(saved, visible)`` devices and are skipped (logged) without CUDA; a missing part (an
    older checkpoint holding only ``torch``) is left as it is. Raises ValueError naming the key
    when a part is malformed."""
    if not isinstance(state, dict) or "torch" not in state:
        raise ValueError(f"RNG state must be a dict from hpclb.train.rng.rng_state() with a "
                         f"'torch' entry, got {type(state).__name__}")
    try:
        torch.set_rng_state(state["torch"])
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"RNG state 'torch': not a CPU generator state ({e})") from e
    cuda = state.get("cuda")
    if cuda:
        if torch.cuda.is_available():
            n = min(len(cuda), torch.cuda.device_count())
            for device in range(n):
                torch.cuda.set_rng_state(cuda[device], device)
            if n < len(cuda):
                log.info("RNG state: %d saved CUDA generator(s), %d device(s) here; restored %d",
                         len(cuda), torch.cuda.device_count(), n)
        else:
            log.info("RNG state: no CUDA here; the %d saved CUDA generator state(s) are skipped",
                     len(cuda))
    if state.get("python") is not None:
        random.setstate(_as_tuple(state["python"], "python"))
    if state.get("numpy") is not None:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), int(pos),
                             int(has_gauss), float(gauss)))


def _as_tuple(value, key: str) -> tuple:
    """random.setstate wants nested tuples; a checkpoint round trip may yield lists."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"RNG state {key!r}: expected random.getstate()'s 3-tuple, got "
                         f"{type(value).__name__}")
    return (value[0], tuple(value[1]), value[2])


def resume_rank_rng(states, *, seed: int, rank: int, world_size: int, step: int) -> str:
    """Restore this rank's streams from a checkpoint's list of per-rank :func:`rng_state` dicts
    (index = rank). With one state per rank of this world size: ``states[rank]``, bit for bit
    (returns ``"restored"``). Otherwise (another world size, or an older checkpoint with a
    single CPU state tensor): fresh streams ``seed_rank(seed, rank, step)``, reproducible but not
    the uninterrupted run's (returns ``"reseeded"``; logged). A single tensor on 1 rank is
    restored as the CPU state."""
    if isinstance(states, (list, tuple)) and len(states) == world_size:
        set_rng_state(states[rank])
        return "restored"
    if isinstance(states, torch.Tensor) and world_size == 1:
        torch.set_rng_state(states)
        return "restored"
    saved = len(states) if isinstance(states, (list, tuple)) else "no per-rank"
    log.warning("RNG: checkpoint holds %s state(s) for %d rank(s); rank %d reseeded from "
                "(seed %d, step %d)", saved, world_size, rank, seed, step)
    seed_rank(seed, rank, step)
    return "reseeded"
