"""Where the CUDA C source of the fused kernels is, what it is compiled with, and which kernels
it holds (``kernels/trust_ratio.cu``; the wheel ships a copy as ``hpclb/_kernels/``)."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CUPY_APPENDED_OPTIONS", "KERNELS", "KERNELS_DIR", "KERNEL_PATH", "NVRTC_OPTIONS",
           "PACKAGE_KERNELS_DIR", "REPO_KERNELS_DIR", "kernel_source"]

#: Where the .cu source is looked for, in order: $HPCLB_KERNELS_DIR, the installed package's copy
#: (``hpclb/_kernels/``, put there by setup.py when a wheel is built), the repository's
#: ``kernels/``. parents[2] of hpclb/optim/fused/source.py is hpclb/, parents[3] the repository.
PACKAGE_KERNELS_DIR = Path(__file__).resolve().parents[2] / "_kernels"
REPO_KERNELS_DIR = Path(__file__).resolve().parents[3] / "kernels"
KERNELS_DIR = Path(os.environ.get("HPCLB_KERNELS_DIR")
                   or next((d for d in (PACKAGE_KERNELS_DIR, REPO_KERNELS_DIR)
                            if (d / "trust_ratio.cu").is_file()), REPO_KERNELS_DIR))
KERNEL_PATH = KERNELS_DIR / "trust_ratio.cu"
#: What CuPy appends to every NVRTC compile (``cupy.cuda.compiler``: ``-ftz=true``, denormal
#: fp32 results flushed to zero); NVRTC honours the last occurrence of an option.
CUPY_APPENDED_OPTIONS: tuple[str, ...] = ("-ftz=true",)
#: NVRTC options hpclb hands CuPy (CuPy adds the architecture), stating what CuPy appends, so that
#: the compile gate (:func:`hpclb.optim.fused.nvrtc.nvrtc_compile`'s default) compiles the
#: binary that runs.
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17", *CUPY_APPENDED_OPTIONS)
#: kernel name -> the most threads per block its __launch_bounds__ allows
KERNELS: dict[str, int] = {"hl_norms_pass1": 1024, "hl_lars_apply": 1024,
                           "hl_lamb_pass1": 512, "hl_lamb_apply": 512}


def kernel_source() -> str:
    """The exact text handed to NVRTC (``kernels/trust_ratio.cu``, unchanged), read from
    :data:`KERNEL_PATH`: ``$HPCLB_KERNELS_DIR``, else the wheel's ``hpclb/_kernels/``, else the
    repository's ``kernels/`` (editable install).

    Raises FileNotFoundError when none holds it (reinstall hpclb from a wheel or its repository,
    or point ``HPCLB_KERNELS_DIR`` at a ``kernels/`` directory)."""
    try:
        return KERNEL_PATH.read_text()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{KERNEL_PATH} not found: reinstall hpclb (a wheel ships "
                                "hpclb/_kernels/trust_ratio.cu; pip install -e . reads kernels/) "
                                "or set HPCLB_KERNELS_DIR to a directory holding it") from e

