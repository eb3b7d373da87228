"""GlobalBatchSampler: no padding, every sample once per epoch, world-size independent batches."""
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from hpclb.data.sampler import GlobalBatchSampler

pytestmark = pytest.mark.timeout(60)


def shares(n, b, w, seed=0, epoch=0):
    """[step][rank] -> LongTensor of that rank's share."""
    samplers = [GlobalBatchSampler(n, b, r, w, seed) for r in range(w)]
    for s in samplers:
        s.set_epoch(epoch)
    return [[s.share(i) for s in samplers] for i in range(samplers[0].steps_per_epoch)]


@pytest.mark.parametrize("epoch", [0, 3])
def test_n1000_b300_every_sample_once_and_same_batches_at_w_1_3_6(epoch):
    per_w = {w: shares(1000, 300, w, seed=7, epoch=epoch) for w in (1, 3, 6)}
    for w, steps in per_w.items():
        assert len(steps) == 4
        everything = torch.cat([t for step in steps for t in step])
        assert len(everything) == 1000 and torch.equal(everything.sort().values,
                                                       torch.arange(1000)), w
        sizes = [sum(len(t) for t in step) for step in steps]
        assert sizes == [300, 300, 300, 100], (w, sizes)
    # the union of the shares of each step is the same set of samples at every world size
    for i in range(4):
        ref = set(per_w[1][i][0].tolist())
        for w in (3, 6):
            assert set(torch.cat(per_w[w][i]).tolist()) == ref, (w, i)
    last6 = [len(t) for t in per_w[6][3]]
    assert last6 == [17, 17, 17, 17, 16, 16]


def test_global_size_and_len():
    s = GlobalBatchSampler(1000, 300, rank=5, world_size=6, seed=0)
    assert [s.global_size(i) for i in range(s.steps_per_epoch)] == [300, 300, 300, 100]
    assert len(s) == 50 * 3 + 16 and len(s.share(3)) == 16
    # a share may be empty: 5 samples in the last step on 8 ranks
    t = GlobalBatchSampler(13, 8, rank=7, world_size=8)
    assert t.global_size(1) == 5 and len(t.share(1)) == 0 and len(t.share(0)) == 1


@pytest.mark.parametrize("n,b,w", [(1200, 300, 3), (1200, 300, 6), (960, 96, 4), (1000, 100, 1),
                                   (64, 16, 2)])
def test_bit_for_bit_distributed_sampler_when_nothing_is_padded(n, b, w):
    per_rank = b // w
    for epoch in (0, 1, 5):
        for r in range(w):
            ds = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=True, seed=11,
                                    drop_last=False)
            ds.set_epoch(epoch)
            ref = torch.tensor(list(ds))
            gs = GlobalBatchSampler(n, b, r, w, seed=11)
            gs.set_epoch(epoch)
            mine = torch.cat([gs.share(i) for i in range(gs.steps_per_epoch)])
            assert torch.equal(mine, ref), (n, b, w, r, epoch)
            assert all(len(gs.share(i)) == per_rank for i in range(gs.steps_per_epoch))


def test_distributed_sampler_pads_where_this_does_not():
    ds = DistributedSampler(range(1000), num_replicas=3, rank=0, shuffle=True, seed=0)
    assert len(ds) * 3 == 1002  # two repeated samples per epoch
    assert sum(len(GlobalBatchSampler(1000, 300, r, 3).share(3)) for r in range(3)) == 100


def test_epochs_reshuffle_and_are_reproducible():
    a, b = GlobalBatchSampler(100, 10, 0, 1, seed=3), GlobalBatchSampler(100, 10, 0, 1, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert torch.equal(a.share(0), b.share(0))
    b.set_epoch(3)
    assert not torch.equal(a.permutation, b.permutation)


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_samples=0, global_batch=1, rank=0, world_size=1), "num_samples"),
    (dict(num_samples=10, global_batch=0, rank=0, world_size=1), "global_batch"),
    (dict(num_samples=10, global_batch=2, rank=2, world_size=2), "rank 2 must be < world_size"),
    (dict(num_samples=10, global_batch=2, rank=0, world_size=0), "world_size"),
    (dict(num_samples=10.0, global_batch=2, rank=0, world_size=1), "num_samples"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GlobalBatchSampler(**kwargs)


@pytest.mark.parametrize("n,b,w", [(1000, 300, 6), (13, 8, 8), (1200, 300, 3)])
def test_the_epochs_plan_is_each_steps_global_size_and_share(n, b, w):
    for r in range(w):
        s = GlobalBatchSampler(n, b, rank=r, world_size=w, seed=3)
        for epoch in (0, 2):
            s.set_epoch(epoch)
            assert len(s.plan) == s.steps_per_epoch
            for i, (size, share) in enumerate(s.plan):
                assert size == s.global_size(i)
                assert torch.equal(share, s.share(i))


def test_step_outside_the_epoch_is_an_index_error():
    s = GlobalBatchSampler(10, 4, 0, 1)
    with pytest.raises(IndexError, match="outside the epoch's 3 steps"):
        s.share(3)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)


class _Split:
    """A classification split whose batch(indices) returns the indices themselves."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def batch(self, indices):
        return indices, indices


@pytest.mark.parametrize("parts", [1, 2])
def test_classification_task_draws_each_sample_once_at_any_world_size(parts):
    from hpclb.tasks import ClassificationTask

    steps = {}
    for w in (1, 3, 6):
        tasks = [ClassificationTask(_Split(1000), _Split(10)) for _ in range(w)]
        for r, t in enumerate(tasks):
            t.setup(per_rank_batch=300 // w, global_batch=300, rank=r, world_size=w, seed=5,
                    steps_per_epoch=4)
            t.start_epoch(1)
        steps[w] = [torch.cat([t.batch(i, p, parts)[0] for t in tasks for p in range(parts)])
                    for i in range(4)]
        assert [t.global_size(3) for t in tasks] == [100] * w
        assert sum(t.part_size(3, 0, parts)[1] for t in tasks) == 100
        assert torch.equal(torch.cat(steps[w]).sort().values, torch.arange(1000))
    for i in range(4):
        assert set(steps[3][i].tolist()) == set(steps[6][i].tolist()) == set(steps[1][i].tolist())


def _parts_path(task, i, parts):
    """Step i as the loop read it before Task.micro_batches: global_size, part_size, batch."""
    return [(task.part_size(i, p, parts)[0], task.global_size(i),
             task.batch(i, p, parts) if task.part_size(i, p, parts)[0] else None)
            for p in range(parts)]


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_micro_batches_are_the_parts_path_in_one_call(parts):
    """N=13, B=8 on 3 ranks: the short last step has uneven and empty pieces; one call gives
    what global_size, part_size and batch give, for the one-pass kind and a subclass that
    reads its own batches (a plug-in's override is still used)."""
    from hpclb.tasks import ClassificationTask

    class Doubled(ClassificationTask):
        def batch(self, i, part=0, parts=1):
            x, y = super().batch(i, part, parts)
            return 2 * x, y

    for kind in (ClassificationTask, Doubled):
        for r in range(3):
            t = kind(_Split(13), _Split(1))
            t.setup(per_rank_batch=3, global_batch=8, rank=r, world_size=3, seed=2,
                    steps_per_epoch=2)
            t.start_epoch(1)
            for i in range(2):
                got = list(t.micro_batches(i, parts, torch.device("cpu")))
                want = _parts_path(t, i, parts)
                assert [g[:2] for g in got] == [w[:2] for w in want]
                assert all((g[2] is None) == (w[2] is None) for g, w in zip(got, want))
                assert all(torch.equal(g[2][0], w[2][0]) and torch.equal(g[2][1], w[2][1])
                           for g, w in zip(got, want) if w[2] is not None)
    t = Doubled(_Split(13), _Split(1))
    t.setup(per_rank_batch=8, global_batch=8, rank=0, world_size=1, seed=2, steps_per_epoch=2)
    (_, _, (x, _)), = t.micro_batches(0, 1, torch.device("cpu"))
    assert torch.equal(x, 2 * t.sampler.share(0))


def test_task_micro_batches_default_goes_through_the_plug_in_interface():
    """A plug-in Task that defines only batch and part_size (and global_batch in setup) is read
    by the default Task.micro_batches: sizes from it, the batch moved to the device."""
    from hpclb.tasks import Task

    class Mine(Task):
        global_batch = 6

        def batch(self, i, part=0, parts=1):
            return {"x": torch.full((2,), float(10 * i + part))}

        def part_size(self, i, part, parts):
            return (0 if part == 1 else 2), 2 * parts

    got = list(Mine().micro_batches(3, 3, torch.device("cpu")))
    assert [(n, g) for n, g, _ in got] == [(2, 6), (0, 6), (2, 6)]
    assert got[1][2] is None and torch.equal(got[2][2]["x"], torch.full((2,), 32.0))


def test_classification_task_rejects_a_schedule_with_other_steps_per_epoch():
    from hpclb.tasks import ClassificationTask

    with pytest.raises(RuntimeError, match="make 4 steps per epoch, the schedule has 3"):
        ClassificationTask(_Split(1000), _Split(1)).setup(
            per_rank_batch=100, global_batch=300, rank=0, world_size=3, seed=0,
            steps_per_epoch=3)


def test_task_global_size_default_is_the_global_batch():
    from hpclb.tasks import Task

    t = Task()
    with pytest.raises(NotImplementedError, match="global_size"):
        t.global_size(0)
    t.per_rank_batch, t.world_size = 4, 3
    assert t.global_size(0) == 12
    t.global_batch = 20
    assert t.global_size(7) == 20


@pytest.mark.mpi
def test_ranks_shares_form_the_one_process_global_batches(comm):
    """Under mpirun: the shares gathered from all ranks are the 1-process batches, each sample
    once per epoch, for N=1000, B=300 (uneven last step at W=3 or 6)."""
    from conftest import all_ranks_ok

    w = comm.world_size
    mine = GlobalBatchSampler(1000, 300, comm.rank, w, seed=9)
    mine.set_epoch(2)
    one = GlobalBatchSampler(1000, 300, 0, 1, seed=9)
    one.set_epoch(2)
    gathered = comm.allgather_object([mine.share(i).tolist() for i in range(4)])
    steps_ok = all(sorted(x for rank in gathered for x in rank[i]) ==
                   sorted(one.share(i).tolist()) for i in range(4))
    everything = sorted(x for rank in gathered for step in rank for x in step)
    all_ranks_ok(comm, steps_ok and everything == list(range(1000)),
                 f"world size {w}: shares do not form the 1-process global batches")
