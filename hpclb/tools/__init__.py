"""Tools on top of training: ``hpclb evaluate`` (:mod:`.evaluate`), ``sweep`` (:mod:`.sweep`,
:mod:`.sweep_report`), ``jobs`` (:mod:`.jobs`, :mod:`.jobs_spec`, :mod:`.jobs_testing`),
``plot`` (:mod:`.plot`, :mod:`.figures`), ``scale`` (:mod:`.scale`) and ``advise``
(:mod:`.advise`). Nothing is imported here: importing one tool loads only what it needs."""

__all__: list[str] = []
