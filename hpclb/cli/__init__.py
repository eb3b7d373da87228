"""``hpclb train|evaluate|sweep|compare|data|jobs|bench|plot|scale|advise|doctor`` command line.

One module per command (``hpclb.cli.<command>``: ``HELP``, ``add_parser(subparsers)``,
``run(args) -> int``); what they share is in :mod:`hpclb.cli.common`. Importing this package
loads the standard library and hpclb's torch-free modules only (:mod:`hpclb.errors`,
:mod:`hpclb.tools.jobs_spec`): :func:`main` installs the preemption signal handlers first, and
each command imports what it needs (torch, MPI) when its parser is built or it runs.

Errors: a bad setting (ConfigError) is printed once, by rank 0, and every rank exits with 2; any
other failure is printed by the rank that hit it, which then aborts the whole MPI job (exit 1) so
no rank waits forever in a collective (:func:`hpclb.cli.common.exit_status`).
"""
from __future__ import annotations

import argparse
import os
import sys

from hpclb import __version__
from hpclb.cli import (
    advise,
    bench,
    common,
    compare,
    data,
    doctor,
    evaluate,
    jobs,
    plot,
    scale,
    sweep,
    train,
)
from hpclb.errors import EXIT_USAGE, DiskFull, MissingExtraError

__all__ = ["COMMANDS", "build_parser", "main", "run"]

# hpclb <command>, in the order `hpclb --help` lists them
COMMANDS = {"train": train, "evaluate": evaluate, "sweep": sweep, "compare": compare,
            "data": data, "jobs": jobs, "bench": bench, "plot": plot, "scale": scale,
            "advise": advise, "doctor": doctor}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``hpclb`` parser. ``only``: the command whose arguments are added (the others are
    listed with their help line only, so ``hpclb --help`` imports nothing heavy); None: every
    command's."""
    p = argparse.ArgumentParser(prog="hpclb", description="Large-batch training with LEGW over MPI "
                                "(You et al., SC '19).")
    p.add_argument("--version", action="version", version=f"hpclb {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if only is None or name == only:
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=module.HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``hpclb ARGV`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    common.install_early_signals(argv)  # before any heavy import
    args = build_parser(only=common.command_of(argv) or "").parse_args(argv)
    problem = common.check_path_options(args)
    if problem:
        common.error(problem)
        return EXIT_USAGE
    try:
        return args.func(args)
    except (MissingExtraError, DiskFull) as e:  # one line (the extra; the file), any command
        common.error(str(e))
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; the shell's status for it
        command = common.command_of(argv) or ""
        kept = ("; a run keeps its last checkpoint (resume with --resume)"
                if command in ("train", "sweep") else "")
        print(f"hpclb {command}: interrupted (Ctrl-C){kept}", file=sys.stderr)
        return 130


def run() -> None:
    """The ``hpclb`` console command and ``python -m hpclb``: :func:`main`, then a prompt exit
    with its status (:func:`hpclb.cli.common.exit_promptly`: no seconds of interpreter
    teardown after the last line). In-process callers use :func:`main`."""
    try:
        status = main()
    except BrokenPipeError:  # `hpclb ... | head`: the reader left; no traceback for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 141  # as a shell reports a process ended by SIGPIPE
    common.exit_promptly(status)
