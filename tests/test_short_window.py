"""A short accumulation window (issue 34, item 1), at 1 process and under ``mpirun -n 2 python -m
pytest --only-mpi``: ``step()`` after fewer backward passes than ``accumulation_steps`` /
``backward_passes_per_step`` (Horovod's ImageNet script at every epoch's short last batch) is ONE
update from the micro-batches given, as Horovod's is, compared update by update with a
one-process torch loop. Before: that ``step()`` returned False, every later ``zero_grad()`` was
a no-op, every update applied the running sum of all gradients since, and at 2 ranks each rank
added its own un-reduced micro-batch, so the replicas drifted apart. Backward passes and
``step()`` calls that disagree are refused, never absorbed. Short windows are Horovod's loop
(:mod:`hpclb.horovod`); ``hpclb.DistributedOptimizer`` takes K passes per ``step()`` (or a
``step()`` after every backward) and refuses a short window, naming it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hpclb
import hpclb.horovod as hvd
from hpclb.comm.testing import assert_all

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120, method="thread")]

#: accumulation_steps K -> the windows (backward passes before each step()) of the loop
WINDOWS = {2: [2, 2, 1, 2], 3: [2, 3, 1, 3]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _micro_batch(update: int, m: int, world_size: int, per_rank: int = 3):
    """Global micro-batch ``m`` of window ``update``: rank r's share is ``x[r::world_size]``."""
    g = torch.Generator().manual_seed(1000 * update + m + 7)
    return torch.randn(world_size * per_rank, 4, generator=g), \
        torch.randn(world_size * per_rank, 2, generator=g)


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _make(api: str, comm, model, k: int, **kw):
    """The DistributedOptimizer of ``api``: ``hpclb`` with ``accumulation_steps=k``, or
    hpclb.horovod's with ``backward_passes_per_step`` (``horovod-nonblocking``: that overlap
    mode, from ``$HPCLB_OVERLAP``, which the caller sets)."""
    if api.startswith("horovod"):
        hvd.init()
        return hvd.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(),
                                        backward_passes_per_step=k)
    return hpclb.DistributedOptimizer(_sgd(model), model, comm=comm, accumulation_steps=k, **kw)


def _reference_step(ref, ref_opt, parts) -> None:
    """One plain torch update of the one-process reference: the gradient is
    sum(weight * grad(mean loss of x, y)) over ``parts`` = [(x, y, weight)]."""
    ref_opt.zero_grad()
    for x, y, weight in parts:
        (_loss(ref, x, y) * weight).backward()
    ref_opt.step()


def _check_update(comm, model, ref, stepped, what: str) -> None:
    """step() said True, the replicas are equal on every rank, and equal to the reference."""
    w = _flat(model)
    everyone = comm.allgather_object(w.tolist())
    equal = all(e == everyone[0] for e in everyone)
    err = (w - _flat(ref)).abs().max().item()
    assert_all(comm, stepped is True and equal and err < 1e-6,
               f"{what}: step() returned {stepped}, replicas equal: {equal}, "
               f"max |w - w_reference| = {err:.3g}")


@pytest.mark.parametrize("api", ["horovod", "horovod-nonblocking"])
@pytest.mark.parametrize("k", [2, 3])
def test_a_short_window_is_one_update_from_the_micro_batches_given(comm, api, k, monkeypatch):
    """Windows of 2,2,1,2 (K=2) and 2,3,1,3 (K=3, the first one short) micro-batches, step()
    after each: every update is the mean over the micro-batches given (Horovod's: the passes
    summed, each loss scaled by 1/passes by the script as Horovod's ImageNet example does,
    averaged over ranks)."""
    if api == "horovod-nonblocking":
        monkeypatch.setenv("HPCLB_OVERLAP", "nonblocking")
    w, r = comm.world_size, comm.rank
    model, ref = _model(), _model()
    opt, ref_opt = _make(api, comm, model, k), _sgd(ref)
    try:
        for u, c in enumerate(WINDOWS[k]):
            opt.zero_grad()
            for m in range(c):
                x, y = _micro_batch(u, m, w)
                loss = _loss(model, x[r::w], y[r::w])
                (loss / c).backward()
            stepped = opt.step()
            _reference_step(ref, ref_opt, [(*_micro_batch(u, m, w), 1 / c) for m in range(c)])
            _check_update(comm, model, ref, stepped, f"update {u} (a window of {c} of {k})")
    finally:
        opt.close()
    assert_all(comm, opt.steps == len(WINDOWS[k]), f"{opt.steps} optimizer steps")


def test_ranks_that_give_different_numbers_of_micro_batches_in_a_short_window(comm):
    """K=2; in the second window rank 0 gives one micro-batch and the others two (at 1
    process: a short window of one). Horovod's is the ranks' mean of each rank's own (the
    script scales by its own passes)."""
    api, k, w, r = "horovod", 2, comm.world_size, comm.rank
    given = [[k] * w, [1] + [k] * (w - 1), [k] * w]  # window -> micro-batches given per rank
    model, ref = _model(), _model()
    opt, ref_opt = _make(api, comm, model, k), _sgd(ref)
    try:
        for u, counts in enumerate(given):
            opt.zero_grad()
            for m in range(counts[r]):
                x, y = _micro_batch(u, m, w)
                loss = _loss(model, x[r::w], y[r::w])
                (loss / counts[r]).backward()
            stepped = opt.step()
            parts = []
            for q in range(w):
                for m in range(counts[q]):
                    x, y = _micro_batch(u, m, w)
                    parts.append((x[q::w], y[q::w], 1 / (w * counts[q])))
            _reference_step(ref, ref_opt, parts)
            _check_update(comm, model, ref, stepped, f"update {u} ({counts} micro-batches)")
    finally:
        opt.close()


@pytest.mark.parametrize("api", ["hpclb", "horovod"])
def test_more_backward_passes_than_the_window_before_step_is_refused(comm, api):
    """Horovod raises "Gradients were computed more than backward_passes_per_step times before
    call to step()". Before: the third pass was added to the reduced gradients (at 2 ranks its
    own, un-reduced) and the next window started one pass early."""
    model = _model()
    opt = _make(api, comm, model, 2)
    x, y = _micro_batch(0, 0, comm.world_size)
    try:
        opt.zero_grad()
        for _ in range(2):
            _loss(model, x, y).backward()
        with pytest.raises(RuntimeError, match="more than 2 backward passes") as e:
            _loss(model, x, y).backward()
    finally:
        opt.close()
    assert_all(comm, "step()" in str(e.value), str(e.value))


def test_hpclbs_optimizer_refuses_a_short_window_naming_horovods(comm):
    """hpclb.DistributedOptimizer takes K backward passes per step(), or a step() after every
    backward: a step() after 2 of K=3 passes (a short window, hpclb.horovod's loop) is
    refused, naming the fix, never absorbed; a window of one pass is the per-backward loop's
    first micro-batch, and a third pass after the window's K before step() is refused; once a
    first window took K passes per step(), a later step() after one pass is a short window,
    refused (never read as the per-backward loop's micro-batch, which would drop its update)."""
    w, r = comm.world_size, comm.rank
    model = _model()
    opt = _make("hpclb", comm, model, 3)
    try:
        opt.zero_grad()
        for m in range(2):
            _loss(model, *(t[r::w] for t in _micro_batch(0, m, w))).backward()
        with pytest.raises(RuntimeError, match="hpclb.horovod"):
            opt.step()
    finally:
        opt.close()
    model = _model()
    opt = _make("hpclb", comm, model, 2)
    try:
        opt.zero_grad()
        _loss(model, *(t[r::w] for t in _micro_batch(0, 0, w))).backward()
        assert opt.step() is False  # the window's first micro-batch
        opt.zero_grad()
        _loss(model, *(t[r::w] for t in _micro_batch(1, 0, w))).backward()  # its second
        with pytest.raises(RuntimeError, match="more than 2 backward passes"):
            _loss(model, *(t[r::w] for t in _micro_batch(1, 1, w))).backward()
    finally:
        opt.close()
    model = _model()  # Horovod's loop on hpclb's optimizer, K = 2: its last window of one
    opt = _make("hpclb", comm, model, 2)  # pass is short (the first took 2 per step())
    try:
        opt.zero_grad()
        for m in range(2):
            _loss(model, *(t[r::w] for t in _micro_batch(0, m, w))).backward()
        assert opt.step() is True
        opt.zero_grad()
        _loss(model, *(t[r::w] for t in _micro_batch(1, 0, w))).backward()
        with pytest.raises(RuntimeError, match=r"short window.*scale each loss by 2 / passes"):
            opt.step()  # was: False, and the window's update silently lost
    finally:
        opt.close()


def test_horovods_loop_with_a_short_first_window_of_one_survives_refresh_parameters(comm):
    """hpclb.horovod's optimizer is Horovod's loop from the start: a first window of one pass
    is an update, as the reference's; after refresh_parameters() (which rebuilds the buckets)
    a window of one is still one (the loop is the optimizer's, not the buckets')."""
    w, r = comm.world_size, comm.rank
    model, ref = _model(), _model()
    opt, ref_opt = _make("horovod", comm, model, 2), _sgd(ref)
    try:
        for u, c in enumerate([1, 2, 1]):
            if u == 2:
                opt.refresh_parameters()
            opt.zero_grad()
            for m in range(c):
                (_loss(model, *(t[r::w] for t in _micro_batch(u, m, w))) / c).backward()
            stepped = opt.step()
            _reference_step(ref, ref_opt, [(*_micro_batch(u, m, w), 1 / c) for m in range(c)])
            _check_update(comm, model, ref, stepped, f"update {u} (a window of {c} of 2)")
    finally:
        opt.close()


def test_skipped_micro_batches_count_in_the_window(comm):
    """hpclb train's loop: every rank counts K micro-batches, an empty share with
    skip_micro_batch() (here the last rank's second), and each window is the mean over
    world_size * K as it is; a later step() after one of them is a short window, refused."""
    k, w, r = 2, comm.world_size, comm.rank
    model, ref = _model(), _model()
    opt, ref_opt = _make("hpclb", comm, model, k), _sgd(ref)
    try:
        opt.zero_grad()
        for m in range(k):
            if m and r == w - 1:
                opt.sync.skip_micro_batch()
            else:
                _loss(model, *(t[r::w] for t in _micro_batch(0, m, w))).backward()
        stepped = opt.step()
        parts = [(x[q::w], y[q::w], 1 / (w * k)) for m in range(k)
                 for x, y in [_micro_batch(0, m, w)] for q in range(w) if not (m and q == w - 1)]
        _reference_step(ref, ref_opt, parts)
        _check_update(comm, model, ref, stepped, "a full window with an empty share")
        opt.zero_grad()
        _loss(model, *(t[r::w] for t in _micro_batch(1, 0, w))).backward()
        with pytest.raises(RuntimeError, match="short window"):
            opt.step()  # this loop took K per step(): one pass is a short window, not K's first
    finally:
        opt.close()
