"""``hpclb sweep EXPERIMENT --batch-sizes ...``: a resumable batch-size sweep."""
from __future__ import annotations

import argparse
import os

from hpclb.cli.common import error, setup_logging
from hpclb.cli.jobs import add_job_size, job_spec
from hpclb.errors import (
    EXIT_FAILURE,
    EXIT_USAGE,
    PREEMPTED_EXIT_CODE,
    ConfigError,
    DataError,
    JobError,
    Preempted,
)
from hpclb.tools.jobs_spec import SCHEDULERS

__all__ = ["HELP", "add_parser", "run"]

HELP = ("batch-size sweep of one recipe under several scaling schemes (resumable; or one job "
        "array of SLURM/PBS with --submit); writes <runs-dir>/<experiment>/<experiment>."
        "{json,md,png}")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb sweep`` on the top-level subparsers."""
    from hpclb.config import OPTIMIZERS
    from hpclb.schedules import SCHEMES

    w = subparsers.add_parser("sweep", help=HELP)
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
    w.add_argument("--micro-batch", type=int, help="samples per forward pass on a rank: each "
                   "point accumulates B / (ranks x MICRO_BATCH) micro-batches per step (BatchNorm "
                   "then sees MICRO_BATCH samples, as on that many ranks); default: no "
                   "accumulation")
    seeds = w.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", default="0", help="comma-separated seeds; each (batch, "
                       "scheme, seed) is a point of its own, e.g. 0,1,2")
    seeds.add_argument("--seed", type=int, help="one seed (the same as --seeds N)")
    w.add_argument("--status", action="store_true", help="print what is done, running in "
                   "another sweep process and left, with the hours expected; train nothing")
    w.add_argument("--data-dir", help="where the data lives (default $HPCLB_DATA or ./data; "
                   "with --submit, $HPCLB_DATA as set here is passed to the tasks)")
    w.add_argument("--out-dir", help="where the tables and plots go (default: "
                   "RUNS_DIR/<experiment>, beside the points; the committed ones are in "
                   "results/sweeps)")
    w.add_argument("--runs-dir", default="runs/sweeps", help="run directories of the points")
    w.add_argument("--verbose", action="store_true", help="print every point's training log")
    w.add_argument("--overwrite", action="store_true", help="delete a point's run directory "
                   "that holds a run of other settings (budget, seed, ranks) and rerun it")
    w.add_argument("--submit", choices=SCHEDULERS, help="run the sweep as ONE job array, a "
                   "task per point not yet recorded (a preempted task checkpoints, requeues "
                   "and resumes); its size: the job array options below; --status then shows "
                   "its id")
    w.add_argument("--no-submit", action="store_true", help="with --submit: write the script "
                   "and print the command that submits it, submit nothing")
    w.add_argument("--task-index", type=int, help=argparse.SUPPRESS)  # one task of the array
    add_job_size(w, "job array (--submit; nodes x ranks per node = --ranks)")
    w.set_defaults(func=run)
    return w


def _stopped(p: Preempted, args: argparse.Namespace) -> int:
    """The error line and exit status of a sweep stopped by a signal (75) or Ctrl-C (130)."""
    code = 130 if p.args[1:] == ("interrupted",) else PREEMPTED_EXIT_CODE
    step = p.args[0] if p.args else None
    saved = (f"the point in progress checkpointed at global step {step}" if step is not None
             else "the point in progress wrote no new checkpoint (stopped before it trained, "
                  "or forced; it keeps its last one, if any)")
    ranks = (" (its ranks report exit 75: mpirun passes a stop on to them as USR2)"
             if code == 130 and args.ranks > 1 and step is not None else "")
    error(f"sweep stopped by {'Ctrl-C' if code == 130 else 'a signal'}, exit {code}; "
          f"{saved}{ranks}: run the same command again to resume")
    return code


def run(args: argparse.Namespace) -> int:
    """``hpclb sweep``: 0 when every point is recorded (a diverged point is a result: it is
    named, with its step) or the job array is submitted, 2 for bad input, 1 when a point was
    rejected (each is named) or crashed, 75 when stopped by SIGTERM/SIGUSR2, 130 by Ctrl-C."""
    from hpclb.tools.sweep import failed_points, run_sweep, submit_sweep, sweep_status

    setup_logging(0)
    lists = {}
    for flag, text in (("--batch-sizes", args.batch_sizes), ("--seeds", args.seeds)):
        try:
            lists[flag] = [int(b) for b in text.split(",") if b.strip()]
        except ValueError:
            error(f"{flag}: expected comma-separated integers, got {text!r}")
            return EXIT_USAGE
    batches = lists["--batch-sizes"]
    seeds = [args.seed] if args.seed is not None else lists["--seeds"]
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    common = dict(epochs=args.epochs, ranks=args.ranks, seeds=seeds, optimizer=args.optimizer,
                  out_dir=args.out_dir, runs_dir=args.runs_dir, micro_batch=args.micro_batch,
                  data_dir=args.data_dir, overwrite=args.overwrite)
    log = lambda m: print(m, flush=True)  # noqa: E731
    try:
        if args.status:
            common.pop("overwrite")
            status = sweep_status(args.experiment, batches, schemes, **common)
            for line in filter(None, (status.line(), status.array)):
                print(f"sweep {args.experiment}: {line}")
            return 0
        if args.submit:
            # the tasks read the data this sweep checked: PBS passes no environment to a job
            data_dir = args.data_dir or os.environ.get("HPCLB_DATA") or None
            job = job_spec(args, array=True, experiment=args.experiment,
                           scheduler=args.submit, data_dir=data_dir)
            submit_sweep(args.experiment, batches, schemes, submit=not args.no_submit, log=log,
                         job=job, **{**common, "data_dir": data_dir})
            return 0
        rows = run_sweep(args.experiment, batches, schemes, quiet=not args.verbose, log=log,
                         task_index=args.task_index, **common)
    except (ConfigError, JobError) as e:
        error(str(e))
        return EXIT_USAGE
    except (DataError, RuntimeError) as e:
        error(f"{type(e).__name__}: {e}")
        return EXIT_FAILURE
    except Preempted as p:
        return _stopped(p, args)
    for r in rows:
        if r.get("status") == "diverged":
            print(f"sweep {args.experiment}: B={r['batch_size']} {r['scheme']} seed {r['seed']}: "
                  f"diverged at step {r.get('diverged_at_step')} (recorded: a result, not a "
                  f"failure of the sweep)")
    failed = failed_points(rows, batches, schemes)
    for why in failed:
        error(f"sweep point failed: {why}")
    return EXIT_FAILURE if failed else 0
