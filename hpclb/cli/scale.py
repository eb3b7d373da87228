"""``hpclb scale RUN_DIR --to-batch B``: carry a finished run's recipe to another batch size."""
from __future__ import annotations

import argparse

from hpclb.cli.common import error
from hpclb.errors import EXIT_USAGE, ConfigError
from hpclb.tools.jobs_spec import SCHEDULERS

__all__ = ["HELP", "add_parser", "run"]

HELP = ("write a finished run's recipe for another batch size (LEGW by default) and print what "
        "changes")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb scale`` on the top-level subparsers."""
    from hpclb.schedules import SCHEMES

    p = subparsers.add_parser("scale", help=HELP)
    p.add_argument("run_dir", help="a run directory written by hpclb train --out")
    p.add_argument("--to-batch", type=int, required=True, help="the new global batch (samples)")
    p.add_argument("--scaling", default="legw", choices=list(SCHEMES))
    p.add_argument("--epochs", type=float, help="training budget at the new batch (default: "
                   "the run's)")
    p.add_argument("--out", help="recipe path (default RUN_DIR/recipe-b<B>-<scaling>.yaml)")
    p.add_argument("--num-samples", type=int, help="training-set size, for data sets "
                   "the data-set registry (hpclb.data.registry) has no size for")
    p.add_argument("--scheduler", choices=SCHEDULERS, help="also write a job script "
                   "beside the recipe")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, help="one rank per GPU")
    p.add_argument("--tasks-per-node", type=int, help="ranks per node on CPU-only nodes")
    p.add_argument("--overwrite", action="store_true", help="replace a recipe or job script "
                   "already at the output path")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``hpclb scale``: write the recipe (and job script), print the changes; 2 on bad input."""
    from hpclb.tools.jobs import template_engine
    from hpclb.tools.scale import format_changes, scale_run, write_job

    if args.scheduler and (args.nodes is None or args.gpus_per_node is None):
        error("--scheduler needs --nodes N and --gpus-per-node G (0 with --tasks-per-node "
              "for CPU-only nodes)")
        return EXIT_USAGE
    if args.scheduler:
        template_engine()  # without jinja2: say so before the recipe is written
    try:
        s = scale_run(args.run_dir, args.to_batch, scaling=args.scaling, out=args.out,
                      num_samples=args.num_samples, epochs=args.epochs,
                      overwrite=args.overwrite)
        print(format_changes(s))
        if args.scheduler:
            job = write_job(s, args.scheduler, args.nodes, args.gpus_per_node,
                            tasks_per_node=args.tasks_per_node, overwrite=args.overwrite)
            print(f"job script ({args.scheduler}, {args.nodes} node(s)): {job}")
    except ConfigError as e:
        error(str(e))
        return EXIT_USAGE
    return 0
