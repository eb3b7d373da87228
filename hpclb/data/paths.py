"""Where data sets are read from: the data directory."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_dir"]


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The data directory: ``explicit``, else ``$HPCLB_DATA``, else ``./data``."""
    return Path(explicit or os.environ.get("HPCLB_DATA") or "data")
