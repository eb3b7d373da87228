"""GNMT-style encoder-decoder LSTM with attention (Wu et al., *Google's Neural Machine
Translation System*, 2016), the translation model of You et al. (SC '19), in plain torch.

Encoder: embedding, a bidirectional LSTM layer (``hidden_size / 2`` per direction), then
``encoder_layers - 1`` unidirectional LSTM layers; residual connections from the third layer on.
Decoder: ``decoder_layers`` LSTM layers; the first one's output queries normalised Bahdanau
(additive) attention over the encoder outputs, and the context vector is fed to every deeper
layer (concatenated to its input); residual connections from the third layer on; a linear
projection of ``[top layer output; context]`` to the target vocabulary.

Decoding: :meth:`GNMT.greedy` and :meth:`GNMT.beam_search` (GNMT's length penalty); the seq2seq
task (``hpclb/tasks/seq2seq.py``) picks one by the recipe's ``data.beam_size``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["GNMT", "NormalizedBahdanauAttention"]


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
        scores = e @ (self.g * self.v / self.v.norm())
        # padding gets the dtype's lowest value (-1e9 does not fit fp16 under autocast)
        scores = scores.masked_fill(~mask[:, None, :], torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1) @ keys


def _check_beam_args(beam_size, max_len, length_penalty) -> None:
    """Raise ValueError for a :meth:`GNMT.beam_search` argument out of range."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an integer >= 1 (1 = greedy), got {beam_size!r}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1, got {max_len!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or \
            not math.isfinite(length_penalty) or length_penalty < 0:
        raise ValueError(f"length_penalty must be a finite number >= 0 (GNMT's alpha), got "
                         f"{length_penalty!r}")


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

    def encode(self, src, src_mask, lengths=None):
        """Encoder outputs ``[b, s, h]`` (zeros at padding). Sequences are packed by their
        lengths (``lengths``: ``b`` ints on the host, as the batch was built; default
        ``src_mask.sum(1)``, read back from the device), so padding never reaches the backward
        direction."""
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        lengths = torch.as_tensor(lengths).clamp(min=1) if lengths is not None else \
            src_mask.sum(1).clamp(min=1).cpu()

        # Sorted on the host (as pack_padded_sequence does with enforce_sorted=False, which
        # then reads its permutation back from the device in pad_packed_sequence).
        lengths, order = torch.sort(lengths, descending=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        both = torch.stack([order, inverse])   # one copy, pinned and non-blocking on CUDA
        if src.device.type == "cuda":
            both = both.pin_memory().to(src.device, non_blocking=True)
        order, inverse = both.to(src.device)

        def run(lstm, x):
            packed = pack_padded_sequence(x.index_select(0, order), lengths, batch_first=True)
            return pad_packed_sequence(lstm(packed)[0], batch_first=True,
                                       total_length=src.shape[1])[0].index_select(0, inverse)

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

    def forward(self, src, src_mask, tgt_in, lengths=None):
        """Logits ``[b, t, tgt_vocab]`` for teacher-forced ``tgt_in`` ``[b, t]`` given ``src``
        ``[b, s]`` (int64), ``src_mask`` ``[b, s]`` (bool) and optional host ``lengths``."""
        return self.decode(self.encode(src, src_mask, lengths), src_mask, tgt_in)

    @torch.no_grad()
    def greedy(self, src, src_mask, bos: int, eos: int, max_len: int = 100) -> torch.Tensor:
        """Greedy decoding (recomputes the decoder over the prefix each step: simple, O(t^2)).
        Returns int64 ``[b, <= max_len]`` token ids without BOS; positions after EOS are EOS."""
        memory = self.encode(src, src_mask)
        out = torch.full((src.shape[0], 1), bos, dtype=torch.int64, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            nxt = self.decode(memory, src_mask, out)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            out = torch.cat([out, nxt[:, None]], 1)
            done |= nxt == eos
            if bool(done.all()):
                break
        return out[:, 1:]

    @torch.no_grad()
    def beam_search(self, src, src_mask, bos: int, eos: int, beam_size: int = 4,
                    max_len: int = 100, length_penalty: float = 0.6) -> torch.Tensor:
        """Beam search with GNMT's length penalty (Wu et al. 2016, section 7, eq. 14).

        ``src`` int64 ``[b, s]`` and ``src_mask`` bool ``[b, s]`` as for :meth:`greedy`.
        Returns int64 ``[b, <= max_len]``, one translation per sentence, without BOS, ending in
        EOS unless ``max_len`` tokens were reached first; shorter rows are padded with EOS (as
        :meth:`greedy` pads). Like :meth:`greedy` it runs the model as it is: call ``eval()``
        first to switch dropout off.

        Algorithm (plain beam search, batched: sentence ``i``'s ``beam_size`` hypotheses are the
        rows ``i * beam_size ... i * beam_size + beam_size - 1`` of one decoder batch; the
        decoder is re-run over each whole prefix, as in :meth:`greedy`):

        1. Each sentence starts with one live hypothesis ``[BOS]`` of log-probability 0.
        2. At each step every live hypothesis is extended by every token, scored by the sum of
           its tokens' log-probabilities; of these candidates a sentence keeps its ``n`` best,
           ``n = beam_size -`` (its finished hypotheses so far).
        3. A kept candidate that ends in EOS, or has ``max_len`` tokens, is finished: it leaves
           the beam (so the beam shrinks by one) and is stored with its score
           ``log P(Y | X) / lp(Y)``, ``lp(Y) = ((5 + |Y|) / 6) ** length_penalty``, where
           ``|Y|`` counts the generated tokens including EOS.
        4. A sentence is done when ``beam_size`` hypotheses have finished; decoding stops when
           every sentence is done (at most ``max_len`` steps). The answer is each sentence's
           finished hypothesis of highest penalised score (the earliest one on a tie).

        Within a step all candidates have the same length, so the penalty only matters when
        finished hypotheses of different lengths are compared. ``beam_size=1`` is greedy
        decoding. GNMT's coverage penalty and score-based beam pruning are not implemented
        (coverage weight beta = 0). ``length_penalty`` is GNMT's alpha: 0 ranks by raw
        log-probability (which favours short output); larger values favour longer output.

        Raises ValueError when ``beam_size`` or ``max_len`` is not an integer >= 1, or
        ``length_penalty`` is not a finite number >= 0.
        """
        _check_beam_args(beam_size, max_len, length_penalty)
        b, k, dev = src.shape[0], beam_size, src.device
        memory = self.encode(src, src_mask).repeat_interleave(k, 0)  # [b * k, s, h]
        mask = src_mask.repeat_interleave(k, 0)
        prefixes = torch.full((b * k, 1), bos, dtype=torch.int64, device=dev)  # [b * k, t]
        scores = [[0.0] for _ in range(b)]  # per sentence, the live hypotheses' log-probs
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
        for t in range(1, max_len + 1):
            logp = torch.log_softmax(self.decode(memory, mask, prefixes)[:, -1].float(), -1)
            vocab = logp.shape[-1]
            live_scores = torch.tensor([s + [-math.inf] * (k - len(s)) for s in scores],
                                       device=dev)  # [b, k]; -inf = no hypothesis in that row
            candidates = (live_scores.unsqueeze(-1) + logp.view(b, k, vocab)).view(b, k * vocab)
            top_scores, top_index = candidates.topk(k, dim=1)  # best first
            top_scores, top_index = top_scores.tolist(), top_index.tolist()
            rows, tokens = [], []  # the next step's prefixes: which row, extended by which token
            for i in range(b):
                n = k - len(finished[i])
                scores[i] = []
                for score, index in zip(top_scores[i][:n], top_index[i][:n]):
                    if score == -math.inf:  # fewer real candidates than places (tiny vocab)
                        break
                    row, token = i * k + index // vocab, index % vocab
                    if token == eos or t == max_len:
                        lp = ((5 + t) / 6) ** length_penalty
                        finished[i].append((score / lp, prefixes[row, 1:].tolist() + [token]))
                    else:
                        scores[i].append(score)
                        rows.append(row)
                        tokens.append(token)
                while len(rows) < (i + 1) * k:  # unused places: any row, never read
                    rows.append(i * k)
                    tokens.append(eos)
            if not any(scores):
                break
            prefixes = torch.cat([prefixes[torch.tensor(rows, device=dev)],
                                  torch.tensor(tokens, device=dev)[:, None]], 1)
        best = [max(f, key=lambda h: h[0])[1] for f in finished]  # max keeps the first on a tie
        out = torch.full((b, max(len(y) for y in best)), eos, dtype=torch.int64, device=dev)
        for i, y in enumerate(best):
            out[i, :len(y)] = torch.tensor(y)
        return out
