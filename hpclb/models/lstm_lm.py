"""Word-level LSTM language model of Zaremba, Sutskever & Vinyals, *Recurrent Neural Network
Regularization* (2014), the PTB model of You et al. (SC '19).

Embedding -> dropout -> ``num_layers`` LSTM layers (dropout between them) -> dropout -> linear
decoder to the vocabulary. Every weight is initialised uniformly in ``[-init_scale, init_scale]``
(Zaremba: small 0.1 / medium 0.05 / large 0.04); the embedding is not tied to the decoder.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["LSTMLanguageModel"]


class LSTMLanguageModel(nn.Module):
    """``forward(x, hidden) -> (logits, hidden)``.

    ``x``: int64 token ids ``[batch, time]``; ``hidden``: None (zeros) or ``(h, c)``, each float32
    ``[num_layers, batch, hidden_size]``; ``logits``: float32 ``[batch, time, vocab_size]``.
    """

    def __init__(self, vocab_size: int = 10_000, hidden_size: int = 200, num_layers: int = 2,
                 dropout: float = 0.0, init_scale: float = 0.1):
        super().__init__()
        if not (vocab_size > 0 and hidden_size > 0 and num_layers > 0 and 0 <= dropout < 1):
            raise ValueError(f"bad LSTM LM shape: vocab {vocab_size}, hidden {hidden_size}, "
                             f"layers {num_layers}, dropout {dropout}")
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(hidden_size, hidden_size, num_layers=num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        for p in self.parameters():
            nn.init.uniform_(p, -init_scale, init_scale)

    def forward(self, x: torch.Tensor, hidden=None):
        out, hidden = self.lstm(self.drop(self.embedding(x)), hidden)
        return self.decoder(self.drop(out)), hidden
