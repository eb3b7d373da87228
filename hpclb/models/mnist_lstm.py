"""MNIST-LSTM: each 28x28 image is read as 28 time steps of 28 pixels (row by row)."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["MnistLSTM"]


class MnistLSTM(nn.Module):
    """One LSTM layer (``hidden_size`` units, default 128) and a linear head to 10 classes.

    Input: float32 ``[batch, 28, 28]`` (time steps x pixels). Output: logits ``[batch, 10]``
    from the last time step's hidden state.

    ``forget_bias`` (default 1.0, as TensorFlow's ``BasicLSTMCell`` that the paper's MNIST-LSTM
    used) is added to every layer's forget-gate input bias at construction (torch's gate order
    is input, forget, cell, output). TF adds it as a constant in the cell; a trained bias that
    starts 1.0 higher gives the same forward pass and the same gradients (no weight decay acts
    on biases in hpclb's recipes). 0 gives torch's plain initialisation.
    """

    def __init__(self, input_size: int = 28, hidden_size: int = 128, num_classes: int = 10,
                 num_layers: int = 1, forget_bias: float = 1.0):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers=num_layers, batch_first=True)
        with torch.no_grad():
            for layer in range(num_layers):
                getattr(self.lstm, f"bias_ih_l{layer}")[hidden_size:2 * hidden_size] += \
                    forget_bias
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])
