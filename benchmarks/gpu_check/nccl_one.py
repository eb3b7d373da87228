"""World size 1 through the torch backend (NCCL on CUDA, Gloo on the CPU), no launcher.

    python benchmarks/gpu_check/nccl_one.py DEVICE OUT_JSON

An allreduce of ones and 3 GradientSync steps of a small model; writes the process group's
backend and the results. Exit 1 when the sum is wrong or CUDA did not get NCCL.
"""
import json
import sys

import torch
from torch import nn

from hpclb.comm.world import get_communicator
from hpclb.sync.gradients import GradientSync

comm = get_communicator("torch", device=sys.argv[1])
dev = comm.device
import torch.distributed as dist  # noqa: E402  (initialised by the communicator)

t = torch.ones(1000, device=dev)
comm.allreduce_(t)
model = nn.Linear(32, 4).to(dev)
sync = GradientSync(model, comm)
for _ in range(3):
    model(torch.randn(8, 32, device=dev)).sum().backward()
    sync.synchronize()
if dev.type == "cuda":
    torch.cuda.synchronize()
res = {"backend": str(dist.get_backend()), "world_size": comm.world_size, "device": str(dev),
       "allreduce_ok": bool((t == 1).all())}
res["ok"] = res["allreduce_ok"] and comm.world_size == 1 and \
    (dev.type != "cuda" or res["backend"] == "nccl")
open(sys.argv[2], "w").write(json.dumps(res) + "\n")
print("NCCL1", res, flush=True)
sync.close()
sys.exit(0 if res["ok"] else 1)
