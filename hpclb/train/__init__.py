"""Training a recipe on every rank: set-up and resume (:mod:`.setup`), the loop and its per-step
metrics (:mod:`.loop`), the console lines, config.json and summary.json (:mod:`.report`), the one
checkpoint schema and the library's Checkpointer (:mod:`.checkpointer`), checkpoint files
(:mod:`.checkpoint`), the preemption flag (:mod:`.preemption`), per-rank random streams
(:mod:`.rng`) and the run's metric files (:mod:`.metrics`)."""

__all__: list[str] = []
