"""Kinds of workload the training loop runs: what a batch is, the loss, and the eval metrics.

The loop in :mod:`hpclb.train.loop` is the same for every kind; a :class:`Task` supplies

- ``num_train_samples``: ``N`` of the schedule (``steps_per_epoch = ceil(N / B)``, docs/design.md);
- ``start_epoch(epoch)`` then ``batch(i)`` for step ``i`` of the epoch: this rank's share of the
  global batch (the union over ranks is the same global batch at every world size; the loop
  reads a step through ``micro_batches(i, parts, device)``, which by default calls these);
  ``batch(i, part, parts)`` is micro-batch ``part`` of ``parts`` of that share (gradient
  accumulation), and ``part_size(i, part, parts) -> (n_part, n_share)`` the units (samples,
  sentences, streams) the two mean losses average over, so that the loop can weight the parts;
- ``loss(model, batch) -> (loss, stats)``: the mean loss this rank backpropagates and a float64
  ``[3]`` tensor of sums (loss sum, correct predictions, count) that is summed over ranks;
- ``train_metrics(sums, seconds)`` and ``evaluate(model, comm)``: named metrics for a
  ``metrics.jsonl`` row (accuracy, perplexity, ...);
- ``state_dict(comm)`` / ``load_state_dict``: what a checkpoint must hold beyond model, optimizer
  and RNG to resume bit for bit (the LM's carried hidden state, gathered from all ranks).

Kinds (:data:`hpclb.tasks.registry.TASKS`): :class:`~hpclb.tasks.classification.ClassificationTask`
(MNIST-LSTM, images), :class:`~hpclb.tasks.language_model.LanguageModelTask` (PTB),
:class:`~hpclb.tasks.seq2seq.Seq2seqTask` (translation). A kind also has the class method
``from_data(data, spec, *, train_samples, test_samples)``: the task over what its data set's
reader returned (:mod:`hpclb.data.registry`) for the recipe's data section ``spec``.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from hpclb.comm.base import Communicator
from hpclb.data.loader import pin_batch

__all__ = ["EVAL_BATCH_SIZE", "DatasetSplit", "Task", "device_of", "to_device"]

EVAL_BATCH_SIZE = 2000


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter; the CPU for a model without parameters."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def to_device(batch, device: torch.device):
    """``batch`` (a tensor, or tuples/lists/dicts of them; other values kept) on ``device``:
    CPU tensors are pinned and copied with ``non_blocking=True`` for a CUDA device."""
    if torch.is_tensor(batch):
        if batch.device == device:
            return batch
        if device.type == "cuda" and batch.device.type == "cpu":
            return pin_batch(batch).to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Task:
    """Interface of a workload (see the module docstring). ``model_kwargs`` are passed to the
    model's constructor on top of the recipe's ``model`` section (e.g. the vocabulary size)."""

    kind = "task"
    decoding: str | None = None  # how evaluate() produces outputs, where it decodes (seq2seq)
    model_kwargs: dict[str, Any] = {}
    num_train_samples: int
    num_test_samples: int

    def setup(self, *, per_rank_batch: int, global_batch: int, rank: int, world_size: int,
              seed: int, steps_per_epoch: int, device=None) -> None:
        raise NotImplementedError

    def start_epoch(self, epoch: int) -> None:
        raise NotImplementedError

    def batch(self, i: int, part: int = 0, parts: int = 1):
        raise NotImplementedError

    def part_size(self, i: int, part: int, parts: int) -> tuple[int, int]:
        """``(n_part, n_share)``: units in micro-batch ``part`` and in this rank's whole share
        of step ``i`` (default: equal parts)."""
        return 1, parts

    def global_size(self, i: int) -> int:
        """Units (samples, sentences, streams) in global step ``i`` over all ranks, so that the
        loop can weight a rank's mean loss by ``W * K * n_part / global_size(i)`` into the exact
        global mean when shares are uneven. Default: the full global batch, ``global_batch``
        (or ``per_rank_batch * world_size``) as stored by ``setup``."""
        size = getattr(self, "global_batch", None)
        if size is None and hasattr(self, "per_rank_batch") and hasattr(self, "world_size"):
            size = self.per_rank_batch * self.world_size
        if size is None:
            raise NotImplementedError(f"{type(self).__name__}.global_size: store global_batch "
                                      f"in setup() or override global_size(i)")
        return int(size)

    def micro_batches(self, i: int, parts: int, device: torch.device
                      ) -> Iterator[tuple[int, int, Any]]:
        """Step ``i``'s ``parts`` micro-batches of this rank's share, in order, one
        ``(n_part, n_global, batch)`` each: ``n_part`` units in the micro-batch (0: an empty
        one, ``batch`` None), ``n_global`` units in the global step over all ranks (the loss
        weight's denominator) and ``batch`` on ``device``. What the training loop calls; the
        default goes through :meth:`global_size`, :meth:`part_size`, :meth:`batch` and
        :func:`to_device`, so a task needs only those (a kind may override it with one pass)."""
        n_global = self.global_size(i)
        for part in range(parts):
            n_part, _ = self.part_size(i, part, parts)
            yield n_part, n_global, (to_device(self.batch(i, part, parts), device) if n_part
                                     else None)

    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def train_metrics(self, sums: torch.Tensor, seconds: float) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, comm: Communicator) -> dict[str, float]:
        raise NotImplementedError

    @classmethod
    def from_recipe(cls, data, recipe, *, train_samples=None, test_samples=None) -> "Task":
        """The task over ``data`` (what the data set's reader returned) for ``recipe`` (a
        :class:`~hpclb.tasks.spec.Recipe`); by default ``from_data(data, recipe.data, ...)``.
        A kind that reads more of the recipe (its ``task`` section) overrides this."""
        return cls.from_data(data, recipe.data, train_samples=train_samples,
                             test_samples=test_samples)

    def state_dict(self, comm: Communicator) -> Any:
        """Collective (every rank calls it); None when the task carries no state across steps."""
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class DatasetSplit:
    """A torch ``Dataset`` of ``(x, y)`` pairs (a plug-in data set) as a split.

    ``len()``, ``subset(n)`` (the first ``n`` samples) and ``batch(indices) -> (x, y)``: the
    samples at ``indices`` (int64 ``[b]`` tensor or list) through
    ``torch.utils.data.default_collate`` (so ``x`` is the stacked inputs, ``[b, ...]``); ``y``
    int64 ``[b]`` class labels when ``class_labels`` (classification), else as collated (e.g.
    float32 ``[b, ...]`` regression targets). Uses the dataset's ``__getitems__`` where it has
    one (one call per batch).
    """

    def __init__(self, dataset, *, where: str = "data.name", class_labels: bool = True):
        self.dataset, self.where, self.class_labels = dataset, where, class_labels

    def __len__(self) -> int:
        return len(self.dataset)

    def subset(self, n: int) -> "DatasetSplit":
        from torch.utils.data import Subset

        return DatasetSplit(Subset(self.dataset, range(min(n, len(self)))), where=self.where,
                            class_labels=self.class_labels)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        idx = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        if not idx:  # an empty share: the shapes of sample 0, zero rows
            x, y = self.batch([0])
            return x[:0], y[:0]
        get = getattr(self.dataset, "__getitems__", None)
        samples = get(idx) if get is not None else [self.dataset[i] for i in idx]
        try:
            x, y = default_collate(samples)
        except (TypeError, RuntimeError, ValueError) as e:  # not ConfigError: may be one rank
            y_rule = "an integer class label" if self.class_labels else "of one shape"
            raise RuntimeError(f"{self.where}: the samples at {idx[:4]}... do not collate into "
                               f"a batch ({e}); every x must have one shape and dtype and every "
                               f"y be {y_rule}") from e
        if not self.class_labels:
            return x, torch.as_tensor(y)
        return x, torch.as_tensor(y).to(torch.int64).reshape(-1)
