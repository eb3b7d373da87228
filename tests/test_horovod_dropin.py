"""``import hpclb.horovod as hvd``: Horovod's PyTorch API subset over hpclb, at 1 process and
under ``mpirun -n 2 python -m pytest --only-mpi`` (the facade), and a Horovod MNIST script
(tests/ports/horovod_mnist.py, real MNIST) run with only its import line changed, at 1 process
and under ``mpirun -n 2``, giving the result of the same script on hpclb's own API."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import LAUNCH_ENV, MPIRUN, run_bounded
from torch import nn

import hpclb.horovod as hvd
from hpclb.comm.testing import assert_all
from tests.conftest import REPO

PORTS = REPO / "tests" / "ports"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch(step: int, world_size: int, per_rank: int = 4):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(world_size * per_rank, 4, generator=g), \
        torch.randn(world_size * per_rank, 2, generator=g)


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.mpi
@pytest.mark.timeout(120, method="thread")
def test_the_world_and_the_collectives(comm):
    hvd.init()
    assert hvd.is_initialized()
    w, r = hvd.size(), hvd.rank()
    assert (w, r, hvd.local_rank(), hvd.local_size()) == \
        (comm.world_size, comm.rank, comm.local_rank, comm.local_size)
    x = torch.tensor([float(r + 1)])
    s = w * (w + 1) / 2
    assert hvd.allreduce(x, name="m").item() == s / w          # Average by default
    assert hvd.allreduce(x, average=False).item() == s
    assert hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).item() == s
    assert hvd.allreduce(x, op=hvd.Max).item() == w and hvd.allreduce(x, op=hvd.Min).item() == 1
    with pytest.raises(ValueError, match="round the mean down"):  # Horovod: 3 and 4 -> 3
        hvd.allreduce(torch.tensor([3 + r]))
    assert hvd.allgather(torch.full((1, 2), float(r))).tolist() == [[q, q] for q in range(w)]
    y = torch.tensor([float(r)])
    b = hvd.broadcast(y, root_rank=w - 1)
    assert b.item() == w - 1 and y.item() == r           # a new tensor; the input is kept
    assert hvd.broadcast_(y, root_rank=w - 1) is y and y.item() == w - 1
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    assert 0 <= hvd.join() < w
    assert hvd.mpi_built() and hvd.gloo_built() and isinstance(hvd.nccl_built(), bool)
    assert hvd.mpi_enabled() == (comm.backend == "mpi") and hvd.gloo_enabled() is False
    assert isinstance(hvd.mpi_threads_supported(), bool)
    hvd.shutdown()  # nothing to stop: the ranks stay usable, as after Horovod's re-init
    hvd.init()
    assert hvd.allreduce(x, average=False).item() == s


def test_what_is_not_provided_fails_naming_the_alternative():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(hvd.Unsupported, match="no Adasum: use op=hvd.Average"):
        hvd.DistributedOptimizer(opt, op=hvd.Adasum)
    with pytest.raises(hvd.Unsupported, match="no Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(hvd.Unsupported, match="no elastic training: use hpclb.Checkpointer"):
        hvd.elastic.run
    assert not hasattr(hvd, "elastic")
    with pytest.raises(hvd.Unsupported, match="num_groups"):
        hvd.DistributedOptimizer(opt, num_groups=2)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(opt, gradient_predivide_factor=0)


@pytest.mark.mpi
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("op, passes, compression", [
    ("Average", 1, "none"), ("Average", 2, "none"), ("Sum", 1, "none"), ("Average", 1, "fp16")])
def test_distributed_optimizer_reduces_as_horovod_does(comm, op, passes, compression):
    """Horovod's semantics: the passes of a step are summed, then averaged (or summed) over
    ranks; p.grad holds that when the step's last backward returns."""
    hvd.init()
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(inner, root_rank=0)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression),
                                   backward_passes_per_step=passes, op=getattr(hvd, op),
                                   gradient_predivide_factor=2.0 if op == "Average" else 1.0)
    assert isinstance(opt, torch.optim.SGD)
    x, y = _batch(0, comm.world_size, per_rank=2 * passes)
    try:
        opt.zero_grad()
        for m in range(passes):
            xs, ys = x[comm.rank::comm.world_size], y[comm.rank::comm.world_size]
            (model(xs[m::passes]) - ys[m::passes]).pow(2).mean().backward()
        got = _grads(model).clone()
        opt.synchronize()
        with opt.skip_synchronize():
            assert opt.step() is True
    finally:
        opt.close()
    want = torch.zeros_like(got)
    for r in range(comm.world_size):
        ref = _model()
        xs, ys = x[r::comm.world_size], y[r::comm.world_size]
        for m in range(passes):
            (ref(xs[m::passes]) - ys[m::passes]).pow(2).mean().backward()
        want += _grads(ref)
    if op == "Average":
        want /= comm.world_size
    err = (got - want).abs().max().item()
    tol = 2e-3 if compression == "fp16" else 1e-6
    assert_all(comm, err < tol * max(1.0, want.abs().max().item()), f"max |g - g_hvd| = {err}")


def _run_port(script: str, ranks: int, tmp_path, mnist_dir) -> dict:
    env = {**LAUNCH_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), str(PORTS)])}
    args = [sys.executable, str(PORTS / script), "--data-dir", str(mnist_dir),
            "--samples", "600", "--batch-size", str(32 // ranks), "--lr", "0.05",
            "--epochs", "2"]
    if ranks > 1:
        if not MPIRUN.exists():
            pytest.skip("no mpirun beside the interpreter (make install)")
        args = [str(MPIRUN), "-n", str(ranks), "--bind-to", "none", "-x", "PYTHONPATH",
                "-x", "OMP_NUM_THREADS", *args]
    out = run_bounded(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                      timeout=150, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0])


@pytest.mark.mpi
@pytest.mark.timeout(120, method="thread")
def test_horovods_order_wrap_then_broadcast_gives_no_replicas_warning(comm):
    """Horovod's scripts wrap the optimizer, then call hvd.broadcast_parameters: an unseeded
    model (different on every rank) gives no replicas-differ warning there, and the replicas
    end equal; hpclb's own DistributedOptimizer still says it broadcast them, at the line of the
    script that built it."""
    import warnings

    from hpclb.sync.agree import ReplicasDiffer

    hvd.init()
    for api in ("horovod", "hpclb"):
        torch.manual_seed(1000 + comm.rank)  # unseeded, as in many scripts: ranks differ
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if api == "horovod":
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            else:
                import hpclb
                opt = hpclb.DistributedOptimizer(opt, model, comm=comm)
        differ = [w for w in seen if issubclass(w.category, ReplicasDiffer)]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        same = all(torch.equal(flat, other) for other in comm.allgather_object(flat))
        expect_warning = api == "hpclb" and comm.world_size > 1
        # the warning points at the user's line that built the optimizer, not into hpclb
        here = all(w.filename == __file__ for w in differ)
        assert_all(comm, same and bool(differ) == expect_warning and here,
                   f"{api}: replicas equal {same}, warnings "
                   f"{[f'{w.filename}:{w.lineno}: {w.message}' for w in differ]}")
        opt.close()


JOIN_EARLY = """
import torch, hpclb.horovod as hvd
from torch import nn
hvd.init()
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
for step in range(2 if hvd.rank() == 0 else 1):   # uneven batches: rank 1 has one fewer
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
hvd.join()
"""


@pytest.mark.timeout(120)
def test_join_on_uneven_batches_names_join_and_the_fix(tmp_path):
    """A rank that reaches hvd.join() while the other still steps: the stall report names
    hvd.join() and how to even the steps, not an anonymous allgather; the job ends."""
    script = tmp_path / "join_early.py"
    script.write_text(JOIN_EARLY)
    env = {**LAUNCH_ENV, "HPCLB_STALL_TIMEOUT_S": "2", "HPCLB_STALL_ABORT_S": "6",
           "PYTHONPATH": str(REPO)}
    r = run_bounded([str(MPIRUN), "-n", "2", "--bind-to", "none", sys.executable, str(script)],
                    timeout=100, capture_output=True, env=env)
    err = r.stderr.decode()
    assert r.returncode != 0, err[-3000:]
    assert "hvd.join()" in err and "same number of steps" in err, err[-3000:]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.extended), 2])
def test_horovods_mnist_script_runs_with_its_import_changed(ranks, tmp_path, mnist_dir):
    """The same result, bit for bit, as the script on hpclb's own API; and it learns."""
    hvd_result = _run_port("horovod_mnist.py", ranks, tmp_path, mnist_dir)  # $HPCLB_DATA's
    own = _run_port("hpclb_mnist.py", ranks, tmp_path, mnist_dir)
    assert hvd_result == own
    assert hvd_result["size"] == ranks
    assert hvd_result["test_loss"] < 2.0 and hvd_result["test_accuracy"] > 0.3, hvd_result
