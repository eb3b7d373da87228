"""GNMT-style encoder-decoder LSTM with attention (Wu et al., *Google's Neural Machine
Translation System*, 2016), the translation model of You et al. (SC '19), in plain torch.

Encoder: embedding, a bidirectional LSTM layer (``hidden_size / 2`` per direction), then
``encoder_layers - 1`` unidirectional LSTM layers; residual connections from the third layer on.
Decoder: ``decoder_layers`` LSTM layers; the first one's output queries normalised Bahdanau
(additive) attention over the encoder outputs, and the context vector is fed to every deeper
layer (concatenated to its input); residual connections from the third layer on; a linear
projection of ``[top layer output; context]`` to the target vocabulary.

Status: the model and greedy decoding are here and shape-tested; the seq2seq data pipeline and
training task (``gnmt.yaml``) are not implemented yet.
"""
from __future__ import annotations

import torch
from torch import nn


class NormalizedBahdanauAttention(nn.Module):
    """score(q, k) = g * v/||v|| . tanh(W_q q + W_k k + b) (Wu et al. / Salimans & Kingma norm)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=True)
        self.v = nn.Parameter(torch.empty(hidden).uniform_(-0.1, 0.1))
        self.g = nn.Parameter(torch.tensor(hidden ** -0.5))

    def forward(self, query, keys, mask):
        """query ``[b, t, h]``, keys ``[b, s, h]``, mask bool ``[b, s]`` (True = real token) ->
        context ``[b, t, h]``."""
        e = torch.tanh(self.q(query).unsqueeze(2) + self.k(keys).unsqueeze(1))  # [b, t, s, h]
        scores = (e @ (self.g * self.v / self.v.norm())).masked_fill(~mask[:, None, :], -1e9)
        return torch.softmax(scores, dim=-1) @ keys


class GNMT(nn.Module):
    """``forward(src, src_mask, tgt_in) -> logits``: ``src`` int64 ``[b, s]``, ``src_mask`` bool
    ``[b, s]``, ``tgt_in`` int64 ``[b, t]`` (target shifted right, starting with BOS) ->
    float32 ``[b, t, tgt_vocab]``. Raises ValueError for odd ``hidden_size`` or < 1 layer."""

    def __init__(self, src_vocab: int = 8000, tgt_vocab: int = 8000, hidden_size: int = 1024,
                 encoder_layers: int = 4, decoder_layers: int = 4, dropout: float = 0.2):
        super().__init__()
        if hidden_size % 2 or encoder_layers < 1 or decoder_layers < 1:
            raise ValueError(f"GNMT needs an even hidden_size and >= 1 layer per side, got "
                             f"{hidden_size}, {encoder_layers}, {decoder_layers}")
        h = hidden_size
        self.src_embed, self.tgt_embed = nn.Embedding(src_vocab, h), nn.Embedding(tgt_vocab, h)
        self.enc_bi = nn.LSTM(h, h // 2, batch_first=True, bidirectional=True)
        self.enc = nn.ModuleList(nn.LSTM(h, h, batch_first=True)
                                 for _ in range(encoder_layers - 1))
        self.dec_first = nn.LSTM(h, h, batch_first=True)
        self.dec = nn.ModuleList(nn.LSTM(2 * h, h, batch_first=True)
                                 for _ in range(decoder_layers - 1))
        self.attention = NormalizedBahdanauAttention(h)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(2 * h, tgt_vocab)

    def encode(self, src, src_mask):
        """Encoder outputs ``[b, s, h]`` (zeros at padding). Sequences are packed by their
        lengths (``src_mask.sum(1)``), so padding never reaches the backward direction."""
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        lengths = src_mask.sum(1).clamp(min=1).cpu()

        def run(lstm, x):
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return pad_packed_sequence(lstm(packed)[0], batch_first=True,
                                       total_length=src.shape[1])[0]

        x = run(self.enc_bi, self.drop(self.src_embed(src)))
        for i, lstm in enumerate(self.enc):
            y = run(lstm, self.drop(x))
            x = x + y if i >= 1 else y  # residual from the third encoder layer on
        return x * src_mask.unsqueeze(-1)

    def decode(self, memory, src_mask, tgt_in):
        x, _ = self.dec_first(self.drop(self.tgt_embed(tgt_in)))
        context = self.attention(x, memory, src_mask)
        for i, lstm in enumerate(self.dec):
            y, _ = lstm(self.drop(torch.cat([x, context], -1)))
            x = x + y if i >= 1 else y  # residual from the third decoder layer on
        return self.out(self.drop(torch.cat([x, context], -1)))

    def forward(self, src, src_mask, tgt_in):
        return self.decode(self.encode(src, src_mask), src_mask, tgt_in)

    @torch.no_grad()
    def greedy(self, src, src_mask, bos: int, eos: int, max_len: int = 100) -> torch.Tensor:
        """Greedy decoding (recomputes the decoder over the prefix each step: simple, O(t^2)).
        Returns int64 ``[b, <= max_len]`` token ids without BOS; positions after EOS are EOS."""
        memory = self.encode(src, src_mask)
        out = torch.full((src.shape[0], 1), bos, dtype=torch.int64)
        done = torch.zeros(src.shape[0], dtype=torch.bool)
        for _ in range(max_len):
            nxt = self.decode(memory, src_mask, out)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            out = torch.cat([out, nxt[:, None]], 1)
            done |= nxt == eos
            if bool(done.all()):
                break
        return out[:, 1:]
