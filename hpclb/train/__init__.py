"""Training a recipe on every rank: set-up and resume (:mod:`.setup`), the loop (:mod:`.loop`),
the one checkpoint schema and the library's Checkpointer (:mod:`.checkpointer`), checkpoint files
(:mod:`.checkpoint`), the preemption flag (:mod:`.preemption`), per-rank random streams
(:mod:`.rng`), per-step metrics (:mod:`.steplog`) and the run's metric files (:mod:`.metrics`)."""

__all__: list[str] = []
