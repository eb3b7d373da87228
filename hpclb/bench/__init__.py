"""Benchmarks behind ``hpclb bench``: ``trust_ratio`` (fused per-layer norms and trust ratios
vs the torch path and a per-layer loop, on real parameter shapes from ``shapes``)."""
