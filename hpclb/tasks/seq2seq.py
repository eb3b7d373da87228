"""Translation (GNMT-style seq2seq) over sentence pairs (bible-en-es)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpclb.data.registry import check_subset
from hpclb.tasks.base import Task, device_of, to_device
from hpclb.tasks.classification import ClassificationTask

__all__ = ["Seq2seqTask"]


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
        from hpclb.extras import require

        require("sacrebleu", "BLEU (test_bleu)")  # at the first evaluation: checked before
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

    @classmethod
    def from_data(cls, pairs, spec, *, train_samples=None, test_samples=None):
        """The task over ``{"train": [(source, target), ...], "test": [...]}`` (the first
        ``train_samples`` / ``test_samples`` pairs) with ``spec``'s decoding options."""
        pairs = dict(pairs)
        for field, n, split in (("data.train_samples", train_samples, "train"),
                                ("data.test_samples", test_samples, "test")):
            check_subset(field, n, len(pairs[split]), f"{spec.name}'s {split} split",
                         "sentence pairs")
        if train_samples:
            pairs["train"] = pairs["train"][:train_samples]
        if test_samples:
            pairs["test"] = pairs["test"][:test_samples]
        return cls(pairs, vocab_size=spec.get("vocab_size", 8000),
                   max_length=spec.get("max_length", 80),
                   eval_samples=spec.get("eval_samples", len(pairs["test"])),
                   beam_size=spec.get("beam_size", 1),
                   length_penalty=spec.get("length_penalty", 0.6))

    def __len__(self) -> int:  # training pairs
        return self.num_train_samples

    setup = ClassificationTask.setup
    start_epoch = ClassificationTask.start_epoch
    _loader = ClassificationTask._loader  # None: no ``sample`` method, pairs read in the thread

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
                                 torch.full((), src.shape[0], dtype=torch.float64,
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
                device_of(model))
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
