"""Training a recipe on every rank: set-up and resume (:mod:`.setup`), the loop (:mod:`.loop`),
checkpoints (:mod:`.checkpoint`), per-rank random streams (:mod:`.rng`), per-step metrics
(:mod:`.steplog`) and the run's metric files (:mod:`.metrics`)."""

__all__: list[str] = []
