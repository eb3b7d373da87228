"""hpclb: large-batch distributed training (LEGW, sqrt LR scaling, LARS/LAMB) over MPI.

Implements You et al., *Large-Batch Training for LSTM and Beyond*, SC '19. The library API
(``docs/library.md``): :func:`init`, :class:`DistributedOptimizer`, :func:`broadcast_parameters`,
:func:`broadcast_optimizer_state`, the schedulers :func:`legw`, :func:`linear_scaling`,
:func:`sqrt_scaling`, :func:`no_scaling`, the optimizers :class:`LARS` and :class:`LAMB`, and
:func:`shard_loader`, :func:`share_weight`, :func:`mean_over_ranks`, the collectives
:func:`allreduce`, :func:`allgather`, :func:`broadcast`, :func:`broadcast_object`, :func:`barrier`,
:func:`evaluate` (metrics over a data set split across ranks) and :class:`Checkpointer`
(preemption-safe checkpoints: SIGUSR2/SIGTERM -> agreed checkpoint -> exit 75 -> resume).

Imports are lazy (PEP 562), so ``import hpclb`` and the ``hpclb`` command start without torch:
the command line installs its signal handlers before anything heavy loads.
"""
__version__ = "0.1.0"

_EXPORTS = {
    "init": "api", "communicator": "api", "broadcast_parameters": "api",
    "broadcast_optimizer_state": "api", "legw": "api", "linear_scaling": "api",
    "sqrt_scaling": "api", "no_scaling": "api", "shard_loader": "api", "share_weight": "api",
    "mean_over_ranks": "api", "allreduce": "api", "allgather": "api", "broadcast": "api",
    "broadcast_object": "api", "barrier": "api", "evaluate": "api",
    "Checkpointer": "train.checkpointer", "DistributedOptimizer": "sync.optimizer",
    "NonFiniteError": "sync.optimizer",
    "LARS": "optim", "LAMB": "optim",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpclb' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
