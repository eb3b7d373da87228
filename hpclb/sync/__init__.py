"""Gradient synchronisation across ranks: :mod:`.gradients` (GradientSync), :mod:`.optimizer`
(DistributedOptimizer), :mod:`.buckets` (bucket planning and layout), :mod:`.agree` (start-up
agreement: model check, parameter broadcast, buffer averaging, step counts), :mod:`.drivers`
(how buckets travel), :mod:`.options` (settings). Import from the submodules; this package
imports nothing, so that ``import hpclb.sync.options`` stays light.

(A regular package, not a namespace one, so that ``packages = find:`` puts it in the wheel.)
"""

__all__: list[str] = []
