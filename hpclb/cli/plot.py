"""``hpclb plot schedule|runs|sweep``: PNGs of LR schedules, finished runs and batch sweeps."""
from __future__ import annotations

import argparse
import sys

from hpclb.cli.common import error
from hpclb.errors import EXIT_USAGE, ConfigError, DiskFull, MissingExtraError

__all__ = ["HELP", "add_parser", "run"]

HELP = ("PNGs: LR schedules of a recipe (LEGW picture), runs' metrics, a sweep's metric vs "
        "batch")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb plot schedule|runs|sweep`` on the top-level subparsers."""
    from hpclb.schedules import SCHEMES

    p = subparsers.add_parser("plot", help=HELP)
    psub = p.add_subparsers(dest="plot_command", required=True)
    s = psub.add_parser("schedule", help="LR vs epochs and vs steps for every scheme and k")
    s.add_argument("experiment", help="recipe name or path to a recipe .yaml")
    s.add_argument("--k", type=float, nargs="+", default=[1, 8, 64],
                   help="batch ratios B / B0 (default 1 8 64)")
    s.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    s.add_argument("--epochs", type=float, help="training budget (default: the recipe's)")
    s.add_argument("--optimizer", help="whose B0 LR (default: the recipe's optimizer)")
    s.add_argument("--num-samples", type=int, help="training-set size, for data sets "
                   "the data-set registry (hpclb.data.registry) has no size for")
    s.add_argument("--out", help="PNG path (default results/schedules/<experiment>.png)")
    r = psub.add_parser("runs", help="loss, metric, LR, trust ratios of runs vs epoch")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", help="PNG path (default RUN_DIR/plot.png, or "
                   "<parent>/plot-<run>+<run>.png for several)")
    w = psub.add_parser("sweep", help="a sweep's metric vs batch per scheme, B0 marked")
    w.add_argument("sweep_json", metavar="SWEEP.json", help="results/sweeps/<experiment>.json")
    w.add_argument("--out", help="PNG path (default: SWEEP.png beside the JSON)")
    for sub in (s, r, w):
        sub.add_argument("--overwrite", action="store_true",
                         help="replace a PNG already at the output path")
    p.set_defaults(func=run)
    return p


def _warning(message: str) -> None:
    print(f"hpclb plot: warning: {message}", file=sys.stderr, flush=True)


def _draw(args: argparse.Namespace):
    """The PNG's path; the schedule pairs that could not run are reported on stderr."""
    from hpclb.tools.plot import plot_runs, plot_schedule, plot_sweep

    if args.plot_command == "schedule":
        path, _, skipped = plot_schedule(args.experiment, args.k, args.out,
                                         schemes=args.schemes, num_samples=args.num_samples,
                                         epochs=args.epochs, optimizer=args.optimizer,
                                         overwrite=args.overwrite)
        for why in skipped:
            print(f"hpclb plot: skipped {why}", file=sys.stderr)
        return path
    if args.plot_command == "runs":
        return plot_runs(args.run_dirs, args.out, warn=_warning, overwrite=args.overwrite)[0]
    return plot_sweep(args.sweep_json, args.out, overwrite=args.overwrite)[0]


def run(args: argparse.Namespace) -> int:
    """``hpclb plot``: print the PNG's path; 2 on bad input, 1 without matplotlib."""
    try:
        path = _draw(args)
    except (MissingExtraError, DiskFull) as e:
        error(str(e))
        return e.exit_code
    except (ConfigError, OSError, ValueError) as e:
        error(str(e))
        return EXIT_USAGE
    print(path)
    return 0
