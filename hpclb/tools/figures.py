"""matplotlib for the figures of ``hpclb plot`` and ``hpclb sweep``: the Agg backend (no display
needed) and atomic PNG writes."""
from __future__ import annotations

from pathlib import Path

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
    """Write ``fig`` to ``path`` (PNG, through a temporary file beside it) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    pyplot("the figure").close(fig)
    tmp.replace(path)
    return path
