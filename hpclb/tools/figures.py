"""matplotlib for the figures of ``hpclb plot`` and ``hpclb sweep``: the Agg backend (no display
needed) and atomic PNG writes."""
from __future__ import annotations

from pathlib import Path

from hpclb._io import write_atomic
from hpclb.extras import require

__all__ = ["pyplot", "save"]


def pyplot(what: str):
    """matplotlib.pyplot on the Agg backend; MissingExtraError (pip install
    'hpclb[experiments]') naming ``what`` without matplotlib."""
    matplotlib = require("matplotlib", what)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG, atomically: :func:`~hpclb._io.write_atomic`, DiskFull on a
    full disk) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        pyplot("the figure").close(fig)
    return path
