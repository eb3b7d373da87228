"""How many hpclb modules and functions one optimizer step runs through (docs/design.md, "One
training step"): two profiled `hpclb train` runs under `mpirun -n 2` that differ only in the
number of steps (the same data and epochs, global batch 512 vs 256), rank 0's cProfile call
counts compared; a function of hpclb whose calls grow with the steps is on the step's path
(the model, data and task modules included). Prints the counts and the list; with
--max-modules / --max-functions, exits 1 when the step runs through more (make test-extended
holds it to the bounds of docs/design.md: tests/test_step_footprint.py).

    .venv/bin/python dev/step_footprint.py [--optimizer lars] [--accumulation-steps 1]
        [--max-modules N] [--max-functions N]
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

_INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _calls(prof: Path) -> dict[tuple[str, int, str], int]:
    """Call counts of hpclb's functions, keyed by (file, first line, name). Comprehensions and
    generator expressions are read as part of the function that holds them (Python 3.12 inlines
    comprehensions, PEP 709): not counted."""
    stats = pstats.Stats(str(prof)).stats
    root = str(REPO / "hpclb")
    return {(f, line, name): cc for (f, line, name), (cc, *_rest) in stats.items()
            if f.startswith(root) and name not in _INLINE}


def _run(work: Path, batch: int, args) -> dict[tuple[str, int, str], int]:
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
    """Run both profiles and print the functions on the step's path; 0, or 1 when a bound is
    exceeded."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="lars")
    ap.add_argument("--accumulation-steps", type=int, default=1)
    ap.add_argument("--max-modules", type=int, default=None,
                    help="exit 1 when the step runs through more hpclb modules than this")
    ap.add_argument("--max-functions", type=int, default=None,
                    help="exit 1 when the step runs through more hpclb functions than this")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        few, many = _run(Path(tmp), 512, args), _run(Path(tmp), 256, args)
    grow = sorted(k for k, n in many.items() if n > few.get(k, 0))
    modules = sorted({os.path.relpath(f, REPO) for f, _, _ in grow})
    for key in grow:
        f, line, name = key
        print(f"{os.path.relpath(f, REPO)}:{line}:{name}  {few.get(key, 0)} -> {many[key]}")
    print(f"step footprint: {len(modules)} hpclb modules, {len(grow)} hpclb functions "
          f"(optimizer {args.optimizer}, 2 ranks, K = {args.accumulation_steps})")
    over = [f"{len(what)} {name} > {bound}" for what, name, bound in
            ((modules, "modules", args.max_modules), (grow, "functions", args.max_functions))
            if bound is not None and len(what) > bound]
    if over:
        print(f"step footprint over its bound: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
