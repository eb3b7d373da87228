"""The fault matrix (issue 12 item 7, `make test-faults`): the real `hpclb train` in subprocesses,
1 process or `mpirun -n 2`, each case bounded in time and checked for its exit code, its message,
and that no progress is lost beyond the last checkpoint.

Runs use a tiny plug-in recipe (:mod:`fault_plugin`, copied beside the recipe in the test's
temporary folder): 1,024 generated samples, 16 features, 4 classes, an MLP, global batch 128 (8
steps per epoch), 2 epochs; a run takes well under a second once torch is imported.

When ``$HPCLB_FAULTS_REPORT`` names a file, the :func:`record` fixture appends one entry per case
``{case, bound_s, elapsed_s, exit_code, progress_kept}`` to it (a JSON list).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpclb.comm.launcher import stop_session

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
MPIRUN = BIN / "mpirun"
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}
for _var in [v for v in ENV if v.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "FAULT_",
                                             "HOOK_", "HPCLB_FUSION"))]:
    del ENV[_var]  # never inherit a surrounding mpirun's identity, nor a fault
BATCH = 128          # global batch: 1,024 samples -> 8 steps per epoch
EPOCHS = 2
RECIPE = {
    "name": "faults",
    "data": {"name": "fault_plugin:blobs"},
    "model": {"name": "fault_plugin:FaultyMLP"},
    "base_batch_size": 64, "epochs": EPOCHS, "warmup_epochs": 0.25,
    "decay": {"name": "poly", "power": 2.0, "end_lr": 0.0},
    "optimizer": "adam",
    "optimizers": {"adam": {"lr": 5.0e-3},
                   "lars": {"lr": 1.0, "momentum": 0.9, "weight_decay": 1.0e-4,
                            "trust_coefficient": 0.02}},
}
# `python -c` entry that installs tests/faults/fault_hooks.py's checkpoint hooks, then runs the CLI
HOOKED = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import fault_hooks; "
          f"from hpclb.cli import main; sys.exit(main())")


@pytest.fixture(autouse=True)
def _needs_mpirun():
    if not MPIRUN.exists():
        pytest.skip("no mpirun beside the interpreter (make install provides one)")


def write_recipe(folder: Path, **changes) -> Path:
    """The fault recipe (with ``changes``) and fault_plugin.py in ``folder``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "fault_plugin.py", folder / "fault_plugin.py")
    path = folder / "faults.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, **changes}))
    return path


def train_args(recipe: Path, out: Path, *extra) -> list[str]:
    return ["train", str(recipe), "--out", str(out), "--batch-size", str(BATCH), *map(str, extra)]


def command(args, ranks=1, hooked=False, rank_env=None, wrap=None) -> list[str]:
    """The argv that runs `hpclb <args>` on ``ranks`` processes. ``hooked``: through the
    fault_hooks entry. ``rank_env``: per-rank extra environment (an MPMD launch, one app context
    per rank). ``wrap``: a per-rank prefix (e.g. ``["bash", "-c", ...]``)."""
    entry = [sys.executable, "-c", HOOKED] if hooked else [sys.executable, "-m", "hpclb"]
    one = [*(wrap or []), *entry, *map(str, args)]
    if ranks == 1 and not rank_env:
        return one
    launch = [str(MPIRUN), "--bind-to", "none"]
    if not rank_env:
        return [*launch, "-n", str(ranks), *one]
    for r, env in enumerate(rank_env):
        if r:
            launch.append(":")
        launch += ["-n", "1", *[a for k, v in env.items() for a in ("-x", f"{k}={v}")], *one]
    return launch


def run(cmd, bound_s: float, env=None, cwd=None, signal_after: tuple | None = None):
    """Run ``cmd`` with a time bound (seconds; exceeding it fails the test: a hang). Returns
    (exit code, stdout+stderr, seconds). ``signal_after``: (seconds, signal) sent to the launched
    process after that delay."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         stdin=subprocess.DEVNULL, env={**ENV, **(env or {})}, cwd=cwd,
                         start_new_session=True)
    try:
        if signal_after:
            time.sleep(signal_after[0])
            p.send_signal(signal_after[1])
        out, _ = p.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        out, _ = stop_session(p, grace_s=5)  # mpirun and every rank (each has its own group)
        pytest.fail(f"still running after its bound of {bound_s} s (a hang): {cmd}\n{out}")
    return p.returncode, out, time.monotonic() - t


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def checkpoint_state(out: Path) -> dict:
    """The newest verified checkpoint under run folder ``out`` (what --resume would read)."""
    from hpclb.train.checkpoint import CheckpointStore

    loaded = CheckpointStore(out).latest()
    return None if loaded is None else loaded.state


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(ranks) -> summary``: the uninterrupted run of the fault recipe (cached);
    ``reference.folder(ranks)``: its run folder (read-only for the tests: copy it)."""
    done, folders = {}, {}

    def get(ranks: int) -> dict:
        if ranks not in done:
            folder = tmp_path_factory.mktemp(f"reference{ranks}")
            rc, out, _ = run(command(train_args(write_recipe(folder), folder / "run"), ranks),
                             bound_s=120)
            assert rc == 0, out
            done[ranks], folders[ranks] = summary(folder / "run"), folder / "run"
        return done[ranks]
    get.folder = folders.__getitem__
    return get


def same_result(a: dict, b: dict) -> bool:
    """Equal final test loss and accuracy and step count (a resumed run continues the same
    trajectory; across world sizes the global batches are the same, so fp32 rounding only)."""
    return (a["steps"] == b["steps"] and a["final_test_accuracy"] == b["final_test_accuracy"]
            and abs(a["final_test_loss"] - b["final_test_loss"]) <= 1e-5)


@pytest.fixture
def record(request):
    """``record(bound_s, elapsed_s, exit_code, progress_kept)``: append this case to
    ``$HPCLB_FAULTS_REPORT`` (a JSON list) when set; always printed (``pytest -s`` shows it)."""
    def add(bound_s: float, elapsed_s: float, exit_code: int, progress_kept: str) -> None:
        entry = {"case": request.node.name, "bound_s": bound_s,
                 "elapsed_s": round(elapsed_s, 2), "exit_code": exit_code,
                 "progress_kept": progress_kept}
        print(f"\n{json.dumps(entry)}")
        path = os.environ.get("HPCLB_FAULTS_REPORT")
        if path:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = json.loads(path.read_text()) if path.is_file() else []
            entries = [e for e in entries if e["case"] != entry["case"]] + [entry]
            path.write_text(json.dumps(entries, indent=1) + "\n")
    return add
