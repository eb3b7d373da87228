"""Classification: inputs -> one label each (MNIST-LSTM, Fashion-MNIST, ImageNet, plug-ins)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpclb.data.registry import subset_splits
from hpclb.data.sampler import GlobalBatchSampler
from hpclb.tasks.base import EVAL_BATCH_SIZE, Task, device_of, to_device

__all__ = ["ClassificationTask"]


class ClassificationTask(Task):
    """Inputs -> one label each; loss cross-entropy; metrics loss and accuracy (fraction).

    ``train``/``test`` have ``len()`` and ``batch(indices) -> (x, y)`` (y int64 ``[b]``). Batches
    come from a :class:`~hpclb.data.sampler.GlobalBatchSampler` reshuffled per epoch from the
    seed: no padding, every sample once per epoch, the same global batches at every world size
    (a short last step's shares may be uneven or empty; see :meth:`global_size`). A training
    split with ``set_epoch(epoch, seed)`` (an augmenting ImageFolder) is told the epoch and the
    run's seed at each ``start_epoch``, so its random draws per sample are the same at every
    world size and after a resumption.

    A split with ``normalize(x)`` (an ImageFolder: uint8 images) has its inputs converted by it
    once they are on the device, in :meth:`loss` and :meth:`evaluate` (4x less to copy than
    float32; no host read).
    """

    kind = "classification"

    def __init__(self, train, test, *, num_workers: int | None = None):
        """``num_workers``: DataLoader worker processes that read a training split with
        ``sample(index, epoch)`` (an ImageFolder; :mod:`hpclb.data.loader`); None: the default
        ``min(16, CPUs per rank - 1)`` (:func:`~hpclb.data.loader.default_num_workers`); 0: read
        in the training thread. In-memory splits (MNIST, Fashion-MNIST, synthetic) are always
        read in the training thread."""
        self.train_set, self.test_set = train, test
        self.num_train_samples, self.num_test_samples = len(train), len(test)
        self.num_workers = num_workers
        self._normalize = getattr(train, "normalize", None)  # uint8 images -> model inputs

    @classmethod
    def from_data(cls, data, spec, *, train_samples=None, test_samples=None):
        """The task over a reader's ``(train, test)`` splits, cut to their first
        ``train_samples`` / ``test_samples``; ``spec.num_workers`` as below."""
        train, test = data
        return cls(*subset_splits(train, test, train_samples, test_samples, spec.name),
                   num_workers=spec.get("num_workers"))

    def setup(self, *, per_rank_batch, global_batch, rank, world_size, seed, steps_per_epoch,
              device=None):
        """``device``: the run's device (pinned batches from the loader workers when CUDA;
        None: pinned when CUDA is in use in this process)."""
        self.per_rank_batch, self.seed, self.device = per_rank_batch, seed, device
        self.epoch, self._step_loader = 0, None
        # a subclass that reads its own batches or sizes keeps them (Task.micro_batches' path)
        self._one_pass = all(getattr(type(self), m) is getattr(ClassificationTask, m)
                             for m in ("batch", "part_size", "global_size", "_part_indices"))
        self.sampler = GlobalBatchSampler(self.num_train_samples, global_batch, rank, world_size,
                                          seed)
        if self.sampler.steps_per_epoch != steps_per_epoch:
            raise RuntimeError(f"rank {rank}: {self.num_train_samples} samples in {global_batch}-"
                               f"sample global batches make {self.sampler.steps_per_epoch} steps "
                               f"per epoch, the schedule has {steps_per_epoch}")

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)
        if hasattr(self.train_set, "set_epoch"):  # per-sample augmentation draws (ImageFolder)
            self.train_set.set_epoch(epoch, seed=self.seed)
        self._loader()  # the loader workers, if any, before the epoch's first batch

    def _part_indices(self, i: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Indices of micro-batch ``part`` of ``parts`` of this rank's step ``i``: near-equal
        contiguous pieces (the last step of an epoch may be short; a piece may then be empty)."""
        mine = self.sampler.share(i)
        n = len(mine)
        return mine[part * n // parts:(part + 1) * n // parts]

    def micro_batches(self, i, parts, device):
        """:meth:`Task.micro_batches` in one pass: the sampler's plan of step ``i``, cut into the
        pieces of :meth:`_part_indices`, each read as :meth:`batch` reads it (a subclass that
        overrides those: through them, as :class:`Task` does)."""
        if not self._one_pass:
            yield from super().micro_batches(i, parts, device)
            return
        n_global, mine = self.sampler.plan[i]
        n, loader = len(mine), self._step_loader
        for part in range(parts):
            idx = mine[part * n // parts:(part + 1) * n // parts]
            if not len(idx):
                yield 0, n_global, None
                continue
            x, y = (loader.batch(self.epoch, i, part, parts) if loader is not None
                    else self.train_set.batch(idx))
            yield len(idx), n_global, (to_device(x, device), to_device(y, device))

    def part_size(self, i, part, parts):
        return len(self._part_indices(i, part, parts)), len(self._part_indices(i))

    def global_size(self, i: int) -> int:
        """Samples in global step ``i`` over all ranks (``B``, or fewer on the last step)."""
        return self.sampler.global_size(i)

    def _loader(self):
        """The split's :class:`~hpclb.data.loader.StepLoader` (made at the first batch), or None
        when the training thread reads it (no ``sample`` method, or ``num_workers`` 0)."""
        if self._step_loader is None and hasattr(self.train_set, "sample"):
            from hpclb.data.loader import StepLoader, default_num_workers

            workers = default_num_workers() if self.num_workers is None else self.num_workers
            if workers:
                device = getattr(self, "device", None)
                pin = torch.device(device).type == "cuda" if device is not None else \
                    torch.cuda.is_available() and torch.cuda.is_initialized()
                self._step_loader = StepLoader(
                    self.train_set, self._part_indices,
                    steps_per_epoch=self.sampler.steps_per_epoch, num_workers=workers,
                    pin_memory=pin)
        return self._step_loader

    def batch(self, i: int, part: int = 0, parts: int = 1):
        """``(x, y)`` of micro-batch ``part`` of ``parts`` of this rank's share of step ``i``:
        x ``[n, ...]`` as the split makes it (float32, or uint8 images that :meth:`loss`
        normalises on the device), y int64 ``[n]`` (from the loader workers when there are any;
        the same tensors either way)."""
        loader = self._loader()
        if loader is not None:
            return loader.batch(self.epoch, i, part, parts)
        return self.train_set.batch(self._part_indices(i, part, parts))

    @staticmethod
    def _inputs(split, x: torch.Tensor) -> torch.Tensor:
        """``x`` (on the device) as the model takes it: the split's ``normalize`` if it has one."""
        normalize = getattr(split, "normalize", None)
        return x if normalize is None else normalize(x)

    def loss(self, model, batch):
        x, y = batch
        normalize = self._normalize
        logits = model(x if normalize is None else normalize(x))
        loss = F.cross_entropy(logits, y)
        with torch.no_grad():  # on the device: no host sync per step
            stats = torch.stack([loss.detach().double() * len(y),
                                 (logits.argmax(1) == y).sum().double(),
                                 torch.full((), len(y), dtype=torch.float64, device=y.device)])
        return loss, stats

    def train_metrics(self, sums, seconds):
        return {"train_loss": (sums[0] / sums[2]).item(),
                "train_accuracy": (sums[1] / sums[2]).item(),
                "samples_per_s": sums[2].item() / seconds}

    @torch.no_grad()
    def evaluate(self, model, comm, batch_size: int = EVAL_BATCH_SIZE):
        """Mean loss and accuracy over the whole test split, each rank scoring a disjoint
        ``rank::world_size`` share (no padding, every sample counted once)."""
        model.eval()
        idx = torch.arange(comm.rank, len(self.test_set), comm.world_size)
        device = device_of(model)
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        for start in range(0, len(idx), batch_size):
            x, y = to_device(self.test_set.batch(idx[start:start + batch_size]), device)
            logits = model(self._inputs(self.test_set, x))
            sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum().double()
            sums[2] += len(y)
        sums = sums.cpu()
        comm.allreduce_(sums)
        model.train()
        return {"test_loss": (sums[0] / sums[2]).item(),
                "test_accuracy": (sums[1] / sums[2]).item()}
