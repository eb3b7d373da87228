"""Word-level language modelling with truncated BPTT (PTB)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpclb.comm.base import Communicator
from hpclb.data.ptb import Corpus
from hpclb.data.registry import check_subset
from hpclb.tasks.base import Task, device_of

__all__ = ["LanguageModelTask"]


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

    @classmethod
    def from_data(cls, corpus, spec, *, train_samples=None, test_samples=None):
        """The task over a :class:`~hpclb.data.ptb.Corpus` with ``spec``'s ``bptt`` and
        ``eval_streams``; ``train_samples``/``test_samples``: smoke-run subsets, counted in
        ``bptt``-token sequences."""
        if train_samples or test_samples:
            bptt = int(spec.options["bptt"])
            for field, n, split, tokens in (
                    ("data.train_samples", train_samples, "training", corpus.train),
                    ("data.test_samples", test_samples, "validation", corpus.valid),
                    ("data.test_samples", test_samples, "test", corpus.test)):
                check_subset(field, n, (len(tokens) - 1) // bptt, f"{spec.name}'s {split} "
                             f"split", f"{bptt}-token sequences")
            cut = lambda t, n: t[:n * bptt + 1] if n else t  # noqa: E731
            corpus = Corpus(cut(corpus.train, train_samples), cut(corpus.valid, test_samples),
                            cut(corpus.test, test_samples), corpus.itos)
        return cls(corpus, bptt=spec.options["bptt"], eval_streams=spec.get("eval_streams", 10))

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
            n = torch.full((), y.numel(), dtype=torch.float64, device=y.device)  # no copy
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
        device = device_of(model)
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
