"""Gradient synchronisation across ranks: the :class:`~.optimizer.DistributedOptimizer` step,
:class:`~.gradients.GradientSync` (buckets, overlap drivers, options) and the start-up checks
that make ranks agree."""
