"""``hpclb train EXPERIMENT``: train one experiment (under mpirun for several ranks)."""
from __future__ import annotations

import argparse
import sys
import warnings

from hpclb.cli.common import (
    error,
    exit_status,
    install_early_signals,
    preempted_during_start_up,
    start_comm,
)
from hpclb.errors import (
    DIVERGED_EXIT_CODE,
    EXIT_USAGE,
    PREEMPTED_EXIT_CODE,
    ConfigError,
    Diverged,
    Preempted,
    RecipeWarning,
    RunFinished,
)

__all__ = ["HELP", "add_parser", "run"]

HELP = "train one experiment (run under mpirun for several ranks)"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb train`` on the top-level subparsers."""
    from hpclb.comm.registry import BACKENDS
    from hpclb.config import OPTIONS, available_experiments
    from hpclb.config.fields import add_option_flags

    t = subparsers.add_parser("train", help=HELP)
    t.add_argument("experiment", help=f"recipe name ({', '.join(available_experiments())}) or "
                   "path to a recipe .yaml")
    add_option_flags(t, OPTIONS)  # --batch-size, --scaling, ... (hpclb.config.settings)
    t.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="communication backend (auto: mpi when launched by mpirun/srun)")
    t.add_argument("--expect-world-size", type=int, help="fail unless the job has this many ranks")
    t.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                   help="write no TensorBoard event files under OUT/tb (metrics.jsonl is always "
                        "written); default: write them when the tensorboard package is installed")
    t.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                   help="also checkpoint mid-epoch every SECONDS of rank 0's wall time (0 or "
                   "default: at epoch ends and on preemption only)")
    _add_run_options(t)
    t.set_defaults(func=run)
    return t


def _add_run_options(t: argparse.ArgumentParser) -> None:
    """The run settings' flags (:mod:`hpclb.config.fields`), then ``hpclb train``'s own:
    GPU sharing, progress, profiling, dry run."""
    from hpclb.config.fields import add_setting_flags

    add_setting_flags(t)
    t.add_argument("--share-gpu", action="store_true", help="allow more ranks than GPUs on a "
                   "node (ranks share GPUs round-robin; for tests)")
    t.add_argument("--progress-every", type=_progress_seconds, default=60.0, metavar="SECONDS",
                   help="when stderr is not a terminal (a SLURM log), rank 0 prints a progress "
                   "line (step, loss, LR, samples/s, ETA) every SECONDS during an epoch (0: "
                   "off; on a terminal a progress bar instead; default 60)")
    t.add_argument("--profile", metavar="START:END", help="torch.profiler trace of global steps "
                   "START+1 to END (a Python slice: 10:15 traces steps 11-15), per rank in "
                   "OUT/profile/rank<r>/ (a Chrome trace that TensorBoard also reads); data, "
                   "forward/backward, allreduce wait, collectives and optimizer labelled")
    t.add_argument("--dry-run", action="store_true", help="print the resolved plan (batch per "
                   "rank, peak LR, warmup, total steps, LEGW warmup fraction, devices, backend) "
                   "and exit 0 without training or creating OUT; warns when warmup takes more "
                   "than half the run")


def _progress_seconds(value: str) -> float:
    """``--progress-every``: a number of seconds >= 0 (0: no lines)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # also nan
        raise argparse.ArgumentTypeError(f"{value!r}: a number of seconds >= 0 (0: no progress "
                                         f"lines), e.g. 60")
    return seconds


def _recipe_device(args: argparse.Namespace) -> str:
    """``--device``, else the recipe's ``device`` field, else auto (a broken recipe is reported
    by ``resolve`` once the communicator is up)."""
    if args.device:
        return args.device
    try:
        from hpclb.config import load_recipe

        # --epochs as the budget: a recipe whose own epochs are shorter than its warmup loads
        return load_recipe(args.experiment, epochs=args.epochs).get("device", "auto")
    except Exception:  # noqa: BLE001 (reported with its rank-0 message later)
        return "auto"


def _resolve(args: argparse.Namespace, comm):
    """The run's RunConfig from the flags, after the checks that need the world size;
    ConfigError (on every rank alike) for a bad setting."""
    from hpclb.config import SYNC_SETTINGS, check_checkpoint_interval, check_expect_world_size
    from hpclb.config.settings import KEYWORDS, resolve
    from hpclb.train.profile import parse_profile_steps

    check_checkpoint_interval(args.checkpoint_interval)
    args.profile_window = parse_profile_steps(args.profile)
    check_expect_world_size(args.expect_world_size)
    if args.expect_world_size is not None and args.expect_world_size != comm.world_size:
        raise ConfigError(
            f"--expect-world-size {args.expect_world_size}, but this job has world size "
            f"{comm.world_size} ({comm.backend} backend); launch it with `mpirun -n "
            f"{args.expect_world_size}` from the MPI that mpi4py uses (.venv/bin/mpirun)")
    if comm.rank > 0:  # recipe warnings once, from rank 0
        warnings.simplefilter("ignore", RecipeWarning)
    return resolve(args.experiment, sync={name: getattr(args, name) for name in SYNC_SETTINGS},
                   **{name: getattr(args, name) for name in KEYWORDS})


def _resolve_agreed(args: argparse.Namespace, comm):
    """:func:`_resolve` on every rank with its outcome agreed (a rank that fails, e.g. without
    the recipe file or with another recipe, ends every rank with its message), then the whole
    configuration agreed (:mod:`hpclb.config.agreement`): before any other collective, so
    ranks launched with different settings all stop with exit 2 instead of hanging or training
    apart."""
    from hpclb.config.agreement import agree_run_settings, run_settings
    from hpclb.train.agreed import agreed

    cfg = agreed(comm, "resolving the settings", lambda: _resolve(args, comm))
    agree_run_settings(comm, run_settings(cfg, {
        f"{name} ({flag})": getattr(args, name) for name, flag in _CLI_ONLY.items()}))
    return cfg


# hpclb train's options that are not in the RunConfig and are agreed as well (--out,
# --data-dir: locations; --backend: compared before the communicator starts, in
# hpclb.comm.world; --progress-every: rank 0's progress lines only)
_CLI_ONLY = {"checkpoint_interval": "--checkpoint-interval", "profile": "--profile",
             "dry_run": "--dry-run", "tensorboard": "--no-tensorboard",
             "expect_world_size": "--expect-world-size", "share_gpu": "--share-gpu"}


def _train(args: argparse.Namespace, comm, cfg, early) -> int:
    """Train ``cfg``; 75 when preempted (before training began, or after the checkpoint), 3
    when the run diverged, 0 (nothing trained) on ``--resume`` of a finished run."""
    from hpclb.train.loop import train

    if preempted_during_start_up(comm, early):
        # no model yet, so no checkpoint to write: exit 75 and let the job requeue (it
        # resumes from an earlier checkpoint under --out, or starts afresh)
        print(f"hpclb: rank {comm.rank} of {comm.world_size}: preempted during start-up, "
              f"before training began; no new checkpoint; exit {PREEMPTED_EXIT_CODE}",
              file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    try:
        train(cfg, comm, checkpoint_interval_s=args.checkpoint_interval,
              tensorboard=None if args.tensorboard else False, profile=args.profile_window,
              progress_every_s=args.progress_every, ignore_ctrl_c_when_done=True)
    except Preempted as p:
        if p.args[1:] == ("interrupted",):  # Ctrl-C: the loop said where the checkpoint is
            return 130
        print(f"hpclb: rank {comm.rank} of {comm.world_size}: preempted after step {p.args[0]}"
              f", checkpoint saved; exit {PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except Diverged as d:  # raised on every rank together: no abort needed
        if comm.rank == 0:
            error(f"diverged: {d}; exit {DIVERGED_EXIT_CODE}")
        return DIVERGED_EXIT_CODE
    except RunFinished as f:  # every rank together: nothing trained, nothing written
        if comm.rank == 0:
            print(f"hpclb: {f}", flush=True)
        return 0
    return 0


def run(args: argparse.Namespace) -> int:
    """``hpclb train``: the exit status (0, 2 bad input, 3 diverged, 75 preempted, 1 failed);
    ``--dry-run``: 0 after printing the plan, 2 for bad input."""
    early = install_early_signals(["train"], fresh=False)  # main() did it; for direct calls
    comm = start_comm(args.backend, _recipe_device(args), args.share_gpu)
    if comm is None:
        return EXIT_USAGE
    try:
        cfg = _resolve_agreed(args, comm)
        if args.dry_run:
            from hpclb.tools.dryrun import dry_run

            return dry_run(cfg, comm, profile=args.profile_window)
        return _train(args, comm, cfg, early)
    except BrokenPipeError:  # `--dry-run | head`: the reader left; hpclb's run() ends quietly
        raise
    except Exception as e:  # ConfigError, DataError, CheckpointError, anything else
        return exit_status(e, comm)
