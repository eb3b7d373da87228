"""A plug-in model for the SLURM time-limit test (``test_slurm.py``): the packaged MNIST-LSTM,
each training forward taking at least ``pace_s`` seconds more.

SLURM sends ``--signal=B:USR2@lead`` at its first time-limit check (every 30 s) once less than
``lead`` + 30 s is left; a run must still be training then on a fast, idle machine as on a
loaded one. A sleep gives the run a floor on its length that does not depend on the CPU; it
changes no number (``pace_s = 0``, the reference run, gives the same parameters bit for bit).
"""
from __future__ import annotations

import time

from torch import Tensor

from hpclb.models.mnist_lstm import MnistLSTM


class PacedMnistLSTM(MnistLSTM):
    """:class:`~hpclb.models.mnist_lstm.MnistLSTM` (same arguments, same parameters and outputs)
    whose forward in training mode sleeps ``pace_s`` seconds first."""

    def __init__(self, pace_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.pace_s = float(pace_s)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.pace_s > 0:
            time.sleep(self.pace_s)
        return super().forward(x)
