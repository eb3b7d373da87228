"""Kinds of workload the training loop runs: what a batch is, the loss, and the eval metrics.

The loop in :mod:`hpclb.train` is the same for every kind; a :class:`Task` supplies

- ``num_train_samples``: ``N`` of the schedule (``steps_per_epoch = ceil(N / B)``, DESIGN.md);
- ``start_epoch(epoch)`` then ``batch(i)`` for step ``i`` of the epoch: this rank's share of the
  global batch (the union over ranks is the same global batch at every world size);
- ``loss(model, batch) -> (loss, stats)``: the mean loss this rank backpropagates and a float64
  ``[3]`` tensor of sums (loss sum, correct predictions, count) that is summed over ranks;
- ``train_metrics(sums, seconds)`` and ``evaluate(model, comm)``: named metrics for a
  ``metrics.jsonl`` row (accuracy, perplexity, ...);
- ``state_dict(comm)`` / ``load_state_dict``: what a checkpoint must hold beyond model, optimizer
  and RNG to resume bit for bit (the LM's carried hidden state, gathered from all ranks).

Kinds: :class:`ClassificationTask` (MNIST-LSTM, images), :class:`LanguageModelTask` (PTB).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from .comm import Communicator

EVAL_BATCH_SIZE = 2000


class Task:
    """Interface of a workload (see the module docstring). ``model_kwargs`` are passed to the
    model's constructor on top of the recipe's ``model`` section (e.g. the vocabulary size)."""

    kind = "task"
    model_kwargs: dict[str, Any] = {}
    num_train_samples: int
    num_test_samples: int

    def setup(self, *, per_rank_batch: int, global_batch: int, rank: int, world_size: int,
              seed: int, steps_per_epoch: int) -> None:
        raise NotImplementedError

    def start_epoch(self, epoch: int) -> None:
        raise NotImplementedError

    def batch(self, i: int):
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def train_metrics(self, sums: torch.Tensor, seconds: float) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, comm: Communicator) -> dict[str, float]:
        raise NotImplementedError

    def state_dict(self, comm: Communicator) -> Any:
        """Collective (every rank calls it); None when the task carries no state across steps."""
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class ClassificationTask(Task):
    """Inputs -> one label each; loss cross-entropy; metrics loss and accuracy (fraction).

    ``train``/``test`` have ``len()`` and ``batch(indices) -> (x, y)`` (y int64 ``[b]``). Batches
    come from a ``DistributedSampler`` reshuffled per epoch from the seed.
    """

    kind = "classification"

    def __init__(self, train, test):
        self.train_set, self.test_set = train, test
        self.num_train_samples, self.num_test_samples = len(train), len(test)

    def setup(self, *, per_rank_batch, global_batch, rank, world_size, seed, steps_per_epoch):
        self.per_rank_batch = per_rank_batch
        self.sampler = DistributedSampler(self.train_set, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=False)
        if math.ceil(len(self.sampler) / per_rank_batch) != steps_per_epoch:
            raise RuntimeError(f"rank {rank}: {len(self.sampler)} samples in {per_rank_batch}-"
                               f"sample batches do not make {steps_per_epoch} steps per epoch")

    def start_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.indices = torch.tensor(list(self.sampler))

    def batch(self, i: int):
        b = self.per_rank_batch
        return self.train_set.batch(self.indices[i * b:(i + 1) * b])

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        with torch.no_grad():
            stats = torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(),
                                  len(y)], dtype=torch.float64)
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
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        for start in range(0, len(idx), batch_size):
            x, y = self.test_set.batch(idx[start:start + batch_size])
            logits = model(x)
            sums[0] += F.cross_entropy(logits, y, reduction="sum").item()
            sums[1] += (logits.argmax(1) == y).sum().item()
            sums[2] += len(y)
        comm.allreduce_(sums)
        model.train()
        return {"test_loss": (sums[0] / sums[2]).item(),
                "test_accuracy": (sums[1] / sums[2]).item()}


class LanguageModelTask(Task):
    """Word-level language model with truncated BPTT (Zaremba et al. 2014).

    The global batch is ``B`` contiguous token streams (B = the batch size in sequences); each
    step reads the next ``bptt`` tokens of every stream, and the LSTM state is carried from one
    step to the next (detached: gradients are truncated at ``bptt``) and reset at each epoch.
    Rank ``r`` owns streams ``[r*b, (r+1)*b)`` (:func:`hpclb.data.ptb.rank_streams`).

    A *sample* is one ``bptt``-token sequence: ``num_train_samples = (tokens - 1) // bptt``, so
    ``ceil(N / B)`` steps make one pass over the training tokens (the last chunk may be shorter).
    Loss: cross-entropy per token (mean), so with Zaremba's sum-over-time loss and LR ``lr_Z``,
    clip ``c_Z``, the equivalent here is LR ``bptt * lr_Z`` and clip ``c_Z / bptt``.
    Metrics: ``train_perplexity``, ``valid_/test_loss`` (nats/token) and ``_perplexity``
    (``exp`` of the loss), evaluated on ``eval_streams`` streams split over the ranks.
    """

    kind = "language_model"

    def __init__(self, corpus, *, bptt: int, eval_streams: int = 10):
        self.corpus, self.bptt, self.eval_streams = corpus, int(bptt), int(eval_streams)
        self.num_train_samples = (len(corpus.train) - 1) // self.bptt
        self.num_test_samples = (len(corpus.test) - 1) // self.bptt
        self.model_kwargs = {"vocab_size": corpus.vocab_size}

    def setup(self, *, per_rank_batch, global_batch, rank, world_size, seed, steps_per_epoch):
        from .data.ptb import rank_streams

        self.x, self.y, self.streams = rank_streams(self.corpus.train, global_batch, rank,
                                                    world_size)
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        length = self.x.shape[1]
        if (steps_per_epoch - 1) * self.bptt >= length:
            raise RuntimeError(f"{steps_per_epoch} steps of {self.bptt} tokens do not fit "
                               f"streams of {length} tokens")
        self.hidden = None

    def start_epoch(self, epoch: int) -> None:
        self.hidden = None  # every epoch starts from the zero state

    def batch(self, i: int):
        s = slice(i * self.bptt, (i + 1) * self.bptt)
        return self.x[:, s], self.y[:, s]

    def loss(self, model, batch):
        x, y = batch
        logits, hidden = model(x, self.hidden)
        self.hidden = tuple(h.detach() for h in hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        stats = torch.tensor([loss.item() * y.numel(), 0.0, y.numel()], dtype=torch.float64)
        return loss, stats

    def train_metrics(self, sums, seconds):
        loss = (sums[0] / sums[2]).item()
        return {"train_loss": loss, "train_perplexity": math.exp(min(loss, 700.0)),
                "samples_per_s": sums[2].item() / self.bptt / seconds,
                "tokens_per_s": sums[2].item() / seconds}

    @torch.no_grad()
    def _nll(self, model, tokens: torch.Tensor, comm: Communicator) -> float:
        from .data.ptb import stream_layout

        n = self.eval_streams
        length = stream_layout(len(tokens), n)
        mine = list(range(comm.rank, n, comm.world_size))
        sums = torch.zeros(2, dtype=torch.float64)
        if mine:
            x = torch.stack([tokens[j * length:(j + 1) * length] for j in mine])
            y = torch.stack([tokens[j * length + 1:(j + 1) * length + 1] for j in mine])
            hidden = None
            for s in range(0, length, self.bptt):
                logits, hidden = model(x[:, s:s + self.bptt], hidden)
                t = y[:, s:s + self.bptt]
                sums[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1),
                                           reduction="sum").item()
                sums[1] += t.numel()
        comm.allreduce_(sums)
        return (sums[0] / sums[1]).item()

    def evaluate(self, model, comm):
        model.eval()
        out = {}
        for split in ("valid", "test"):
            loss = self._nll(model, getattr(self.corpus, split), comm)
            out[f"{split}_loss"] = loss
            out[f"{split}_perplexity"] = math.exp(min(loss, 700.0))
        model.train()
        return out

    def state_dict(self, comm):
        """The carried LSTM state of all ``B`` streams, ``(h, c)`` each float32
        ``[layers, B, hidden]`` (gathered from the ranks; None at an epoch start)."""
        mine = None if self.hidden is None else tuple(h.contiguous() for h in self.hidden)
        parts = comm.allgather_object(mine) if comm.world_size > 1 else [mine]
        if any(p is None for p in parts):
            return {"hidden": None}
        return {"hidden": tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(2))}

    def load_state_dict(self, state):
        hidden = (state or {}).get("hidden")
        if hidden is None:
            self.hidden = None
            return
        s = self.streams
        self.hidden = tuple(h[:, s.start:s.stop].clone() for h in hidden)


def build_task(recipe: dict, data_root, *, train_samples=None, test_samples=None) -> Task:
    """The task of ``recipe`` (``task`` key; default ``classification``) with its data loaded
    from ``data_root``. Raises DataError for missing/corrupt data, ValueError for an unknown kind.
    """
    data = recipe["data"]
    kind = recipe.get("task", "classification")
    if kind == "classification":
        from .data import load_dataset

        train, test = load_dataset(data["name"], data_root, train_samples=train_samples,
                                   test_samples=test_samples)
        return ClassificationTask(train, test)
    if kind == "language_model":
        from .data.ptb import Corpus, load_ptb

        corpus = load_ptb(data_root)
        if train_samples or test_samples:  # smoke-run subsets, counted in bptt sequences
            bptt = int(data["bptt"])
            cut = lambda t, n: t[:n * bptt + 1] if n else t  # noqa: E731
            corpus = Corpus(cut(corpus.train, train_samples), cut(corpus.valid, test_samples),
                            cut(corpus.test, test_samples), corpus.itos)
        return LanguageModelTask(corpus, bptt=data["bptt"],
                                 eval_streams=data.get("eval_streams", 10))
    if kind == "seq2seq":
        from .config import ConfigError

        raise ConfigError(f"{recipe['name']}: the seq2seq (translation) training pipeline is not "
                          f"implemented yet; this recipe only renders job scripts")
    raise ValueError(f"unknown task kind {kind!r}")
