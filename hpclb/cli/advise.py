"""``hpclb advise RUN_DIR``: the critical batch of a run trained with --noise-scale."""
from __future__ import annotations

import argparse
import sys

from hpclb.cli.common import error
from hpclb.errors import EXIT_USAGE, ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = ("critical batch size (gradient noise scale) of a run trained with --noise-scale, and the "
        "largest batch for LEGW")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb advise`` on the top-level subparsers."""
    p = subparsers.add_parser("advise", help=HELP)
    p.add_argument("run_dir", help="a run directory written by hpclb train --noise-scale")
    p.add_argument("--last", type=int, default=3, help="epochs to combine (default 3)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``hpclb advise``: print critical and recommended batch; 2 without noise data."""
    from hpclb.tools.advise import advise, format_advice

    def warn(message: str) -> None:
        print(f"hpclb advise: warning: {message}", file=sys.stderr, flush=True)

    try:
        print(format_advice(advise(args.run_dir, last=args.last, warn=warn)))
    except (ConfigError, OSError, ValueError) as e:
        error(str(e))
        return EXIT_USAGE
    return 0
