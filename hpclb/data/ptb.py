"""Penn Treebank, word level (Mikolov et al. 2010 preprocessing, as used by Zaremba et al. 2014).

Files ``ptb.train.txt`` / ``ptb.valid.txt`` / ``ptb.test.txt`` (one sentence per line, words
separated by spaces, rare words already ``<unk>``, numbers ``N``). Tokens are the words of each
line followed by ``<eos>``: the training set has 887,521 words in 42,068 lines = 929,589 tokens,
and a vocabulary of exactly 10,000 (9,999 words + ``<eos>``).

The vocabulary is built from the training set only; ids are ordered by training frequency
(most frequent first, ties in order of first appearance), so ``<eos>`` and ``the`` get small ids.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from hpclb.data.paths import data_dir
from hpclb.errors import DataError

__all__ = ["EOS", "FILES", "VOCAB_SIZE", "Corpus", "build_vocab", "encode", "load_ptb",
           "rank_streams", "stream_layout"]

FILES = {
    "train": ("ptb.train.txt", "f26c4b92c5fdc7b3f8c7cdcb991d8420"),
    "valid": ("ptb.valid.txt", "aa0affc06ff7c36e977d7cd49e3839bf"),
    "test": ("ptb.test.txt", "8b80168b89c18661a38ef683c0dc3721"),
}
EOS = "<eos>"
VOCAB_SIZE = 10_000


@dataclass
class Corpus:
    """Token ids (int64, 1-D) of the three splits and the vocabulary (``itos[id] -> word``)."""

    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    itos: list[str]

    @property
    def vocab_size(self) -> int:
        return len(self.itos)


def _lines(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise DataError(f"{path}: no such file; stage it with `hpclb data fetch ptb` or point "
                        f"--data-dir at a directory holding ptb.train/valid/test.txt")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e}); re-stage it with `hpclb data fetch ptb`") \
            from e
    return [line.split() + [EOS] for line in text.splitlines()]


def build_vocab(lines: list[list[str]]) -> list[str]:
    """Words of ``lines`` by descending frequency (ties: first appearance). Returns ``itos``."""
    counts = Counter(w for line in lines for w in line)
    first: dict[str, int] = {}
    for line in lines:
        for w in line:
            first.setdefault(w, len(first))
    return sorted(counts, key=lambda w: (-counts[w], first[w]))


def encode(lines: list[list[str]], stoi: dict[str, int], path: Path) -> torch.Tensor:
    """The ids of every token of ``lines`` as one int64 tensor. Raises DataError for a word
    outside the vocabulary (PTB's valid/test sets contain none)."""
    try:
        return torch.tensor([stoi[w] for line in lines for w in line], dtype=torch.int64)
    except KeyError as e:
        raise DataError(f"{path}: word {e.args[0]!r} is not in the training vocabulary; is this "
                        f"the standard (Mikolov) PTB?") from e


def load_ptb(root: str | Path | None = None) -> Corpus:
    """Read the three PTB files from ``root`` (default ``$HPCLB_DATA/ptb``; a directory holding
    the files directly also works). Raises DataError for a missing/unreadable file or a
    vocabulary that is not 10,000 words."""
    base = data_dir(root)
    root = base / "ptb" if (base / "ptb").is_dir() else base
    lines = {split: _lines(root / name) for split, (name, _) in FILES.items()}
    itos = build_vocab(lines["train"])
    if len(itos) != VOCAB_SIZE:
        raise DataError(f"{root / FILES['train'][0]}: vocabulary of {len(itos)} words, expected "
                        f"{VOCAB_SIZE}; re-stage it with `hpclb data fetch ptb`")
    stoi = {w: i for i, w in enumerate(itos)}
    ids = {split: encode(lines[split], stoi, root / FILES[split][0]) for split in FILES}
    return Corpus(ids["train"], ids["valid"], ids["test"], itos)


def stream_layout(num_tokens: int, num_streams: int) -> int:
    """Length ``T`` of each of ``num_streams`` contiguous streams cut from ``num_tokens`` tokens:
    stream ``j`` reads inputs ``[j*T, (j+1)*T)`` and predicts the tokens one to the right, so
    ``T = (num_tokens - 1) // num_streams`` (the last few tokens are dropped). Raises ValueError
    when there are not enough tokens for one token per stream."""
    length = (num_tokens - 1) // num_streams
    if length < 1:
        raise ValueError(f"{num_tokens} tokens cannot be cut into {num_streams} streams; use a "
                         f"smaller batch")
    return length


def rank_streams(tokens: torch.Tensor, num_streams: int, rank: int,
                 world_size: int) -> tuple[torch.Tensor, torch.Tensor, range]:
    """This rank's share of ``num_streams`` contiguous streams (the global batch, in sequences).

    Rank ``r`` of ``W`` owns streams ``[r*b, (r+1)*b)`` with ``b = num_streams / W``, so the ranks'
    streams are disjoint and their union is exactly the 1-process batch. Returns
    ``(inputs, targets, streams)``: int64 ``[b, T]`` each (targets shifted by one token) and the
    global stream indices. Raises ValueError when ``num_streams`` is not divisible by ``W``.
    """
    if num_streams % world_size:
        raise ValueError(f"{num_streams} streams do not divide over {world_size} ranks")
    length = stream_layout(len(tokens), num_streams)
    per = num_streams // world_size
    streams = range(rank * per, (rank + 1) * per)
    grid = tokens[:num_streams * length + 1]
    x = torch.stack([grid[j * length:(j + 1) * length] for j in streams]) if per else \
        torch.empty(0, length, dtype=torch.int64)
    y = torch.stack([grid[j * length + 1:(j + 1) * length + 1] for j in streams]) if per else \
        torch.empty(0, length, dtype=torch.int64)
    return x, y, streams
