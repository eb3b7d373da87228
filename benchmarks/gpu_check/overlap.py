"""The gradient-sync thread fed by a real ResNet-50 backward: blocking vs overlapped.

    mpirun -n 2 python benchmarks/gpu_check/overlap.py DEVICE BATCH IMAGE STEPS OUT_JSON

Two ranks (sharing the one GPU on a one-GPU machine) train ResNet-50 on random images of
BATCH x 3 x IMAGE x IMAGE with the MPI backend. Median step time (forward, backward, gradient
synchronisation, device synchronisation) over STEPS steps after 2 untimed ones, for: no
synchronisation (``compute``), GradientSync with ``overlap="none"`` (``blocking``: every bucket
reduced after backward) and with ``overlap="thread"`` (``overlapped``: the communication thread
reduces buckets while backward runs). ``hidden_fraction = 1 - (overlapped - compute) /
(blocking - compute)``: the share of the communication time hidden behind backward. The aim,
>= 0.5 on CUDA, is a figure (``target``, ``target_met``), not the verdict: exit 1 only when a
time is not finite, the world is not 2 ranks, or the MPI library was CUDA-aware (the phase
measures the staged path: ``HPCLB_CUDA_AWARE_MPI=0``).
"""
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hpclb.comm.mpi import cuda_aware_mpi
from hpclb.comm.world import get_communicator
from hpclb.models import build_model
from hpclb.sync.gradients import GradientSync

device, batch, image, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
comm = get_communicator("mpi", device=device, share_gpu=True)
dev = comm.device
cuda = dev.type == "cuda"
torch.manual_seed(0)
model = build_model("resnet50").to(dev)
x = torch.randn(batch, 3, image, image, device=dev)
y = torch.randint(0, 1000, (batch,), device=dev)


def sync_device():
    if cuda:
        torch.cuda.synchronize(dev)


def step_ms(sync):
    model.zero_grad(set_to_none=False)
    comm.barrier()
    sync_device()
    t0 = time.perf_counter()
    F.cross_entropy(model(x), y).backward()
    if sync is not None:
        sync.synchronize()
    sync_device()
    return (time.perf_counter() - t0) * 1e3


def median_ms(overlap):
    sync = None if overlap is None else GradientSync(model, comm, overlap=overlap)
    times = [step_ms(sync) for _ in range(steps + 2)][2:]
    if sync is not None:
        sync.close()
    return statistics.median(times)


res = {"device": str(dev), "world_size": comm.world_size, "batch": batch, "image": image,
       "steps": steps, "compute_ms": median_ms(None), "blocking_ms": median_ms("none"),
       "overlapped_ms": median_ms("thread")}
comm_ms = res["blocking_ms"] - res["compute_ms"]
res["communication_ms"] = comm_ms
res["hidden_fraction"] = 1 - (res["overlapped_ms"] - res["compute_ms"]) / comm_ms \
    if comm_ms > 0 else None
res["target"] = ">= 0.5 on CUDA (an aim: reported, not the verdict)"
res["target_met"] = (res["hidden_fraction"] or 0) >= 0.5 if cuda else None
res["cuda_aware_mpi"] = cuda_aware_mpi()
res["ok"] = comm.world_size == 2 and not res["cuda_aware_mpi"] and all(
    math.isfinite(res[k]) for k in ("compute_ms", "blocking_ms", "overlapped_ms"))
if comm.rank == 0:
    open(out, "w").write(json.dumps(res) + "\n")
    print("OVERLAP", json.dumps(res), flush=True)
sys.exit(0 if res["ok"] else 1)
