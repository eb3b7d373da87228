"""Kinds of workload the training loop runs: what a batch is, the loss, and the eval metrics.

The loop in :mod:`hpclb.train.loop` is the same for every kind; a :class:`Task` supplies

- ``num_train_samples``: ``N`` of the schedule (``steps_per_epoch = ceil(N / B)``, docs/design.md);
- ``start_epoch(epoch)`` then ``batch(i)`` for step ``i`` of the epoch: this rank's share of the
  global batch (the union over ranks is the same global batch at every world size);
  ``batch(i, part, parts)`` is micro-batch ``part`` of ``parts`` of that share (gradient
  accumulation), and ``part_size(i, part, parts) -> (n_part, n_share)`` the units (samples,
  sentences, streams) the two mean losses average over, so that the loop can weight the parts;
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

from hpclb.data.sampler import GlobalBatchSampler
from hpclb.dist import Communicator

EVAL_BATCH_SIZE = 2000


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def to_device(batch, device: torch.device):
    """``batch`` (a tensor, or tuples/lists/dicts of them; other values kept) on ``device``:
    CPU tensors are pinned and copied with ``non_blocking=True`` for a CUDA device."""
    if torch.is_tensor(batch):
        if batch.device == device:
            return batch
        if device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
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
    come from a :class:`~hpclb.data.sampler.GlobalBatchSampler` reshuffled per epoch from the
    seed: no padding, every sample once per epoch, the same global batches at every world size
    (a short last step's shares may be uneven or empty; see :meth:`global_size`). A training
    split with ``set_epoch(epoch, seed)`` (an augmenting ImageFolder) is told the epoch and the
    run's seed at each ``start_epoch``, so its random draws per sample are the same at every
    world size and after a resumption.
    """

    kind = "classification"

    def __init__(self, train, test, *, num_workers: int | None = None):
        """``num_workers``: DataLoader worker processes that read a training split with
        ``sample(index, epoch)`` (an ImageFolder; :mod:`hpclb.data.loader`); None: the default
        ``min(4, CPUs per rank)``; 0: read in the training thread. In-memory splits (MNIST,
        Fashion-MNIST, synthetic) are always read in the training thread."""
        self.train_set, self.test_set = train, test
        self.num_train_samples, self.num_test_samples = len(train), len(test)
        self.num_workers = num_workers

    def setup(self, *, per_rank_batch, global_batch, rank, world_size, seed, steps_per_epoch,
              device=None):
        """``device``: the run's device (pinned batches from the loader workers when CUDA;
        None: pinned when CUDA is in use in this process)."""
        self.per_rank_batch, self.seed, self.device = per_rank_batch, seed, device
        self.epoch, self._step_loader = 0, None
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

    def _part_indices(self, i: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Indices of micro-batch ``part`` of ``parts`` of this rank's step ``i``: near-equal
        contiguous pieces (the last step of an epoch may be short; a piece may then be empty)."""
        mine = self.sampler.share(i)
        n = len(mine)
        return mine[part * n // parts:(part + 1) * n // parts]

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
        x float32 ``[n, ...]``, y int64 ``[n]`` (from the loader workers when there are any;
        the same tensors either way)."""
        loader = self._loader()
        if loader is not None:
            return loader.batch(self.epoch, i, part, parts)
        return self.train_set.batch(self._part_indices(i, part, parts))

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        with torch.no_grad():  # on the device: no host sync per step
            stats = torch.stack([loss.detach().double() * len(y),
                                 (logits.argmax(1) == y).sum().double(),
                                 torch.tensor(float(len(y)), dtype=torch.float64, device=y.device)])
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
        device = _device_of(model)
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        for start in range(0, len(idx), batch_size):
            x, y = to_device(self.test_set.batch(idx[start:start + batch_size]), device)
            logits = model(x)
            sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum().double()
            sums[2] += len(y)
        sums = sums.cpu()
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

    def setup(self, *, per_rank_batch, global_batch, rank, world_size, seed, steps_per_epoch,
              device=None):
        from hpclb.data.ptb import rank_streams

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

    def batch(self, i: int, part: int = 0, parts: int = 1):
        """Window ``i`` of this rank's streams; with ``parts`` > 1, of the streams of micro-batch
        ``part`` (``b / parts`` each, a divisor: the loop checks ``B % (W * parts) == 0``).

        Micro-batches split the *streams*, never the ``bptt`` window: every stream still
        backpropagates through its whole window from the state carried from its previous window,
        so the truncation is the same as without accumulation, and each part (same window
        length, same number of streams) holds the same number of tokens, so the mean of the
        parts' per-token means is the share's. Splitting the window in time instead would cut
        the gradient at the sub-window boundaries (a different, shorter BPTT)."""
        s = slice(i * self.bptt, (i + 1) * self.bptt)
        m = self.x.shape[0] // parts
        rows = slice(part * m, (part + 1) * m)
        return self.x[rows, s], self.y[rows, s], rows

    def part_size(self, i, part, parts):
        """Streams: ``b / parts`` in each micro-batch of this rank's ``b`` (always even)."""
        b = self.x.shape[0]
        return b // parts, b

    def loss(self, model, batch):
        x, y, rows = batch
        b = self.x.shape[0]
        if rows.start == 0 and rows.stop == b:  # the rank's whole share (no accumulation)
            carried = None if self.hidden is None else tuple(h.to(x.device) for h in self.hidden)
            logits, hidden = model(x, carried)
            self.hidden = tuple(h.detach() for h in hidden)
        else:  # a micro-batch: its streams' rows of the carried [layers, b, hidden] state; the
            # parts' new states replace the carried one after the last part of the window
            mine = None if self.hidden is None else \
                tuple(h[:, rows].contiguous().to(x.device) for h in self.hidden)
            logits, hidden = model(x, mine)
            self._pending = (self._pending if rows.start else []) + \
                [tuple(h.detach() for h in hidden)]
            if rows.stop == b:
                self.hidden = tuple(torch.cat(hs, dim=1) for hs in zip(*self._pending))
                self._pending = []
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        with torch.no_grad():
            n = torch.tensor(float(y.numel()), dtype=torch.float64, device=y.device)
            stats = torch.stack([loss.detach().double() * n, torch.zeros_like(n), n])
        return loss, stats

    def train_metrics(self, sums, seconds):
        loss = (sums[0] / sums[2]).item()
        return {"train_loss": loss, "train_perplexity": math.exp(min(loss, 700.0)),
                "samples_per_s": sums[2].item() / self.bptt / seconds,
                "tokens_per_s": sums[2].item() / seconds}

    @torch.no_grad()
    def _nll(self, model, tokens: torch.Tensor, comm: Communicator) -> float:
        from hpclb.data.ptb import stream_layout

        n = self.eval_streams
        length = stream_layout(len(tokens), n)
        mine = list(range(comm.rank, n, comm.world_size))
        device = _device_of(model)
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        if mine:
            x = torch.stack([tokens[j * length:(j + 1) * length] for j in mine]).to(device)
            y = torch.stack([tokens[j * length + 1:(j + 1) * length + 1] for j in mine]).to(device)
            hidden = None
            for s in range(0, length, self.bptt):
                logits, hidden = model(x[:, s:s + self.bptt], hidden)
                t = y[:, s:s + self.bptt]
                sums[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           t.reshape(-1), reduction="sum").double()
                sums[1] += t.numel()
        sums = sums.cpu()
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
        mine = None if self.hidden is None else tuple(h.detach().cpu() for h in self.hidden)
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


# data-section keys hpclb reads itself; the others are a plug-in data function's arguments
PLUGIN_DATA_RESERVED = ("name", "train_samples", "test_samples")


class DatasetSplit:
    """A torch ``Dataset`` of ``(x, y)`` pairs (a plug-in data set) as a classification split.

    ``len()``, ``subset(n)`` (the first ``n`` samples) and ``batch(indices) -> (x, y)``: the
    samples at ``indices`` (int64 ``[b]`` tensor or list) through
    ``torch.utils.data.default_collate`` (so ``x`` is the stacked inputs, ``[b, ...]``), ``y``
    int64 ``[b]``. Uses the dataset's ``__getitems__`` where it has one (one call per batch).
    """

    def __init__(self, dataset, *, where: str = "data.name"):
        self.dataset, self.where = dataset, where

    def __len__(self) -> int:
        return len(self.dataset)

    def subset(self, n: int) -> "DatasetSplit":
        from torch.utils.data import Subset

        return DatasetSplit(Subset(self.dataset, range(min(n, len(self)))), where=self.where)

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
            raise RuntimeError(f"{self.where}: the samples at {idx[:4]}... do not collate into "
                               f"a batch ({e}); every x must have one shape and dtype and every "
                               f"y be an integer class label") from e
        return x, torch.as_tensor(y).to(torch.int64).reshape(-1)


def _check_split(split, which: str, spec: str) -> DatasetSplit:
    """``split`` must be a non-empty sized dataset whose sample 0 is ``(x, y)``, y an integer."""
    from hpclb.errors import ConfigError

    field = f"data.name {spec!r}"
    if not (hasattr(split, "__len__") and hasattr(split, "__getitem__")):
        raise ConfigError(f"{field}: its {which} split is a {type(split).__name__}, not a torch "
                          f"Dataset with __len__ and __getitem__ (e.g. a TensorDataset)")
    if len(split) == 0:
        raise ConfigError(f"{field}: its {which} split is empty")
    sample = split[0]
    ok = isinstance(sample, (tuple, list)) and len(sample) == 2
    y = sample[1] if ok else None
    if ok and isinstance(y, torch.Tensor):
        ok = y.numel() == 1 and not y.is_floating_point() and not y.is_complex()
    elif ok:
        ok = hasattr(y, "__index__") and not isinstance(y, bool)
    if not ok:
        raise ConfigError(f"{field}: sample 0 of its {which} split is {type(sample).__name__} "
                          f"{str(sample)[:80]!r}, not an (x, y) pair with y an integer class "
                          f"label (int or integer tensor)")
    return DatasetSplit(split, where=field)


def load_plugin_data(data: dict, data_root) -> tuple[DatasetSplit, DatasetSplit]:
    """(train, test) of a plug-in data set: ``data["name"]`` is ``package.module:function``,
    called as ``function(str(data_dir(data_root)), **kwargs)`` with the data section's keys
    other than :data:`PLUGIN_DATA_RESERVED`; it must return two torch Datasets of ``(x, y)``.

    Raises ConfigError (naming data.name) when it does not import or returns the wrong thing."""
    from hpclb.data import data_dir
    from hpclb.errors import ConfigError
    from hpclb.plugins import load_object

    spec = data["name"]
    fn = load_object(spec, "data.name")
    kwargs = {k: v for k, v in data.items() if k not in PLUGIN_DATA_RESERVED}
    out = fn(str(data_dir(data_root)), **kwargs)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ConfigError(f"data.name {spec!r} returned {type(out).__name__} {str(out)[:80]!r}; "
                          f"a data function returns a pair (train_dataset, test_dataset)")
    return _check_split(out[0], "train", spec), _check_split(out[1], "test", spec)


def build_task(recipe: dict, data_root, *, train_samples=None, test_samples=None) -> Task:
    """The task of ``recipe`` (``task`` key; default ``classification``) with its data loaded
    from ``data_root``; a plug-in ``data.name`` (``package.module:function``) is read through
    :func:`load_plugin_data`. Raises DataError for missing/corrupt data, ValueError for an
    unknown kind, ConfigError for a plug-in that does not load or returns the wrong thing.
    """
    data = recipe["data"]
    if recipe.get("plugin_path"):
        from hpclb.plugins import add_search_path

        add_search_path(recipe["plugin_path"])
    kind = recipe.get("task", "classification")
    if kind == "classification":
        from hpclb.data import load_dataset
        from hpclb.plugins import is_plugin

        if is_plugin(data["name"]):
            train, test = load_plugin_data(data, data_root)
            return ClassificationTask(train.subset(train_samples) if train_samples else train,
                                      test.subset(test_samples) if test_samples else test)
        train, test = load_dataset(data["name"], data_root, train_samples=train_samples,
                                   test_samples=test_samples, augment=data.get("augment", True))
        return ClassificationTask(train, test, num_workers=data.get("num_workers"))
    if kind == "language_model":
        from hpclb.data.ptb import Corpus, load_ptb

        corpus = load_ptb(data_root)
        if train_samples or test_samples:  # smoke-run subsets, counted in bptt sequences
            bptt = int(data["bptt"])
            cut = lambda t, n: t[:n * bptt + 1] if n else t  # noqa: E731
            corpus = Corpus(cut(corpus.train, train_samples), cut(corpus.valid, test_samples),
                            cut(corpus.test, test_samples), corpus.itos)
        return LanguageModelTask(corpus, bptt=data["bptt"],
                                 eval_streams=data.get("eval_streams", 10))
    if kind == "seq2seq":
        from hpclb.data.translation import load_bible_pairs

        splits = load_bible_pairs(data_root)
        src, tgt = data.get("source", "en"), data.get("target", "es")
        pairs = {k: [(getattr(p, src), getattr(p, tgt)) for p in v] for k, v in splits.items()}
        if train_samples:
            pairs["train"] = pairs["train"][:train_samples]
        if test_samples:
            pairs["test"] = pairs["test"][:test_samples]
        return Seq2seqTask(pairs, vocab_size=data.get("vocab_size", 8000),
                           max_length=data.get("max_length", 80),
                           eval_samples=data.get("eval_samples", len(pairs["test"])),
                           beam_size=data.get("beam_size", 1),
                           length_penalty=data.get("length_penalty", 0.6))
    raise ValueError(f"unknown task kind {kind!r}")


class Seq2seqTask(Task):
    """Translation (GNMT-style model): batches of sentence pairs, padded per batch.

    ``pairs`` maps ``train``/``test`` to lists of (source, target) strings. SentencePiece models
    (one per side, ``vocab_size`` pieces, trained in memory on the training pairs) encode them;
    sequences are cut to ``max_length`` pieces. The batch (in sentence pairs) is drawn by a
    :class:`~hpclb.data.sampler.GlobalBatchSampler` like a classification batch. Loss:
    cross-entropy summed over a sentence's target tokens, averaged over sentences (GNMT's), PAD
    ignored. Metrics: ``train_loss``/``test_loss`` per target token (nats) and ``test_bleu``
    (sacrebleu corpus BLEU of the translations of the first ``eval_samples`` test pairs vs their
    references). Translations: greedy for ``beam_size`` 1, else
    :meth:`hpclb.models.gnmt.GNMT.beam_search` with ``beam_size`` and ``length_penalty`` (GNMT's
    alpha); ``decoding`` names the one used.
    """

    kind = "seq2seq"

    def __init__(self, pairs: dict, *, vocab_size: int, max_length: int, eval_samples: int,
                 beam_size: int = 1, length_penalty: float = 0.6):
        from hpclb.data.translation import train_sentencepiece

        train, test = pairs["train"], pairs["test"]
        self.src_sp = train_sentencepiece([s for s, _ in train], vocab_size)
        self.tgt_sp = train_sentencepiece([t for _, t in train], vocab_size)
        self.max_length = max_length
        enc = lambda sp, xs: [ids[:max_length] for ids in sp.encode(xs)]  # noqa: E731
        self.train_src = enc(self.src_sp, [s for s, _ in train])
        self.train_tgt = enc(self.tgt_sp, [t for _, t in train])
        self.test_pairs = test
        self.test_src = enc(self.src_sp, [s for s, _ in test])
        self.test_tgt = enc(self.tgt_sp, [t for _, t in test])
        self.eval_samples = min(eval_samples, len(test))
        self.beam_size, self.length_penalty = int(beam_size), float(length_penalty)
        self.decoding = "greedy" if self.beam_size == 1 else \
            f"beam {self.beam_size}, length penalty {self.length_penalty:g}"
        self.num_train_samples, self.num_test_samples = len(train), len(test)
        self.model_kwargs = {"src_vocab": self.src_sp.get_piece_size(),
                             "tgt_vocab": self.tgt_sp.get_piece_size()}

    def __len__(self) -> int:  # training pairs
        return self.num_train_samples

    setup = ClassificationTask.setup
    start_epoch = ClassificationTask.start_epoch

    @property
    def train_set(self):
        return self

    @staticmethod
    def _pad(seqs: list[list[int]], prefix: list[int] = (), suffix: list[int] = ()):
        from hpclb.data.translation import PAD

        rows = [list(prefix) + s + list(suffix) for s in seqs]
        width = max(1, max(len(r) for r in rows))
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.int64)

    def _tensors(self, src: list[list[int]], tgt: list[list[int]]):
        from hpclb.data.translation import BOS, EOS, PAD

        s = self._pad(src)
        return s, s != PAD, self._pad(tgt, prefix=[BOS]), self._pad(tgt, suffix=[EOS])

    _part_indices = ClassificationTask._part_indices
    part_size = ClassificationTask.part_size  # the loss is a mean over sentences
    global_size = ClassificationTask.global_size  # sentence pairs in global step i

    def batch(self, i: int, part: int = 0, parts: int = 1):
        """``(src, src_mask, tgt_in, tgt_out, lengths)``: int64/bool tensors and the source
        lengths as host ints (packing needs them on the host: no device read-back per step)."""
        idx = self._part_indices(i, part, parts).tolist()
        src = [self.train_src[j] for j in idx]
        return (*self._tensors(src, [self.train_tgt[j] for j in idx]), [len(x) for x in src])

    def loss(self, model, batch):
        from hpclb.data.translation import PAD

        src, mask, tgt_in, tgt_out, *lengths = batch
        logits = model(src, mask, tgt_in, *lengths)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                                ignore_index=PAD, reduction="sum")
        with torch.no_grad():  # on the device: no host sync per step
            stats = torch.stack([total.detach().double(),
                                 torch.tensor(float(src.shape[0]), dtype=torch.float64,
                                              device=src.device),
                                 (tgt_out != PAD).sum().double()])
        return total / src.shape[0], stats  # stats: loss sum, sentences, target tokens

    def train_metrics(self, sums, seconds):
        loss = (sums[0] / sums[2]).item()
        return {"train_loss": loss, "train_perplexity": math.exp(min(loss, 700.0)),
                "samples_per_s": sums[1].item() / seconds, "tokens_per_s": sums[2].item() / seconds}

    @torch.no_grad()
    def evaluate(self, model, comm, batch_size: int = 64):
        from hpclb.data.translation import EOS, PAD, bleu

        model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        mine = list(range(comm.rank, self.eval_samples, comm.world_size))
        hyps: dict[int, str] = {}
        for start in range(0, len(mine), batch_size):
            idx = mine[start:start + batch_size]
            src, mask, tgt_in, tgt_out = to_device(
                self._tensors([self.test_src[j] for j in idx], [self.test_tgt[j] for j in idx]),
                _device_of(model))
            logits = model(src, mask, tgt_in)
            sums[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                                       ignore_index=PAD, reduction="sum").item()
            sums[1] += int((tgt_out != PAD).sum())
            bos = int(tgt_in[0, 0])
            rows = max(1, batch_size // self.beam_size)  # the decoder runs rows * beam_size
            for r in range(0, len(idx), rows):
                if self.beam_size == 1:
                    out = model.greedy(src[r:r + rows], mask[r:r + rows], bos=bos, eos=EOS,
                                       max_len=self.max_length + 1)
                else:
                    out = model.beam_search(src[r:r + rows], mask[r:r + rows], bos=bos, eos=EOS,
                                            beam_size=self.beam_size,
                                            max_len=self.max_length + 1,
                                            length_penalty=self.length_penalty)
                for j, ids in zip(idx[r:r + rows], out.tolist()):
                    ids = ids[:ids.index(EOS)] if EOS in ids else ids
                    hyps[j] = self.tgt_sp.decode(ids)
        comm.allreduce_(sums)
        every = {}
        for part in (comm.allgather_object(hyps) if comm.world_size > 1 else [hyps]):
            every.update(part)
        order = range(self.eval_samples)
        score = bleu([every[j] for j in order], [self.test_pairs[j][1] for j in order])
        model.train()
        loss = (sums[0] / sums[1]).item()
        return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0)),
                "test_bleu": score}
