"""How many hpclb modules and functions one optimizer step runs through (docs/design.md, "One
training step"): two profiled `hpclb train` runs under `mpirun -n 2` that differ only in the
number of steps (the same data and epochs, global batch 512 vs 256), rank 0's cProfile call
counts compared; a function of hpclb whose calls grow with the steps is on the step's path
(the model, data and task modules included). Prints the counts and the list.

    .venv/bin/python dev/step_footprint.py [--optimizer lars] [--accumulation-steps 1]
"""
from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PROFILE = ("import cProfile, os, sys; from hpclb import cli; p = cProfile.Profile(); "
           "p.enable(); code = 1\ntry:\n    code = cli.main(sys.argv[1:])\nfinally:\n"
           "    p.disable(); p.dump_stats(os.environ['FOOTPRINT_OUT'] + '.' + "
           "os.environ.get('OMPI_COMM_WORLD_RANK', '0'))\nsys.exit(code)")


def _calls(prof: Path) -> dict[tuple[str, str], int]:
    stats = pstats.Stats(str(prof)).stats
    root = str(REPO / "hpclb")
    return {(f, name): cc for (f, _, name), (cc, *_rest) in stats.items()
            if f.startswith(root)}


def _run(work: Path, batch: int, args) -> dict[tuple[str, str], int]:
    recipe = yaml.safe_load(subprocess.run(
        [sys.executable, "-c", "import yaml; from hpclb.config import load_recipe; "
         "print(yaml.safe_dump(load_recipe('mnist-lstm')))"], capture_output=True, text=True,
        check=True).stdout)
    recipe.update(epochs=1, warmup_epochs=0.0625, log_every=0,
                  data={"name": "mnist", "train_samples": 4096, "test_samples": 512})
    path = work / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = work / f"b{batch}"
    env = {**os.environ, "FOOTPRINT_OUT": str(out), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    mpirun = Path(sys.executable).parent / "mpirun"
    subprocess.run([str(mpirun), "-n", "2", "--bind-to", "none", "-x", "FOOTPRINT_OUT", "-x",
                    "PYTHONPATH", "-x", "OMP_NUM_THREADS", sys.executable, "-c", PROFILE,
                    "train", str(path), "--batch-size", str(batch), "--optimizer",
                    args.optimizer, "--accumulation-steps", str(args.accumulation_steps),
                    "--out", str(work / f"run{batch}"), "--no-tensorboard"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return _calls(Path(f"{out}.0"))


def main() -> int:
    """Run both profiles and print the functions on the step's path; 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="lars")
    ap.add_argument("--accumulation-steps", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        few, many = _run(Path(tmp), 512, args), _run(Path(tmp), 256, args)
    grow = sorted(k for k, n in many.items() if n > few.get(k, 0))
    modules = sorted({os.path.relpath(f, REPO) for f, _ in grow})
    for f, name in grow:
        print(f"{os.path.relpath(f, REPO)}:{name}  {few.get((f, name), 0)} -> {many[(f, name)]}")
    print(f"step footprint: {len(modules)} hpclb modules, {len(grow)} hpclb functions "
          f"(optimizer {args.optimizer}, 2 ranks, K = {args.accumulation_steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
