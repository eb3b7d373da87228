"""Benchmarks: allreduce bandwidth and gradient sync (``allreduce``), step-time scaling
(``scaling``), the alpha-beta scaling model (``model``), trust-ratio kernels (``trust_ratio``)."""
