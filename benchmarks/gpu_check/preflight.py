"""Preflight of benchmarks/gpu_check.sh: every package and tool the phases use, and the data.

    python benchmarks/gpu_check/preflight.py OUT_JSON --data DIR --mpirun PATH [--cpu-dry-run]

Writes ``{"found": {...}, "missing": [...], "mpi_runtime": bool, "gpu": bool}`` to OUT_JSON
(``found["mpi_flavor"]``: ``openmpi``, whose mpirun passes variables with ``-x``, or ``other``:
MPICH's Hydra passes the whole environment) and
prints one line per check. Exit 1 when something a phase needs is missing (on a CPU dry run the
GPU-only needs, a CUDA device and CuPy, are reported but not required); a missing ``mpirun``
is not a failure: the MPI phases then say "skipped: no MPI runtime".
"""
import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

MNIST = {"train-images-idx3-ubyte": 47040016, "train-labels-idx1-ubyte": 60008,
         "t10k-images-idx3-ubyte": 7840016, "t10k-labels-idx1-ubyte": 10008}
PACKAGES = ["torch", "numpy", "yaml", "tqdm", "pytest", "mpi4py", "cupy"]
GPU_ONLY = {"cupy"}


def _packages(found: dict, missing: list, dry: bool) -> None:
    for name in PACKAGES:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # ImportError, or CuPy without a CUDA runtime
            if not (dry and name in GPU_ONLY):
                missing.append(f"python package {name} ({type(e).__name__}: {e})")
            found[name] = None


def _cuda(found: dict, missing: list, dry: bool) -> bool:
    import torch

    found["torch_cuda"] = torch.version.cuda
    if not torch.cuda.is_available():
        if not dry:
            missing.append(f"a CUDA device (torch {torch.__version__}, CUDA "
                           f"{torch.version.cuda}: torch.cuda.is_available() is False)")
        return False
    p = torch.cuda.get_device_properties(0)
    found["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
    found["cudnn"] = torch.backends.cudnn.version()
    if found.get("cupy"):
        import cupy

        found["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
    return True


def _mpirun(found: dict, mpirun: str) -> bool:
    path = mpirun if os.access(mpirun, os.X_OK) else shutil.which(mpirun)
    if not path:
        found["mpirun"] = None
        return False
    try:
        v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        first = (v.stdout or v.stderr or "?").splitlines()[0]
        found["mpirun"] = f"{path}: {first}"
        found["mpi_flavor"] = "openmpi" if "Open MPI" in first or "OpenRTE" in first else "other"
    except Exception as e:  # a broken launcher is no runtime
        found["mpirun"] = f"{path}: does not run ({e})"
        return False
    return v.returncode == 0


def _mnist(found: dict, missing: list, data: Path) -> None:
    root = data / "mnist"
    sizes = {n: (root / n).stat().st_size if (root / n).is_file() else None for n in MNIST}
    bad = [f"{n} ({'absent' if sizes[n] is None else f'size {sizes[n]}'})"
           for n, size in MNIST.items() if sizes[n] != size]
    found["mnist"] = str(root) if not bad else None
    if bad:
        missing.append(f"MNIST in {root}: {', '.join(bad)}; run benchmarks/gpu_check/prepare.py "
                       "(device_run.json's prepare) before the tree travels (the GPU machine "
                       "has no network), or set HPCLB_DATA")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--data", required=True)
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--cpu-dry-run", action="store_true")
    a = ap.parse_args()
    found, missing = {"python": platform.python_version()}, []
    _packages(found, missing, a.cpu_dry_run)
    gpu = found["torch"] is not None and _cuda(found, missing, a.cpu_dry_run)
    mpi = found["mpi4py"] is not None and _mpirun(found, a.mpirun)
    _mnist(found, missing, Path(a.data))
    res = {"found": found, "missing": missing, "mpi_runtime": mpi, "gpu": gpu}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for k, v in found.items():
        print(f"  {k:<12} {v if v is not None else 'MISSING'}")
    for m in missing:
        print(f"  MISSING: {m}")
    if not mpi:
        print("  no MPI runtime: the MPI phases will be skipped")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
