"""Tests that run on every rank of `mpirun -n N python -m pytest --with-mpi` (and at N = 1).

Each rank checks locally, then verdicts are shared (``all_ranks_ok``) so a failure on one rank
fails every rank instead of leaving the others waiting in a collective.
"""
import os

import pytest
import torch
from conftest import all_ranks_ok
from helpers import quick_recipe, train_multi_and_single

from hpclb.config import resolve
from hpclb.errors import ModelMismatchError
from hpclb.models import MnistLSTM
from hpclb.sync.agree import broadcast_parameters, check_model_consistency
from hpclb.sync.gradients import GradientSync
from hpclb.train import loop as train_mod
from hpclb.train.checkpoint import load_checkpoint
from hpclb.train.metrics import read_metrics

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def test_world_size_is_what_the_launcher_asked_for(comm):
    expected = int(os.environ.get("HPCLB_EXPECT_WORLD_SIZE", comm.world_size))
    all_ranks_ok(comm, comm.world_size == expected, f"world size {comm.world_size} != {expected}")
    ranks = comm.allgather_object(comm.rank)
    assert ranks == list(range(comm.world_size))


def test_allreduce_broadcast_collectives(comm):
    t = torch.full((5,), float(comm.rank + 1))
    comm.allreduce_(t)
    total = comm.world_size * (comm.world_size + 1) / 2
    ok = torch.equal(t, torch.full((5,), total))
    m = comm.allreduce_(torch.tensor([float(comm.rank)]), op="max")
    b = comm.broadcast_(torch.tensor([float(comm.rank + 10)]), root=0)
    all_ranks_ok(comm, ok and m.item() == comm.world_size - 1 and b.item() == 10.0,
                 f"sum {t.tolist()}, max {m.item()}, bcast {b.item()}")


def test_gradients_are_averaged_union_equivalence(comm):
    """Ranks with different data end with identical parameters equal to 1-process training on
    the union of their batches (fails if gradients were not averaged)."""
    W, b, steps = comm.world_size, 8, 5
    torch.manual_seed(1234 + comm.rank)  # different init per rank: the broadcast must fix it
    model = MnistLSTM(hidden_size=16)
    broadcast_parameters(model, comm)
    torch.manual_seed(1234)
    reference = MnistLSTM(hidden_size=16)
    reference.load_state_dict(model.state_dict())
    sync = GradientSync(model.parameters(), comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        xs = torch.randn(W * b, 28, 28, generator=gen)
        ys = torch.randint(0, 10, (W * b,), generator=gen)
        mine = slice(comm.rank * b, (comm.rank + 1) * b)  # every rank sees different samples
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[mine]), ys[mine]).backward()
        sync.synchronize()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(xs), ys).backward()
        ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = comm.allgather_object(flat)
    identical = all(torch.equal(everyone[0], f) for f in everyone)
    ref_flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    close = torch.allclose(flat, ref_flat, rtol=1e-5, atol=1e-6)
    moved = not torch.allclose(flat, torch.cat([p.reshape(-1) for p in MnistLSTM(hidden_size=16)
                                                .parameters()]))
    all_ranks_ok(comm, identical and close and moved,
                 f"identical={identical} close_to_union={close} "
                 f"max_diff={(flat - ref_flat).abs().max().item():.3g}")


def test_model_mismatch_names_parameter_and_rank(comm):
    if comm.world_size == 1:
        check_model_consistency(MnistLSTM(), comm)  # nothing to compare against: passes
        return
    model = MnistLSTM(hidden_size=16 if comm.rank == comm.world_size - 1 else 32)
    with pytest.raises(ModelMismatchError) as err:
        check_model_consistency(model, comm)
    msg = str(err.value)
    all_ranks_ok(comm, f"rank {comm.world_size - 1}" in msg and "lstm.weight_ih_l0" in msg, msg)


@pytest.mark.slow
def test_multi_rank_training_equals_one_process(comm, tmp_path_factory, mnist_dir):
    """The same global batch on N ranks and on 1 process: same trajectory to float tolerance."""
    tmp = comm.broadcast_object(str(tmp_path_factory.mktemp("run")) if comm.rank == 0 else None)
    recipe = quick_recipe(tmp_path_factory.mktemp("recipe"))
    kw = dict(batch_size=512, epochs=2.5, data_dir=str(mnist_dir.parent))
    multi, single = train_multi_and_single(comm, recipe, tmp, **kw)
    a = load_checkpoint(f"{tmp}/multi/checkpoint.pt")["model"]
    b = load_checkpoint(f"{tmp}/single/checkpoint.pt")["model"]
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    acc_gap = abs(multi["final_test_accuracy"] - single["final_test_accuracy"])
    all_ranks_ok(comm, multi["world_size"] == comm.world_size and diff < 1e-4 and acc_gap <= 0.003,
                 f"max param diff {diff:.3g}, accuracy gap {acc_gap:.4f}")


COLLECTIVES = ("allreduce_", "iallreduce_", "broadcast_", "allgather", "allgather_object",
               "broadcast_object", "barrier")


def test_hpclb_train_at_k2_adds_no_collective_to_a_step(comm, tmp_path_factory, mnist_dir,
                                                        monkeypatch):
    """hpclb train at accumulation_steps=2: inside train_step the only collectives are the
    gradient buckets' allreduces (every rank counts both micro-batches, so no count of them
    is exchanged). Before: one 1-element allreduce of the window's micro-batch count per step
    at 2 ranks (the loop read as Horovod's, whose windows may be short)."""
    tmp = comm.broadcast_object(str(tmp_path_factory.mktemp("k2")) if comm.rank == 0 else None)
    recipe = quick_recipe(tmp_path_factory.mktemp("recipe"), warmup_epochs=0.0625,
                          data={"name": "mnist", "train_samples": 2048, "test_samples": 200})
    extra, steps, real_step = [], [], train_mod.train_step

    def counted_step(run, *args, **kwargs):
        buckets = {b.comm_buffer.data_ptr() for b in run.optimizer.sync.buckets}

        def counted(name, real):
            def collective(*a, **kw):
                if not (a and isinstance(a[0], torch.Tensor) and a[0].data_ptr() in buckets):
                    extra.append(name)
                return real(*a, **kw)
            return collective
        for name in COLLECTIVES:
            if hasattr(run.comm, name):
                setattr(run.comm, name, counted(name, getattr(run.comm, name)))
        try:
            steps.append(1)
            return real_step(run, *args, **kwargs)
        finally:
            for name in COLLECTIVES:
                vars(run.comm).pop(name, None)

    monkeypatch.setattr(train_mod, "train_step", counted_step)
    summary = train_mod.train(resolve(recipe, out=f"{tmp}/run", batch_size=512, epochs=1,
                                      accumulation_steps=2, data_dir=str(mnist_dir.parent)),
                              comm, quiet=True)
    all_ranks_ok(comm, len(steps) == summary["steps"] == 4 and not extra,
                 f"{len(steps)} steps at K=2 made collectives other than the gradient "
                 f"buckets': {extra}")


@pytest.mark.slow
def test_accumulation_on_n_ranks_equals_one_process_without(comm, tmp_path_factory, mnist_dir):
    """2 micro-batches per step on every rank, one allreduce per step, = the same global batch
    in one pass on 1 process. 3,584 + N samples at B 512 (a multiple of N: no padding by the
    sampler): the epoch's last step holds 1 sample per rank, split 0/1, so the parts' weights
    count too."""
    K, B = 2, 512
    if B % (comm.world_size * K):
        pytest.skip(f"global batch {B} does not split into {K} micro-batches on "
                    f"{comm.world_size} ranks")
    tmp = comm.broadcast_object(str(tmp_path_factory.mktemp("acc")) if comm.rank == 0 else None)
    recipe = quick_recipe(tmp_path_factory.mktemp("recipe"),
                          data={"name": "mnist", "train_samples": 3584 + comm.world_size,
                                "test_samples": 500})
    multi, single = train_multi_and_single(comm, recipe, tmp, single={"accumulation_steps": 1},
                                           batch_size=B, epochs=1.5, accumulation_steps=K,
                                           data_dir=str(mnist_dir.parent))
    a = load_checkpoint(f"{tmp}/multi/checkpoint.pt")["model"]
    b = load_checkpoint(f"{tmp}/single/checkpoint.pt")["model"]
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    micro = B // (comm.world_size * K)
    all_ranks_ok(comm, diff < 1e-5 and multi["micro_batch_size"] == micro
                 and multi["accumulation_steps"] == K and single["accumulation_steps"] == 1,
                 f"max param diff {diff:.3g} ({comm.world_size} ranks x {K} micro-batches of "
                 f"{multi['micro_batch_size']} vs 1 process)")


@pytest.mark.slow
def test_preemption_on_one_rank_stops_all_at_the_same_step(comm, tmp_path_factory, mnist_dir,
                                                          monkeypatch):
    tmp = comm.broadcast_object(str(tmp_path_factory.mktemp("pre")) if comm.rank == 0 else None)
    recipe = quick_recipe(tmp_path_factory.mktemp("recipe"))
    kw = dict(batch_size=512, epochs=2.5, data_dir=str(mnist_dir.parent))
    calls = {"n": 0}
    real = train_mod.PreemptionFlag.agreed

    def signal_last_rank_at_step_5(self, c):
        calls["n"] += 1
        if calls["n"] == 5 and c.rank == c.world_size - 1:
            self.requested = True  # what the SIGUSR2 handler does, on one rank only
        return real(self, c)

    monkeypatch.setattr(train_mod.PreemptionFlag, "agreed", signal_last_rank_at_step_5)
    stopped = False
    try:
        train_mod.train(resolve(recipe, out=f"{tmp}/cut", **kw), comm, quiet=True)
    except train_mod.Preempted as e:
        stopped = e.args[0] == 5
    monkeypatch.undo()
    ck = load_checkpoint(f"{tmp}/cut/checkpoint.pt")
    resumed = train_mod.train(resolve(recipe, out=f"{tmp}/cut", resume=True, **kw), comm,
                              quiet=True)
    whole = train_mod.train(resolve(recipe, out=f"{tmp}/whole", **kw), comm, quiet=True)
    rows = [read_metrics(f"{tmp}/{name}")[0] for name in ("cut", "whole")]  # epoch lines
    same_metrics = [r["train_loss"] for r in rows[0]] == [r["train_loss"] for r in rows[1]]
    all_ranks_ok(comm, stopped and ck["global_step"] == 5 and resumed["steps"] == 20
                 and same_metrics and resumed["final_test_accuracy"] == whole["final_test_accuracy"],
                 f"stopped at 5: {stopped}, checkpoint step {ck['global_step']}, resumed to "
                 f"{resumed['steps']}, epoch train losses equal to the uninterrupted run's: "
                 f"{same_metrics}")
