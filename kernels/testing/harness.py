"""Build and drive the CPU emulation of kernels/trust_ratio.cu (the logic gate).

``build_emulator()`` compiles kernels/testing/emulator.cpp (cuda_on_cpu.h + the unchanged .cu,
or a mutated copy) with g++ -std=c++20 into a shared library in a build directory;
``Emulator`` loads it with ctypes and launches kernels like ``cuLaunchKernel``; and
``EmulatorLauncher`` plugs it into :class:`hpclb.optim.fused.FusedTrust` in place of CuPy, so
the same
host code (pointer tables, chunk maps, hyper-parameter rows) runs the kernels on CPU tensors.

Needs g++ >= 10 (C++20 ``<source_location>``); :func:`compiler` returns None when there is none.
Only numpy and ctypes are imported here, so the module also runs under AddressSanitizer.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parent
SOURCE = KERNELS / "trust_ratio.cu"
FLAGS = ["-std=c++20", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing",
         "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Wno-clobbered", "-Werror"]
ASAN_FLAGS = ["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"]
POLICIES = {"lowest-first": 0, "highest-first": 1, "random": 2}


class EmulatorError(RuntimeError):
    """A kernel run on the emulator failed: deadlock, divergent barrier, bad warp mask."""


def compiler() -> str | None:
    """The g++ to build with ($CXX, else g++), or None when there is none."""
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


def asan_runtime() -> str | None:
    """Path of libasan.so for LD_PRELOAD into Python, or None."""
    cxx = compiler()
    if cxx is None:
        return None
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if path and os.path.isabs(path) and os.path.exists(path) else None


def build_emulator(build_dir: str | os.PathLike, *, source_text: str | None = None,
                   sanitize: bool = False, tag: str = "") -> Path:
    """Compile the emulator library into ``build_dir``; return its path.

    ``source_text`` replaces the kernel source (a mutant); ``sanitize`` builds with ASan.
    Raises RuntimeError with the compiler's output when the build fails.
    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = FLAGS + (ASAN_FLAGS if sanitize else ["-O2"])
    text = source_text if source_text is not None else SOURCE.read_text()
    key = hashlib.sha256("\0".join([text, (HERE / "cuda_on_cpu.h").read_text(),
                                    (HERE / "emulator.cpp").read_text(), *flags]).encode())
    stem = f"hlcpu{('-' + tag) if tag else ''}-{key.hexdigest()[:12]}"
    lib = build_dir / f"{stem}.so"
    if lib.exists():
        return lib
    cmd = [cxx, *flags, f"-I{HERE}"]
    if source_text is not None:
        mutant = build_dir / f"{stem}.cu"
        mutant.write_text(source_text)
        cmd.append(f'-DHLCPU_SOURCE="{mutant}"')
    tmp = build_dir / f"{stem}.tmp.so"
    cmd += ["-o", str(tmp), str(HERE / "emulator.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulator build failed ({' '.join(cmd)}):\n{proc.stderr[-6000:]}")
    tmp.replace(lib)
    return lib


class Emulator:
    """ctypes front of one emulator library."""

    def __init__(self, lib_path: str | os.PathLike):
        self.path = str(lib_path)
        self.lib = ctypes.CDLL(self.path)
        self.lib.hlcpu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint,
                                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                          ctypes.c_ulonglong]
        self.lib.hlcpu_launch.restype = ctypes.c_int
        self.lib.hlcpu_last_error.restype = ctypes.c_char_p
        for name in ("hlcpu_f16_to_f32", "hlcpu_f16_from_f32", "hlcpu_bf16_to_f32",
                     "hlcpu_bf16_from_f32"):
            getattr(self.lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_longlong]

    def launch(self, name: str, grid: int, block: int, args: Sequence, *, policy: int = 0,
               seed: int = 1) -> None:
        """Run kernel ``name`` on ``grid`` x ``block`` threads. ``args``: numpy scalars
        (np.uint64 for pointers, np.int32, np.float32), in the kernel's parameter order.
        Raises EmulatorError with the emulator's report when the kernel misbehaves."""
        holders = [np.array(a) for a in args]           # 0-d arrays own the argument bytes
        ptrs = (ctypes.c_void_p * max(1, len(holders)))(*[h.ctypes.data for h in holders])
        rc = self.lib.hlcpu_launch(name.encode(), int(grid), int(block), ptrs, int(policy),
                                   int(seed))
        if rc != 0:
            raise EmulatorError(self.lib.hlcpu_last_error().decode())

    def convert(self, name: str, src: np.ndarray, out_dtype) -> np.ndarray:
        """Apply one of the kernel's 16-bit conversions to every element of ``src``."""
        src = np.ascontiguousarray(src)
        out = np.empty(src.shape, dtype=out_dtype)
        getattr(self.lib, name)(src.ctypes.data, out.ctypes.data, src.size)
        return out


class EmulatorLauncher:
    """The launcher interface of hpclb.optim.fused (what CupyLauncher is on a GPU), on the CPU.

    ``max_grid`` caps the grid (None: one block per chunk); ``policy``/``seed`` choose the
    fiber and block order. Records launches in ``launches`` (name, grid, block).
    ``stream`` stands in for torch's current CUDA stream (set it to emulate another stream;
    :meth:`stream_key` is what the host code keys its caches by).
    """

    name = "emulator"

    def __init__(self, emulator: Emulator, *, max_grid: int | None = None,
                 policy: int = 0, seed: int = 1):
        import torch  # only the launcher needs torch; the Emulator itself does not

        self.emulator = emulator
        self.device = torch.device("cpu")
        self.max_grid = max_grid
        self.policy = policy
        self.seed = seed
        self.launches: list[tuple[str, int, int]] = []
        self.stream = 0

    def stream_key(self) -> int:
        return self.stream

    def grid_for(self, n_chunks: int, block: int, kernel: str | None = None) -> int:
        return max(1, n_chunks if self.max_grid is None else min(n_chunks, self.max_grid))

    def launch(self, name: str, grid: int, block: int, args: Sequence) -> None:
        self.launches.append((name, grid, block))
        self.emulator.launch(name, grid, block, args, policy=self.policy, seed=self.seed)
