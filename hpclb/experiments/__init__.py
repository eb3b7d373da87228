"""Experiment recipes: one YAML per paper experiment, each tuned once at its base batch B0."""

__all__: list[str] = []
