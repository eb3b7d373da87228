"""Per-rank RNG streams: distinct, reproducible, checkpointable, device-portable."""
import logging
import random

import numpy as np
import pytest
import torch

from hpclb.train import rng
from hpclb.train.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.timeout(60)


def draws():
    return (torch.rand(4).tolist(), random.random(), float(np.random.rand()),
            torch.nn.functional.dropout(torch.ones(16), 0.5).tolist())


def test_ranks_get_distinct_reproducible_streams():
    seeds = [rng.seed_rank(1234, r) for r in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    per_rank = []
    for r in range(4):
        rng.seed_rank(1234, r)
        per_rank.append(draws())
    for a in range(4):
        for b in range(a + 1, 4):
            assert all(x != y for x, y in zip(per_rank[a], per_rank[b])), (a, b)
    rng.seed_rank(1234, 2)
    assert draws() == per_rank[2]
    assert rng.rank_seed(1234, 2) != rng.rank_seed(1235, 2) != rng.rank_seed(1234, 2, step=7)
    assert rng.rank_seed(-1, 0) == rng.rank_seed(2**64 - 1, 0)  # seed taken mod 2**64


def test_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    rng.seed_rank(5, 1)
    draws()
    path = save_checkpoint(tmp_path / "c.pt", {"rng": [rng.rng_state()]})
    expected = draws()
    rng.seed_rank(99, 0)  # move every generator elsewhere
    rng.set_rng_state(load_checkpoint(path)["rng"][0])  # torch.load(weights_only=True)
    assert draws() == expected


def test_gpu_state_loads_on_a_cpu_only_machine(caplog):
    state = rng.rng_state()
    assert state["cuda"] is None  # no CUDA initialised here
    expected = (state, draws())
    gpu_like = dict(expected[0], cuda=[torch.zeros(16, dtype=torch.uint8)] * 2)
    with caplog.at_level(logging.INFO, logger="hpclb.train.rng"):
        rng.set_rng_state(gpu_like)
    assert draws() == expected[1]
    if not torch.cuda.is_available():
        assert "no CUDA here" in caplog.text


def test_older_checkpoint_with_only_the_torch_state():
    rng.seed_rank(3, 0)
    saved = torch.get_rng_state()
    expected = torch.rand(3)
    rng.set_rng_state({"torch": saved})
    assert torch.equal(torch.rand(3), expected)


def test_resume_rank_rng_restores_same_world_size_and_reseeds_otherwise(caplog):
    states = []
    for r in range(2):
        rng.seed_rank(7, r)
        states.append(rng.rng_state())
    expected = draws()  # rank 1's continuation
    assert rng.resume_rank_rng(states, seed=7, rank=1, world_size=2, step=40) == "restored"
    assert draws() == expected
    with caplog.at_level(logging.WARNING, logger="hpclb.train.rng"):
        assert rng.resume_rank_rng(states, seed=7, rank=2, world_size=3, step=40) == "reseeded"
    assert "reseeded" in caplog.text
    fresh = draws()
    rng.seed_rank(7, 2, step=40)
    assert draws() == fresh


@pytest.mark.parametrize("bad,field", [({}, "'torch'"), ({"torch": torch.zeros(3)}, "'torch'"),
                                       ({"torch": torch.get_rng_state(), "python": 5},
                                        "'python'")])
def test_malformed_state_names_the_part(bad, field):
    with pytest.raises(ValueError, match=field):
        rng.set_rng_state(bad)


def test_bad_rank_or_seed():
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        rng.rank_seed(0, -1)
    with pytest.raises(ValueError, match="seed must be an int"):
        rng.rank_seed(1.5, 0)


@pytest.mark.mpi
def test_ranks_draw_different_dropout_masks_and_restore_their_own(comm):
    from conftest import all_ranks_ok

    rng.seed_rank(11, comm.rank)
    saved = comm.allgather_object(rng.rng_state())  # what a checkpoint holds, index = rank
    mask = torch.nn.functional.dropout(torch.ones(64), 0.5).tolist()
    masks = comm.allgather_object(mask)
    distinct = len({tuple(m) for m in masks}) == comm.world_size
    rng.seed_rank(0, 0)
    how = rng.resume_rank_rng(saved, seed=11, rank=comm.rank, world_size=comm.world_size, step=3)
    again = torch.nn.functional.dropout(torch.ones(64), 0.5).tolist()
    all_ranks_ok(comm, distinct and how == "restored" and again == mask,
                 f"rank {comm.rank}: distinct={distinct}, {how}, same mask after restore="
                 f"{again == mask}")
