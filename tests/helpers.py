"""Small real runs for the tests: the packaged MNIST-LSTM recipe with a short budget."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpclb.comm.launcher import stop_session
from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.train import loop as train_mod


def quick_recipe(tmp_path: Path, **changes) -> str:
    """Write the packaged mnist-lstm recipe with ``changes``; by default on the first 4,096
    train / 2,000 test images (B0 128: 32 steps per epoch, 8 warmup steps)."""
    recipe = load_recipe("mnist-lstm")
    recipe.update({"warmup_epochs": 0.25, "epochs": 1,
                   "data": {"name": "mnist", "train_samples": 4096, "test_samples": 2000}})
    recipe.update(changes)
    path = Path(tmp_path) / "quick.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def train_multi_and_single(comm, recipe: str, out: str, single: dict | None = None,
                           **kw) -> tuple[dict, dict]:
    """Train ``recipe`` on every rank of ``comm`` (into ``out/multi``) and on rank 0 alone
    (``out/single``, with ``single``'s settings on top of ``kw``); returns both summaries, on
    every rank. Collective."""
    multi = train_mod.train(resolve(recipe, out=f"{out}/multi", **kw), comm, quiet=True)
    one = None
    if comm.rank == 0:
        one = train_mod.train(resolve(recipe, out=f"{out}/single", **{**kw, **(single or {})}),
                              SelfCommunicator(), quiet=True)
    return multi, comm.broadcast_object(one)


def preempt_at(monkeypatch, step: int) -> None:
    """Make the training loop see an agreed preemption request after its ``step``-th step (the
    check runs once per optimizer step), as if SIGUSR2 had arrived then."""
    calls = {"n": 0}

    def agreed(self, comm):
        calls["n"] += 1
        return calls["n"] == step

    monkeypatch.setattr(train_mod.PreemptionFlag, "agreed", agreed)


def run_bounded(cmd: list[str], *, timeout: float, capture_output: bool = False,
                **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a launcher (``mpirun``, ``hpclb``): past ``timeout`` seconds it
    ends the launcher's whole session, ranks included (each ``mpirun`` rank has a process group
    of its own, and ``subprocess.run`` kills the launcher alone, leaving the ranks running and
    the launcher's session directory behind), then raises ``subprocess.TimeoutExpired``."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_session(proc, grace_s=5)
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


MPIRUN = Path(sys.executable).parent / "mpirun"
#: The environment a test launches ``hpclb`` or ``mpirun`` with: this machine's Open MPI
#: settings (root allowed, oversubscription), one torch thread per process, and no identity
#: inherited from a surrounding ``mpirun`` (``make test-mpi`` runs pytest itself under one).
LAUNCH_ENV = {k: v for k, v in os.environ.items()
              if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))}
LAUNCH_ENV.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                  PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", OMP_NUM_THREADS="1")


def run_hpclb(*args, ranks: int = 1, timeout: float, env: dict | None = None,
              cwd: str | Path | None = None,
              mpirun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python -m hpclb ARGS`` at one process, or under ``mpirun -n RANKS --bind-to none
    MPIRUN_ARGS`` (the test is skipped when no ``mpirun`` lies beside the interpreter), with
    ``env`` (default :data:`LAUNCH_ENV`), output captured as text, bounded by ``timeout``
    seconds through :func:`run_bounded`."""
    cmd = [sys.executable, "-m", "hpclb", *map(str, args)]
    if ranks > 1:
        if not MPIRUN.exists():
            pytest.skip("no mpirun beside the interpreter (make install provides one)")
        cmd = [str(MPIRUN), "-n", str(ranks), "--bind-to", "none", *mpirun_args, *cmd]
    return run_bounded(cmd, capture_output=True, text=True, timeout=timeout,
                       env=LAUNCH_ENV if env is None else env, cwd=cwd,
                       stdin=subprocess.DEVNULL)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every descendant of process ``pid``, children before grandchildren (from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def noise_image_folder(root: Path, sizes, classes=("a", "b")) -> Path:
    """``root/<class>/<i:03d>.png``: random-noise RGB PNGs of ``sizes`` ((width, height) each) in
    every class, the same pixels on every call (numpy seed 0); returns ``root``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i, (w, h) in enumerate(sizes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                root / c / f"{i:03d}.png")
    return root


def noisy_jpeg(width: int, height: int, seed: int = 0, mode: str = "RGB", **save) -> bytes:
    """A JPEG (quality 90) of a gradient plus noise, like the loader benchmark's images (a crop
    shifted by a pixel or two reads clearly different pixels), in PIL mode ``mode``, saved with
    PIL's JPEG options ``save`` (subsampling, progressive, restart_marker_rows, ...)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = 127.5 + 100 * np.sin((xx[..., None] / width + 2 * yy[..., None] / height) * np.pi
                                + np.arange(3))
    img = np.clip(base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).convert(mode).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()
