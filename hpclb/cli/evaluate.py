"""``hpclb evaluate RUN_DIR``: score a run's checkpoint again; prints the metrics as JSON."""
from __future__ import annotations

import argparse
import json

from hpclb.cli.common import exit_status, start_comm
from hpclb.errors import EXIT_USAGE

__all__ = ["HELP", "add_parser", "run"]

HELP = ("score a run's checkpoint again (e.g. seq2seq with another beam size); prints the "
        "metrics as JSON, changes nothing")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb evaluate`` on the top-level subparsers."""
    from hpclb.comm.registry import BACKENDS

    e = subparsers.add_parser("evaluate", help=HELP)
    e.add_argument("run_dir", help="a run directory written by hpclb train --out")
    e.add_argument("--beam-size", type=int, help="seq2seq: decode with this beam (1 = greedy; "
                   "default: the run's recipe)")
    e.add_argument("--length-penalty", type=float, help="seq2seq: GNMT's alpha for the beam "
                   "(default: the run's recipe, else 0.6)")
    e.add_argument("--data-dir", help="default: the run's")
    e.add_argument("--backend", default="auto", choices=list(BACKENDS))
    e.set_defaults(func=run)
    return e


def run(args: argparse.Namespace) -> int:
    """``hpclb evaluate``: rank 0 prints the metrics; 2 for bad input, 1 for a failure."""
    comm = start_comm(args.backend)
    if comm is None:
        return EXIT_USAGE
    try:
        from hpclb.tools.evaluate import evaluate_run

        result = evaluate_run(args.run_dir, comm, data_dir=args.data_dir,
                              beam_size=args.beam_size, length_penalty=args.length_penalty)
    except Exception as e:
        return exit_status(e, comm)
    if comm.rank == 0:
        print(json.dumps(result, indent=1), flush=True)
    return 0
