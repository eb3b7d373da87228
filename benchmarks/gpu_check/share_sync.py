"""Two ranks sharing one GPU (or the CPU): GradientSync over BACKEND, parameter checksums agree.

    mpirun -n 2 python benchmarks/gpu_check/share_sync.py BACKEND DEVICE

Each rank starts from its own random weights (the broadcast must fix them) and its own data;
after 5 SGD steps with averaged gradients every rank's parameter checksum must be the same.
Prints ``CHECKSUMS BACKEND DEVICE WORLD [...] cuda_aware False``; exit 1 when they differ, or
(backend mpi) when the MPI library is CUDA-aware: the staged path is the one under test.
"""
import sys

import torch
from torch import nn

from hpclb.comm.mpi import cuda_aware_mpi
from hpclb.comm.world import get_communicator
from hpclb.sync.agree import broadcast_parameters
from hpclb.sync.gradients import GradientSync

backend, device = sys.argv[1], sys.argv[2]
comm = get_communicator(backend, device=device, share_gpu=True)
dev = comm.device
torch.manual_seed(comm.rank)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10)).to(dev)
broadcast_parameters(model, comm)
sync = GradientSync(model, comm)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator(device="cpu").manual_seed(100 + comm.rank)
for _ in range(5):
    opt.zero_grad(set_to_none=False)
    model(torch.randn(32, 64, generator=g).to(dev)).pow(2).mean().backward()
    sync.synchronize()
    opt.step()
sums = comm.allgather_object(float(sum(p.double().sum() for p in model.parameters())))
aware = backend == "mpi" and cuda_aware_mpi()
print("CHECKSUMS", backend, dev, comm.world_size, sums, "cuda_aware", aware, flush=True)
sync.close()
sys.exit(0 if comm.world_size == 2 and len(set(sums)) == 1 and not aware else 1)
