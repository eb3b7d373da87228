"""Optional dependencies: import one, or say which ``pip install 'hpclb[<extra>]'`` brings it.

The library itself needs only torch, numpy, mpi4py, PyYAML and tqdm. The recipes' data sets,
BLEU, plots and job templates use packages of the ``experiments`` extra (setup.cfg), the ImageNet
loader's JPEG decoder the ``jpeg`` extra; they are imported lazily, through :func:`require`,
where they are used.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from hpclb.errors import MissingExtraError

__all__ = ["OPTIONAL", "gpu_extra", "installed_version", "require"]

#: top-level module -> (distribution name, extra that installs it)
OPTIONAL: dict[str, tuple[str, str]] = {
    "jinja2": ("jinja2", "experiments"),
    "matplotlib": ("matplotlib", "experiments"),
    "PIL": ("pillow", "experiments"),
    "pysword": ("pysword", "experiments"),
    "sacrebleu": ("sacrebleu", "experiments"),
    "sentencepiece": ("sentencepiece", "experiments"),
    "simplejpeg": ("simplejpeg", "jpeg"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "cupy": ("cupy", "gpu-cuda12 or gpu-cuda13"),  # the named one: gpu_extra()
    "horovod": ("horovod", "horovod"),
}


def gpu_extra() -> str:
    """The pip argument that brings CuPy for this torch: ``'hpclb[gpu-cuda12]'`` or
    ``'hpclb[gpu-cuda13]'`` by ``torch.version.cuda``'s major version; both, as a choice, for a
    CPU-only torch (or one of another CUDA major). Never raises."""
    try:
        import torch
        major = (torch.version.cuda or "").split(".")[0]
    except ImportError:
        major = ""
    if major in ("12", "13"):
        return f"'hpclb[gpu-cuda{major}]'"
    return "'hpclb[gpu-cuda12]' or 'hpclb[gpu-cuda13]' (the CUDA major of your GPU torch)"


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``; a missing top-level package raises
    :class:`MissingExtraError` naming ``purpose`` (what needed it, e.g. ``"BLEU scores"``) and
    the fix, ``pip install 'hpclb[<extra>]'``. ``module`` may be dotted
    (``"pysword.modules"``); its top-level name must be a key of :data:`OPTIONAL`."""
    top = module.partition(".")[0]
    if top not in OPTIONAL:
        raise KeyError(f"{top!r} is not an optional dependency of hpclb; add it to "
                       "hpclb.extras.OPTIONAL and to an extra in setup.cfg")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != top:
            raise  # the package is there but one of its own dependencies is not
        dist, extra = OPTIONAL[top]
        what = gpu_extra() if top == "cupy" else f"'hpclb[{extra}]'"
        raise MissingExtraError(f"{purpose} needs {dist}, which is not installed: "
                                f"pip install {what}", name=top) from e
