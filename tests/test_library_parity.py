"""What Horovod, Lightning and torchrun users expect from the library: preemption-safe
checkpoints (examples/preemptible.py under ``mpirun -n 2``, real MNIST), the collectives, and an
evaluation over a data set split across ranks (at 1 process and under ``mpirun -n 2 pytest``)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import hpclb
from hpclb.comm.testing import assert_all
from tests.conftest import REPO
from tests.test_library_abort import run_ranks

EXAMPLE = REPO / "examples" / "preemptible.py"


def _example(tmp_path, *argv: str):
    body = (f"import runpy; sys.argv = [{str(EXAMPLE)!r}, *{list(argv)!r}]\n"
            f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n")
    return run_ranks(body, tmp_path, timeout=200,
                     env={"HPCLB_DATA": os.environ.get("HPCLB_DATA", str(REPO / "data"))})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_preempted_library_run_resumes_to_the_uninterrupted_result(mnist_dir, tmp_path):
    """SIGUSR2 on rank 1 after step 10 of 32: every rank exits 75 with the checkpoint on disk;
    the next run resumes and ends with the uninterrupted run's parameters, bit for bit (dropout
    streams per rank restored). Before: no library checkpointing existed."""
    cut = str(tmp_path / "cut")
    rc, out, err, _ = _example(tmp_path, "--out", cut, "--signal-at", "10")
    assert rc == 75, err[-3000:]
    assert "checkpoint of step 10 saved" in err
    assert (tmp_path / "cut" / "checkpoint.pt").is_file()
    rc, out, err, _ = _example(tmp_path, "--out", cut)
    assert rc == 0, err[-3000:]
    resumed = json.loads(out.strip().splitlines()[-1])
    rc, out, err, _ = _example(tmp_path, "--out", str(tmp_path / "whole"))
    assert rc == 0, err[-3000:]
    whole = json.loads(out.strip().splitlines()[-1])
    assert resumed["resumed_from"] == 10 and whole["resumed_from"] == 0
    assert resumed["steps"] == whole["steps"] == 32
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["accuracy"] == whole["accuracy"] > 0.8


class _Data(torch.utils.data.Dataset):
    """1001 samples (odd: shards differ at 2 ranks); target = sample index."""

    def __len__(self):
        return 1001

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(i)


@pytest.mark.mpi
@pytest.mark.timeout(120, method="thread")
def test_evaluate_counts_every_sample_once_at_any_world_size(comm):
    model = nn.Identity()
    got = hpclb.evaluate(model, _Data(), lambda out, y: {"x": out[:, 0], "one": torch.ones(len(y)),
                                                         "sq": out[:, 0] ** 2},
                         batch_size=64, comm=comm)
    want = {"x": 500.0, "one": 1.0, "sq": sum(i * i for i in range(1001)) / 1001}
    ok = all(abs(got[k] - v) <= 1e-9 * max(1.0, v) for k, v in want.items())
    assert_all(comm, ok, f"{got} != {want}")


@pytest.mark.mpi
@pytest.mark.timeout(120, method="thread")
def test_collectives(comm):
    w, r = comm.world_size, comm.rank
    x = torch.tensor([float(r + 1), 2.0 * r])
    mean = hpclb.allreduce(x, comm=comm)
    total = hpclb.allreduce(x, op="sum", comm=comm)
    top = hpclb.allreduce(x, op="max", comm=comm)
    gathered = hpclb.allgather(torch.full((r + 1, 2), float(r)), comm=comm)
    b = hpclb.broadcast(torch.tensor([float(r)]), root=w - 1, comm=comm)
    obj = hpclb.broadcast_object({"rank": r}, comm=comm)
    hpclb.barrier(comm=comm)
    s = sum(range(1, w + 1))
    ok = (torch.equal(total, torch.tensor([float(s), float(w * (w - 1))]))
          and torch.allclose(mean, total / w) and torch.equal(top, torch.tensor([w, 2.0 * (w - 1)]))
          and torch.equal(x, torch.tensor([float(r + 1), 2.0 * r]))  # the input is kept
          and gathered.shape == (w * (w + 1) // 2, 2) and b.item() == w - 1 and obj == {"rank": 0})
    assert_all(comm, ok, f"{mean} {total} {top} {gathered.shape} {b} {obj}")
    with pytest.raises(ValueError, match="op='avg'"):
        hpclb.allreduce(x, op="avg", comm=comm)
    # before: integer tensors 3 and 4 averaged to 3, silently; now refused on every rank
    with pytest.raises(ValueError, match="round the mean down.*op='sum'"):
        hpclb.allreduce(torch.tensor([3 + r]), comm=comm)
    assert_all(comm, hpclb.allreduce(torch.tensor([3 + r]), op="sum", comm=comm).item()
               == sum(3 + q for q in range(w)), "integer sum")
