"""``hpclb doctor``: is this node (or, under mpirun/srun, this job) ready? One line per item
(Python, torch, GPUs, NCCL, MPI, Horovod, CuPy and the fused kernel, the JPEG decoder, the data
sets, the launcher, the GPU each rank takes), then what blocks a job and how to fix it. The
checks are :mod:`hpclb.tools.doctor`'s; docs/clusters.md, "Is this node ready?"."""
from __future__ import annotations

import argparse
import json

from hpclb.errors import EXIT_FAILURE

__all__ = ["HELP", "add_parser", "run"]

HELP = ("is this node (or, under mpirun/srun, this job) ready? Python, torch, GPUs, NCCL, MPI, "
        "Horovod, CuPy, JPEG decoder, data sets, launcher and the GPU of each rank; exit 1 "
        "naming what blocks a job and the fix")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb doctor`` on the top-level subparsers."""
    p = subparsers.add_parser("doctor", help=HELP, description=HELP)
    p.add_argument("--gpu", action="store_true",
                   help="expect GPUs: a CPU-only torch or no visible GPU then blocks (exit 1)")
    p.add_argument("--share-gpu", action="store_true",
                   help="ranks of a node may share GPUs (as hpclb train --share-gpu); without "
                        "it more ranks than GPUs on a node blocks")
    p.add_argument("--data-dir", default=None,
                   help="where the data sets are (default $HPCLB_DATA, else ./data); each one "
                        "staged by hpclb data fetch is verified again")
    p.add_argument("--json", action="store_true",
                   help="print every rank's report and the verdict as one JSON object")
    p.set_defaults(func=run)
    return p


def _communicator():
    """The job's communicator (mpi under mpirun/srun, torch under torchrun, else one process),
    on the CPU so that a device problem is reported rather than raised; where it cannot start,
    this process alone and why."""
    from hpclb.comm.world import get_communicator

    try:
        return get_communicator("auto", device="cpu"), None
    except (RuntimeError, ValueError) as e:
        from hpclb.comm.local import SelfCommunicator

        return SelfCommunicator(), str(e)


def run(args: argparse.Namespace) -> int:
    """``hpclb doctor``: every rank checks itself, rank 0 prints; 0 when nothing blocks a job,
    1 (every rank) naming each blocker and its fix."""
    from hpclb.cli.common import setup_logging
    from hpclb.tools.doctor import format_report, rank_report, verdict

    comm, problem = _communicator()
    setup_logging(comm.rank)
    mine = rank_report(comm, gpu=args.gpu, share_gpu=args.share_gpu, data_dir=args.data_dir,
                       problem=problem)
    reports = comm.allgather_object(mine)
    v = verdict(reports)
    if comm.rank == 0:
        print(json.dumps({**v, "ranks": reports}, indent=1) if args.json
              else format_report(reports, v), flush=True)
    return 0 if v["ready"] else EXIT_FAILURE
