"""The staged MPI allreduce waits for the stream that produced the tensor (2 ranks, one GPU).

    mpirun -n 2 python benchmarks/gpu_check/stream_order.py DEVICE

On CUDA the producer stream is held ~0.1 s by torch.cuda._sleep before the values exist; the
sum must see them. On the CPU (dry run) the same allreduce runs without streams. Prints
``STREAM rank (min, max) want W cuda_aware False``; exit 1 on a wrong sum, or when the MPI
library is CUDA-aware (``HPCLB_CUDA_AWARE_MPI=0`` makes the staged path the one under test).
"""
import contextlib
import sys

import torch

from hpclb.comm.mpi import cuda_aware_mpi
from hpclb.comm.world import get_communicator

comm = get_communicator("mpi", device=sys.argv[1], share_gpu=True)
dev = comm.device
t = torch.zeros(1 << 20, device=dev)
cuda = dev.type == "cuda"
producer = torch.cuda.Stream(dev) if cuda else None
with torch.cuda.stream(producer) if cuda else contextlib.nullcontext():
    if cuda:
        torch.cuda._sleep(200_000_000)
    t.fill_(comm.rank + 1.0)
    h = comm.iallreduce_(t, op="sum")
h.wait()
if cuda:
    torch.cuda.synchronize()
want = comm.world_size * (comm.world_size + 1) / 2
got = float(t.min()), float(t.max())
aware = cuda_aware_mpi()
print("STREAM", comm.rank, dev, got, "want", want, "cuda_aware", aware, flush=True)
sys.exit(0 if comm.world_size == 2 and got == (want, want) and not aware else 1)
