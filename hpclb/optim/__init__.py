"""Layer-wise large-batch optimizers (LARS, LAMB) and their shared trust-ratio computation."""
from hpclb.optim.lamb import LAMB
from hpclb.optim.lars import LARS
from hpclb.optim.trust import lamb_trust_ratios, lars_trust_ratios, layer_norms

__all__ = ["LARS", "LAMB", "lars_trust_ratios", "lamb_trust_ratios", "layer_norms"]
