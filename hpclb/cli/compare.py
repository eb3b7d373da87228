"""``hpclb compare RUN...``: a table of runs side by side (Markdown or CSV) on stdout."""
from __future__ import annotations

import argparse
import sys

from hpclb.cli.common import error
from hpclb.errors import EXIT_USAGE, ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = ("runs side by side: batch, scheme, steps, final and best metric, time to target, "
        "samples/s (Markdown or CSV)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb compare`` on the top-level subparsers."""
    p = subparsers.add_parser("compare", help=HELP, description=HELP + ". A finished run is "
                              "read from its summary.json, an unfinished one from its "
                              "config.json and metrics.jsonl so far (status: unfinished, or "
                              "diverged at step S).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN", help="run directories (the --out of "
                   "hpclb train), one row each, in this order")
    p.add_argument("--format", default="markdown", choices=("markdown", "csv"),
                   help="markdown (default: formatted, accuracies in %%) or csv (raw numbers)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``hpclb compare``: print the table; 2 for a path that is not a run directory."""
    from hpclb.tools.compare import compare_rows, csv_table, markdown_table

    def warn(message: str) -> None:
        print(f"hpclb compare: warning: {message}", file=sys.stderr, flush=True)

    try:
        rows = compare_rows(args.run_dirs, warn=warn)
    except (ConfigError, OSError) as e:
        error(str(e))
        return EXIT_USAGE
    text = csv_table(rows) if args.format == "csv" else markdown_table(rows) + "\n"
    sys.stdout.write(text)
    return 0
