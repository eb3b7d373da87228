"""Sampling without padding: one global permutation per epoch, cut into global batches.

``torch.utils.data.DistributedSampler`` pads each rank's shard to ``ceil(N / W)`` samples by
repeating samples, so the last step's global batch depends on the world size (N = 1,000,
B = 300: 100 samples on 1 rank, 102 with 2 repeated on 3 or 6 ranks). :class:`GlobalBatchSampler`
draws the same permutation as DistributedSampler (``torch.randperm(N)`` from a generator seeded
with ``seed + epoch``) and cuts it into global batches first, then deals each batch to the ranks:

- global step ``i``'s batch is ``perm[i * B:(i + 1) * B]`` (the last one may be short);
- rank ``r``'s share of it is ``batch_i[r::W]`` (shares differ by at most one sample; on a short
  last step a share may be empty).

So every sample is drawn exactly once per epoch and the union of the ranks' shares of step ``i``
is the same set at every world size. When nothing needs padding (``W`` divides ``N`` and ``B``)
rank ``r``'s shares in order are exactly DistributedSampler's ``perm[r::W]`` cut into
``B / W``-sample batches, so such runs are bit for bit unchanged. Because shares can be uneven,
a loss that is a mean over a share must be weighted by ``W * n_share / global_size(i)`` to make
the exact global mean.
"""
from __future__ import annotations

import torch

__all__ = ["GlobalBatchSampler"]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"GlobalBatchSampler: {name} must be an int >= {minimum}, "
                         f"got {value!r}")
    return value


class GlobalBatchSampler:
    """This rank's share of each global batch of an epoch, without padding.

    Args:
        num_samples: ``N``, samples in the training split (>= 1).
        global_batch: ``B``, samples per global step over all ranks (>= 1).
        rank, world_size: this process's rank ``r`` in ``[0, W)``, and ``W`` (>= 1).
        seed: the run's seed; epoch ``e`` shuffles with ``torch.randperm(N)`` from a
            ``torch.Generator`` seeded with ``seed + e`` (as DistributedSampler does).

    Raises ValueError naming the argument when one is out of range. Call :meth:`set_epoch`
    before :meth:`share` (epoch 0 is drawn at construction).
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int, world_size: int,
                 seed: int = 0):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"GlobalBatchSampler: rank {rank} must be < world_size {world_size}")
        self.seed = _check_int("seed", seed, -2**63)
        self.steps_per_epoch = -(-num_samples // global_batch)  # ceil(N / B), steps
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s global permutation (``permutation``, int64 ``[N]``) and its
        plan: ``plan[i]`` is ``(global_size(i), share(i))``, what training step ``i`` needs, for
        each step of the epoch (a list; the shares are views of the permutation, no copies)."""
        self.epoch = _check_int("epoch", epoch, 0)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        self.permutation = torch.randperm(self.num_samples, generator=g)
        self.plan = [(len(b), b[self.rank::self.world_size])
                     for b in self.permutation.split(self.global_batch)]

    def global_batch_indices(self, i: int) -> torch.Tensor:
        """Sample indices of global step ``i`` over all ranks: int64 ``[global_size(i)]``.
        Raises IndexError when ``i`` is not a step of the epoch."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.steps_per_epoch:
            raise IndexError(f"GlobalBatchSampler: step {i!r} is outside the epoch's "
                             f"{self.steps_per_epoch} steps [0, {self.steps_per_epoch})")
        b = self.global_batch
        return self.permutation[i * b:(i + 1) * b]

    def share(self, i: int) -> torch.Tensor:
        """This rank's sample indices in global step ``i``: int64 ``[n]`` with
        ``n = len(range(rank, global_size(i), world_size))`` (0 to ``ceil(B / W)``)."""
        return self.global_batch_indices(i)[self.rank::self.world_size]

    def global_size(self, i: int) -> int:
        """Samples in global step ``i`` over all ranks: ``B``, or ``N - i * B`` on the last."""
        return len(self.global_batch_indices(i))

    def __len__(self) -> int:
        """Samples this rank draws in one epoch (sum of its shares' sizes)."""
        return sum(len(range(self.rank, self.global_size(i), self.world_size))
                   for i in range(self.steps_per_epoch))
