"""The horovod backend against real Horovod 0.28.1 (`make install-horovod`, then
`make test-horovod`, which sets HPCLB_TEST_HOROVOD=1 and runs this file alone under mpirun).

Skipped elsewhere: Horovod's background thread would keep cycling beside every later test of a
shared pytest process, and CI does not build Horovod (docs/testing.md).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import all_ranks_ok
from torch import nn

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(180, method="thread"),
    pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                       reason="horovod not installed (make install-horovod)"),
    pytest.mark.skipif(os.environ.get("HPCLB_TEST_HOROVOD") != "1",
                       reason="Horovod tests run alone: make test-horovod"),
]

_hvd_comm = None


def hvd_comm():
    global _hvd_comm
    if _hvd_comm is None:
        from hpclb.comm.horovod import HorovodCommunicator
        _hvd_comm = HorovodCommunicator()
    return _hvd_comm


def test_horovod_world_matches_mpi(comm):
    h = hvd_comm()
    all_ranks_ok(comm, (h.rank, h.world_size, h.local_size) ==
                 (comm.rank, comm.world_size, comm.local_size) and h.async_progress,
                 f"horovod {(h.rank, h.world_size)} vs mpi {(comm.rank, comm.world_size)}")


def test_horovod_collectives(comm):
    h, W, bad = hvd_comm(), comm.world_size, []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int64):
        for op, want in (("sum", W * (W + 1) / 2), ("max", W), ("min", 1)):
            for nb in (False, True):
                t = torch.full((4096,), comm.rank + 1, dtype=dtype)
                if nb:
                    handle = h.iallreduce_(t, op, name=f"test.{dtype}.{op}")
                    handle.wait()
                    if not handle.test():
                        bad.append("test() after wait() is False")
                else:
                    h.allreduce_(t, op)
                if not torch.equal(t, torch.full((4096,), want, dtype=dtype)):
                    bad.append(f"{dtype} {op} nb={nb}: {t[:2].tolist()}")
    with pytest.raises(TypeError, match="bfloat16"):
        h.allreduce_(torch.ones(2, dtype=torch.bfloat16))
    b = h.broadcast_(torch.full((3,), float(comm.rank)), root=W - 1)
    if b.tolist() != [float(W - 1)] * 3:
        bad.append(f"broadcast {b.tolist()}")
    if h.allgather_object(comm.rank) != list(range(W)) or h.broadcast_object(comm.rank) != 0:
        bad.append("objects")
    h.barrier()
    all_ranks_ok(comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("compression", (None, "fp16"))
def test_gradient_sync_over_horovod_equals_over_mpi(comm, compression):
    from hpclb.sync.gradients import GradientSync
    grads = {}
    for name, c in (("mpi", comm), ("horovod", hvd_comm())):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
        sync = GradientSync(model.named_parameters(), c, fusion_threshold_bytes=4096,
                            first_bucket_bytes=512, compression=compression)
        try:
            for step in range(2):
                model.zero_grad(set_to_none=False)
                g = torch.Generator().manual_seed(10 * step + c.rank)
                model(torch.randn(8, 20, generator=g)).pow(2).mean().backward()
                sync.synchronize()
        finally:
            sync.close()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    exact = comm.world_size <= 2
    same = torch.equal(grads["mpi"], grads["horovod"]) if exact else \
        torch.allclose(grads["mpi"], grads["horovod"], rtol=1e-5, atol=1e-8)
    all_ranks_ok(comm, same, f"max diff {(grads['mpi'] - grads['horovod']).abs().max().item()}")


def test_horovod_distributed_optimizer_agrees_with_gradient_sync(comm):
    """Horovod's own DistributedOptimizer (the benchmark's baseline) and hpclb give the same
    averaged gradients."""
    import horovod.torch as hvd

    from hpclb.sync.gradients import GradientSync
    hvd_comm()
    torch.manual_seed(0)
    a = nn.Linear(16, 8)
    b = nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.0),
                                   named_parameters=a.named_parameters())
    sync = GradientSync(b.named_parameters(), comm)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(comm.rank))
    opt.zero_grad()
    a(x).sum().backward()
    opt.synchronize()
    b(x).sum().backward()
    sync.synchronize()
    sync.close()
    ok = all(torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-8)
             for p, q in zip(a.parameters(), b.parameters()))
    all_ranks_ok(comm, ok, "DistributedOptimizer and GradientSync disagree")
