"""``hpclb.shard_loader`` names the argument it cannot take (it sets the order of samples
itself) instead of passing it on to torch's DataLoader, whose error names none of it."""
from __future__ import annotations

import pytest
import torch

import hpclb
from hpclb.comm.testing import ScaledComm

DATA = torch.utils.data.TensorDataset(torch.arange(100))


@pytest.mark.parametrize("kwargs, message", [
    ({"shuffle": True}, r"shuffle= is not accepted: every epoch is already a seeded "
                        r"permutation \(seed=, then loader.batch_sampler.set_epoch"),
    ({"sampler": [0, 1]}, r"sampler= is not accepted"),
    ({"batch_sampler": [[0]]}, r"batch_sampler= is not accepted"),
])
def test_arguments_shard_loader_owns_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=r"^shard_loader: " + message):
        hpclb.shard_loader(DATA, batch_size=10, comm=ScaledComm(2), **kwargs)


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, "8", True])
def test_batch_size_must_be_a_positive_int(batch_size):
    with pytest.raises(ValueError, match=r"shard_loader: batch_size must be a positive int "
                                         r"\(the global batch"):
        hpclb.shard_loader(DATA, batch_size=batch_size, comm=ScaledComm(1))


def test_batch_below_world_size_is_refused():
    with pytest.raises(ValueError, match=r"batch_size=2 \(the global batch\) must be >= the "
                                         r"world size 4"):
        hpclb.shard_loader(DATA, batch_size=2, comm=ScaledComm(4))


def test_other_dataloader_arguments_pass_through():
    loader = hpclb.shard_loader(DATA, batch_size=10, comm=ScaledComm(1), num_workers=0,
                                pin_memory=False)
    assert sum(len(b[0]) for b in loader) == 100
