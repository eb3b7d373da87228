"""NVRTC through ctypes (no GPU needed): the compile gate, and a check users can run anywhere."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
from typing import Sequence

from hpclb.errors import KernelCompileError
from hpclb.optim.fused.source import NVRTC_OPTIONS

__all__ = ["find_nvrtc", "nvrtc_compile", "nvrtc_version"]


def find_nvrtc() -> str | None:
    """Path of libnvrtc: $HPCLB_NVRTC, the ``nvidia-cuda-nvrtc`` wheel, $CUDA_HOME, the system."""
    env = os.environ.get("HPCLB_NVRTC")
    if env:
        return env
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for pattern in ("cu13/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"):
            hits = sorted(p for p in glob.glob(os.path.join(root, pattern))
                          if "builtins" not in p and ".alt." not in p)
            if hits:
                return hits[0]
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                              "/usr/local/cuda")):
        hits = sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
        hits = [p for p in hits if "builtins" not in p and ".alt." not in p]
        if hits:
            return hits[0]
    return ctypes.util.find_library("nvrtc")


@functools.lru_cache(maxsize=None)
def _nvrtc(path: str) -> ctypes.CDLL:
    # NVRTC dlopens libnvrtc-builtins by soname; load the one beside it first so that a wheel's
    # copy (not on the loader's search path) is found.
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path),
                                                  "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
    lib = ctypes.CDLL(path)
    p, c = ctypes.c_void_p, ctypes.c_char_p
    lib.nvrtcGetErrorString.restype = c
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), c, c, ctypes.c_int, p, p]
    lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(c)]
    lib.nvrtcGetProgramLogSize.argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcGetCUBINSize.argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetCUBIN.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    return lib


def nvrtc_version(path: str | None = None) -> tuple[int, int]:
    """(major, minor) of the libnvrtc at ``path`` (default :func:`find_nvrtc`)."""
    lib = _nvrtc(path or _require_nvrtc())
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _require_nvrtc() -> str:
    path = find_nvrtc()
    if not path:
        raise FileNotFoundError("libnvrtc not found: pip install nvidia-cuda-nvrtc (the `test` "
                                "extra pins it) or set HPCLB_NVRTC")
    return path


def nvrtc_compile(source: str, arch: str = "sm_90", options: Sequence[str] = NVRTC_OPTIONS, *,
                  name: str = "trust_ratio.cu", nvrtc: str | None = None) -> tuple[bytes, str]:
    """Compile ``source`` with NVRTC for ``arch`` (e.g. ``"sm_80"``, ``"sm_90a"``); no GPU needed.

    Returns ``(cubin, log)``. Raises KernelCompileError (with NVRTC's log) when compilation
    fails, FileNotFoundError when no libnvrtc is found.
    """
    lib = _nvrtc(nvrtc or _require_nvrtc())
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc != 0:
        raise KernelCompileError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(rc).decode()}")
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        text = buf.value.decode(errors="replace")
        if rc != 0:
            raise KernelCompileError(f"NVRTC failed to compile {name} for {arch}: "
                                     f"{lib.nvrtcGetErrorString(rc).decode()}", text)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
