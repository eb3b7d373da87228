"""Supervised learning with the recipe's own loss and metrics (regression, multi-label, ...).

A recipe names them (docs/plugins.md)::

    task:
      name: supervised
      loss: my_regression:mse          # fn(output, y) -> the batch's mean loss, a scalar tensor
      metrics:                         # each reported as test_<name> after every epoch
        mse: my_regression:mse
        mae: my_regression:mae
    target: {metric: test_mse, mode: min}

The batches are the classification task's (one global permutation per epoch, dealt to the
ranks, no padding; :class:`~hpclb.tasks.classification.ClassificationTask`), with ``y`` as the
data function's samples collate (any dtype and shape). The metrics' direction (for sweeps, plots
and ``best_*``) is :func:`hpclb.tasks.spec.metric_mode`'s: the target's ``mode`` for the target
metric, else from the name (``mse``, ``mae``, ``loss``, ``error``: lower is better).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from hpclb.data.registry import subset_splits
from hpclb.errors import ConfigError
from hpclb.plugins import load_object
from hpclb.tasks.base import EVAL_BATCH_SIZE, device_of, to_device
from hpclb.tasks.classification import ClassificationTask

__all__ = ["SupervisedTask"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _scalar(value, what: str) -> torch.Tensor:
    """``value`` as a 0-dim tensor; RuntimeError naming ``what`` for anything else."""
    if not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise RuntimeError(f"{what} returned {type(value).__name__} "
                           f"{getattr(value, 'shape', '')}, not a scalar tensor (the batch's "
                           f"mean)")
    return value.reshape(())


class SupervisedTask(ClassificationTask):
    """``(x, y)`` samples, ``output = model(x)``; the loss is ``loss_fn(output, y)`` (the
    batch's mean, a scalar tensor) and each metric ``fn(output, y)`` (the batch's mean) is
    averaged over the test split, weighted by batch size, into ``test_<name>``. Epoch rows:
    ``train_loss``, ``test_loss`` and the metrics."""

    kind = "supervised"

    def __init__(self, train, test, *, loss_fn: LossFn,
                 metric_fns: Mapping[str, LossFn] | None = None, num_workers: int | None = None):
        super().__init__(train, test, num_workers=num_workers)
        self.loss_fn, self.metric_fns = loss_fn, dict(metric_fns or {})

    @classmethod
    def from_recipe(cls, data, recipe, *, train_samples=None, test_samples=None):
        """The task over the reader's ``(train, test)`` with ``recipe.task_spec``'s loss and
        metrics imported (ConfigError naming ``task.loss``/``task.metrics.<name>``)."""
        spec = recipe.task_spec
        if not spec.loss:
            raise ConfigError("task.loss: required by task supervised; name your loss function "
                              "as package.module:function, e.g. `loss: my_regression:mse`")
        train, test = data
        return cls(*subset_splits(train, test, train_samples, test_samples, recipe.data.name),
                   loss_fn=load_object(spec.loss, "task.loss"),
                   metric_fns={m: load_object(ref, f"task.metrics.{m}")
                               for m, ref in spec.metrics.items()},
                   num_workers=recipe.data.get("num_workers"))

    def _loss(self, output, y) -> torch.Tensor:
        return _scalar(self.loss_fn(output, y), "task.loss")

    def _metric_sums(self, output, y) -> list[torch.Tensor]:
        n = float(len(y))
        return [_scalar(fn(output, y), f"task.metrics.{m}").detach().double() * n
                for m, fn in self.metric_fns.items()]

    def loss(self, model, batch):
        x, y = batch
        loss = self._loss(model(self._inputs(self.train_set, x)), y)
        with torch.no_grad():  # on the device: no host sync per step
            n = torch.tensor(float(len(y)), dtype=torch.float64, device=loss.device)
            stats = torch.stack([loss.detach().double() * n, torch.zeros_like(n), n])
        return loss, stats

    def train_metrics(self, sums, seconds):
        return {"train_loss": (sums[0] / sums[2]).item(),
                "samples_per_s": sums[2].item() / seconds}

    @torch.no_grad()
    def evaluate(self, model, comm, batch_size: int = EVAL_BATCH_SIZE):
        """``test_loss`` and ``test_<metric>`` over the whole test split, each rank scoring a
        disjoint ``rank::world_size`` share; sums are allreduced (float64)."""
        model.eval()
        idx = torch.arange(comm.rank, len(self.test_set), comm.world_size)
        device = device_of(model)
        sums = torch.zeros(2 + len(self.metric_fns), dtype=torch.float64, device=device)
        for start in range(0, len(idx), batch_size):
            x, y = to_device(self.test_set.batch(idx[start:start + batch_size]), device)
            out = model(self._inputs(self.test_set, x))
            n = float(len(y))
            sums += torch.stack([self._loss(out, y).double() * n,
                                 torch.tensor(n, dtype=torch.float64, device=device),
                                 *self._metric_sums(out, y)])
        sums = sums.cpu()
        comm.allreduce_(sums)
        model.train()
        names = ["test_loss", *(f"test_{m}" for m in self.metric_fns)]
        values = [sums[0], *sums[2:]]
        return {name: (v / sums[1]).item() for name, v in zip(names, values)}
