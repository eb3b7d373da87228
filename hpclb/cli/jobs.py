"""``hpclb jobs render|examples``: SLURM / PBS job scripts from jobs/templates."""
from __future__ import annotations

import argparse
import os
import sys

from hpclb.cli.common import error
from hpclb.errors import ConfigError, JobError
from hpclb.tools.jobs_spec import (
    ALLREDUCE,
    DEVICES,
    FABRICS,
    GPU_BINDS,
    JOB_BACKENDS,
    SCHEDULERS,
    SLURM_LAUNCHERS,
    JobSpec,
)

__all__ = ["HELP", "add_job_size", "add_parser", "job_spec", "run"]

HELP = "render SLURM / PBS job scripts from jobs/templates"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb jobs render|examples`` on the top-level subparsers."""
    j = subparsers.add_parser("jobs", help=HELP)
    jsub = j.add_subparsers(dest="jobs_command", required=True)
    r = jsub.add_parser("render", help="a batch script for one experiment at N nodes x G GPUs, "
                        "global batch --batch-size B split over the ranks, with the LR/warmup "
                        "of --scaling (LEGW) for B")
    _add_allocation(r)
    _add_run_settings(r)
    r.set_defaults(func=run)
    e = jsub.add_parser("examples", help="re-render the committed examples (jobs/slurm, jobs/pbs)")
    e.add_argument("root", nargs="?", default="jobs")
    e.set_defaults(func=run)
    return j


def _add_allocation(r: argparse.ArgumentParser) -> None:
    """What the job asks the scheduler for, and where its files go."""
    r.add_argument("experiment", help="recipe name or path to a recipe .yaml")
    r.add_argument("--scheduler", required=True, choices=SCHEDULERS)
    add_job_size(r)
    r.add_argument("--batch-size", type=int, help="the global batch B (samples per step over "
                   "all ranks; default the recipe's B0): each rank takes B / (nodes x ranks per "
                   "node), so LR and warmup do not change with the node count")
    r.add_argument("--per-gpu-batch", type=int, help="samples per rank and step instead of "
                   "--batch-size (the global batch then grows with the node count)")
    r.add_argument("--out", help="run directory, relative to the submit directory")
    r.add_argument("--data-dir", help="data directory on the cluster (exported as HPCLB_DATA)")


def add_job_size(r: argparse.ArgumentParser, title: str | None = None) -> None:
    """The job's size and environment, shared by ``hpclb jobs render`` and ``hpclb sweep
    --submit`` (``title``: in an argument group of that title, with defaults of 1 node and no
    GPU instead of required): nodes, GPUs, ranks, CPUs, time, queue, account, names,
    environment, the preemption signal's lead time, whole nodes, fabric tuning."""
    g = r.add_argument_group(title) if title else r
    sized = {"default": 1} if title else {"required": True}
    g.add_argument("--nodes", type=int, **sized)
    g.add_argument("--gpus-per-node", type=int, **({"default": 0} if title else sized),
                   help="one rank per GPU; 0 for CPU-only nodes (then --tasks-per-node)")
    g.add_argument("--tasks-per-node", type=int, help="ranks per node on CPU-only nodes")
    g.add_argument("--cpus-per-task", type=int, help="default 8 with GPUs, 1 without")
    g.add_argument("--time", default="04:00:00", help="time limit, [D-]HH:MM:SS")
    g.add_argument("--partition", help="SLURM partition / PBS queue")
    g.add_argument("--account", help="account to charge")
    g.add_argument("--job-name")
    g.add_argument("--log", help="the scheduler's output file (default <job-name>-%%j.out for "
                   "SLURM, <job-name>.log for PBS; an array's tasks: -%%A_%%a.out, "
                   ".^array_index^.log; in the submit directory, which must exist)")
    g.add_argument("--venv", default=".venv", help="virtualenv to activate ('' for none)")
    g.add_argument("--module", action="append", help="environment module to load (repeatable)")
    g.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                   help="preemption signal this long before the time limit (SLURM --signal)")
    whole = g.add_mutually_exclusive_group()
    whole.add_argument("--exclusive", action="store_true", default=None,
                       help="ask for whole nodes (the default" + (", except for one-node "
                       "tasks)" if title else ")"))
    whole.add_argument("--shared", dest="exclusive", action="store_false", default=None,
                       help="do not ask for whole nodes: the scheduler may place other jobs "
                       "beside it" + (" (the default for one-node tasks)"
                                      if title else ""))
    _add_fabric(r)


def _add_fabric(r: argparse.ArgumentParser) -> None:
    """Fabric tuning: each option exports only its own variables, none by default."""
    t = r.add_argument_group("fabric tuning (default: none; the site's MPI and NCCL choose; "
                             "measure each with `hpclb bench allreduce`, docs/clusters.md)")
    t.add_argument("--fabric", default="auto", choices=FABRICS,
                   help="ib: Open MPI over UCX with TCP excluded (fails rather than fall back), "
                   "NCCL over IB verbs; tcp: Open MPI ob1 over TCP, NCCL over sockets; local: "
                   "emulated nodes on one host (over lo)")
    t.add_argument("--allreduce", default="auto", choices=ALLREDUCE,
                   help="force Open MPI's coll tuned allreduce algorithm and NCCL_ALGO (Ring for "
                   "the rings, else Tree); auto keeps NCCL's tree/NVLS choice at scale")
    t.add_argument("--ucx-net-devices", metavar="DEV:PORT", help="UCX_NET_DEVICES, e.g. "
                   "mlx5_0:1 (see ibv_devinfo), where UCX picks the wrong HCA or port")
    t.add_argument("--nccl-ib-hca", metavar="HCA", help="NCCL_IB_HCA, e.g. mlx5, where NCCL "
                   "picks the wrong HCA")
    t.add_argument("--socket-ifname", metavar="IFACE", help="NCCL_SOCKET_IFNAME and Open MPI's "
                   "btl_tcp_if_include, e.g. ib0 or eth0 (see ip link), where a node has "
                   "interfaces the ranks cannot reach each other on")


def _add_run_settings(r: argparse.ArgumentParser) -> None:
    """Preemption, launcher, training and placement settings, and the output file."""
    from hpclb.schedules import SCHEMES

    r.add_argument("--checkpoint-interval", type=int, default=1800, metavar="SECONDS",
                   help="periodic checkpoints (0: epoch ends and preemption only)")
    r.add_argument("--launcher", default="srun", choices=SLURM_LAUNCHERS,
                   help="SLURM: srun --mpi=pmix, or mpirun over the allocation")
    r.add_argument("--scaling", default="legw", choices=list(SCHEMES))
    r.add_argument("--optimizer")
    r.add_argument("--epochs", type=float)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--backend", choices=JOB_BACKENDS, help="hpclb train --backend (default: "
                   "torch, i.e. NCCL, with GPUs; mpi on CPU-only nodes)")
    r.add_argument("--device", choices=DEVICES, help="hpclb train --device (default: "
                   "cuda with GPUs; none on CPU-only nodes)")
    r.add_argument("--gpu-bind", default="single:1", choices=GPU_BINDS,
                   help="SLURM srun --gpu-bind with GPUs: single:1 = one GPU per rank; none = "
                   "every rank sees the node's GPUs (where cgroups would block NVLink P2P)")
    r.add_argument("-o", "--output", help="write the script here (default: stdout)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing --output file")


def job_spec(args: argparse.Namespace, *, array: bool = False, **settings) -> JobSpec:
    """The :class:`JobSpec` of the options :func:`add_job_size` added, with ``settings``.
    Whole nodes (``--exclusive``) unless ``--shared``, or, for a job ``array`` (a sweep's
    tasks), unless neither was given and a task is one node: a sweep's point on one CPU core or
    one GPU would otherwise hold a whole node."""
    if args.venv and not os.path.isabs(args.venv) and \
            not os.path.isfile(os.path.join(args.venv, "bin", "activate")):
        print(f"hpclb: warning: --venv {args.venv}: the job activates it in the directory it is "
              f"submitted from, and there is no {args.venv}/bin/activate here "
              f"({os.getcwd()}): submit from the directory that holds it, or give --venv "
              f"ABSOLUTE_PATH", file=sys.stderr)
    return JobSpec(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task, time=args.time, partition=args.partition,
        account=args.account, job_name=args.job_name, log=args.log, venv=args.venv or None,
        modules=args.module or [], fabric=args.fabric, allreduce=args.allreduce,
        ucx_net_devices=args.ucx_net_devices, nccl_ib_hca=args.nccl_ib_hca,
        socket_ifname=args.socket_ifname, signal_lead=args.signal_lead,
        exclusive=args.exclusive if args.exclusive is not None else
        args.nodes > 1 or not array, **settings)


def _spec(args: argparse.Namespace) -> JobSpec:
    return job_spec(
        args, experiment=args.experiment, scheduler=args.scheduler,
        per_gpu_batch=args.per_gpu_batch, out=args.out, data_dir=args.data_dir,
        checkpoint_interval=args.checkpoint_interval, launcher=args.launcher,
        scaling=args.scaling, optimizer=args.optimizer, epochs=args.epochs, seed=args.seed,
        backend=args.backend, device=args.device, gpu_bind=args.gpu_bind,
        batch_size=args.batch_size)


def _render(args: argparse.Namespace) -> None:
    """The script on stdout, or written to ``--output`` with a summary line on stderr."""
    from hpclb.tools.jobs import render

    text, plan = render(_spec(args))
    if args.scheduler == "pbs" and not args.data_dir and os.environ.get("HPCLB_DATA"):
        print(f"hpclb jobs render: warning: PBS passes no environment to a job, so $HPCLB_DATA "
              f"({os.environ['HPCLB_DATA']}) does not reach it and it reads ./data in the "
              f"submit directory; give --data-dir to export it in the script", file=sys.stderr)
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return
    from hpclb.config.outputs import check_output_file
    path = check_output_file(args.output, overwrite=args.overwrite, flag="--output")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    print(f"{path}: {args.scheduler}, {args.nodes} node(s), global batch {plan.global_batch}, "
          f"peak LR {plan.peak_lr:.4g}, warmup {plan.warmup_steps} steps "
          f"({plan.warmup_epochs:.4g} epochs)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """``hpclb jobs render|examples``: 0, or 2 for a job that cannot be rendered as asked."""
    from hpclb.tools.jobs import write_examples

    try:
        if args.jobs_command == "render":
            _render(args)
        else:
            for path in write_examples(args.root):
                print(path)
    except (JobError, ConfigError) as e:
        error(str(e))
        return e.exit_code
    return 0
