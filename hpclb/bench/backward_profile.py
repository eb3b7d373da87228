"""When each gradient becomes ready during backward, measured (``backward_profile.json``).

The projection and its SimGrid replay need, for every gradient tensor, the moment backward
finishes it: that is when GradientSync's post-accumulate-grad hook fires and the tensor's bucket
can close. :func:`measure_ready_fractions` times a real backward of the workload on this machine
with the same hooks (``Tensor.register_post_accumulate_grad_hook``) and returns each tensor's
ready moment as a fraction of the backward's duration (0 = backward starts, 1 = it ends), the
median over ``repeats`` timed passes after one warm-up pass. The projection scales these
fractions to the GPU's backward time: a CPU backward and a GPU backward spend their time in
the same layers in roughly the same proportions (both are dominated by the convolutions' and
matrix products' FLOPs), which is the assumption docs/projection.md states.

The measured fractions are stored in ``backward_profile.json`` beside this module (package data,
with how they were measured); ``python -m hpclb.bench.backward_profile`` measures them again.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["INPUTS", "PROFILE_PATH", "load_ready_fractions", "measure_ready_fractions"]

PROFILE_PATH = Path(__file__).with_name("backward_profile.json")
#: per workload: the batch measured on this machine and a description of it
INPUTS = {"resnet50": (8, "8 images of 3x224x224, cross-entropy over 1000 classes"),
          "ptb_large": (8, "8 sequences of 35 tokens, cross-entropy over 10,000 words")}


def _batch(name: str, batch: int):
    """Random inputs and targets of workload ``name`` at ``batch`` samples (shapes of INPUTS)."""
    import torch
    g = torch.Generator().manual_seed(0)
    if name == "resnet50":
        return (torch.randn(batch, 3, 224, 224, generator=g),
                torch.randint(0, 1000, (batch,), generator=g))
    tokens = torch.randint(0, 10000, (batch, 36), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(name: str, model, x, y):
    """The workload's training loss on one batch (scalar)."""
    import torch.nn.functional as F
    out = model(x)
    if name == "ptb_large":
        return F.cross_entropy(out[0].reshape(-1, out[0].shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def measure_ready_fractions(name: str, repeats: int = 3) -> list[float]:
    """Each gradient tensor's ready moment during backward of workload ``name`` (``resnet50`` or
    ``ptb_large``, at the batch of :data:`INPUTS`, fp32 on the CPU), as a fraction of the
    backward's wall time in [0, 1], in ``named_parameters()`` order; the median over ``repeats``
    passes after a warm-up pass. Raises KeyError for another workload."""
    from hpclb.bench.workloads import WORKLOADS
    batch, _ = INPUTS[name]
    model = WORKLOADS[name]()
    params = [p for p in model.parameters() if p.requires_grad]
    stamps = [0.0] * len(params)

    def hook(i):
        def record(_p):
            stamps[i] = time.perf_counter()
        return record

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook(i))
    x, y = _batch(name, batch)
    runs = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        loss = _loss(name, model, x, y)
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        runs.append([(s - t0) / (t1 - t0) for s in stamps])
    return [statistics.median(r[i] for r in runs[1:]) for i in range(len(params))]


def load_ready_fractions(name: str) -> list[float]:
    """The stored ready fractions of workload ``name`` (one per gradient tensor, registration
    order). Raises KeyError when ``backward_profile.json`` has none for it."""
    return json.loads(PROFILE_PATH.read_text())["workloads"][name]["ready_fraction"]


def main() -> int:
    """Measure every workload of :data:`INPUTS` and write ``backward_profile.json``."""
    import torch
    out = {"how": "hpclb.bench.backward_profile.measure_ready_fractions: post-accumulate-grad "
                  "hook times / backward wall time, median of 3 passes after a warm-up",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
                      f", {torch.get_num_threads()} threads, fp32 CPU", "workloads": {}}
    for name, (batch, what) in INPUTS.items():
        fr = measure_ready_fractions(name)
        out["workloads"][name] = {"batch": what, "ready_fraction": [round(f, 4) for f in fr]}
        print(f"{name}: {len(fr)} tensors, first ready at {min(fr):.3f}, last at {max(fr):.3f}")
    PROFILE_PATH.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
