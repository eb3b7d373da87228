"""Layer-wise large-batch optimizers (LARS, LAMB) and their shared trust-ratio computation."""
from .lamb import LAMB
from .lars import LARS
from .trust import lamb_trust_ratios, lars_trust_ratios, layer_norms

__all__ = ["LARS", "LAMB", "lars_trust_ratios", "lamb_trust_ratios", "layer_norms"]
