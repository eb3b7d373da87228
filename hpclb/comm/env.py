"""The launcher's environment, read in one place: who started this process and where it sits.

Launchers tell a process its place through environment variables, each launcher its own:
SLURM ``srun`` (``SLURM_*``), Open MPI ``mpirun`` / PMIx (``OMPI_COMM_WORLD_*``), MPICH and
Intel MPI's Hydra (``PMI_*``, ``MPI_LOCAL*``), MVAPICH (``MV2_*``), torchrun (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``), horovodrun (``HOROVOD_*``). One precedence
rule holds for every question asked here: the variables are read in the order of the tables
below (srun, Open MPI, torchrun, PMI/Hydra, MVAPICH); for the node-local rank every variable
present must agree (nested launchers or a hand-exported stale value are an error, not a
guess), and a ``SLURM_LOCALID`` inherited from an outer ``srun`` step is ignored.

Nothing else in hpclb reads launcher variables; hpclb's own settings (``HPCLB_*``) are read by
the module they configure (listed in docs/cli.md).
"""
from __future__ import annotations

import os

from hpclb.errors import ConfigError

__all__ = ["LOCAL_RANK_VARS", "LOCAL_SIZE_VARS", "WORLD_SIZE_VARS", "env_local_rank",
           "node_split_key", "local_size", "launcher_world_size", "launcher_kind",
           "torchrun_started", "launcher_variables"]

# Launcher variables holding the node-local rank, each with the variable holding the same
# launcher's global rank (used to spot values inherited from an outer launcher).
LOCAL_RANK_VARS = (
    ("SLURM_LOCALID", "SLURM_PROCID"),                 # srun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK"),  # Open MPI mpirun / PMIx
    ("LOCAL_RANK", "RANK"),                             # torchrun
    ("PMI_LOCAL_RANK", "PMI_RANK"),                     # MPICH / Hydra (PMI-2)
    ("MPI_LOCALRANKID", "PMI_RANK"),                    # MPICH / Intel MPI (Hydra)
)
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
# Ranks on this node (srun's SLURM_TASKS_PER_NODE is a per-node list, not read).
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE",
                   "PMI_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
# Ranks in the job, for the MPI launchers (srun's step size is read only inside a step).
WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS_WORLD")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The job's and the launcher's variables `hpclb doctor` shows: the ones above, and the
# scheduler's job (SLURM, PBS) and horovodrun's place.
_SHOWN_VARS = tuple(dict.fromkeys((
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_PROCID",
    "PBS_JOBID", "PBS_NODEFILE", *(rank for _, rank in LOCAL_RANK_VARS), *WORLD_SIZE_VARS,
    *(local for local, _ in LOCAL_RANK_VARS), *LOCAL_SIZE_VARS, *TORCHRUN_VARS,
    "HOROVOD_RANK", "HOROVOD_SIZE")))


def _int_env(var: str) -> int:
    raw = os.environ[var]
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not an integer; the launcher sets it to this "
                          f"process's node-local rank (unset it if you set it by hand)") from None
    if value < 0:
        raise ConfigError(f"{var}={value} is negative; it must be a node-local rank >= 0")
    return value


def _inherited_slurm(found: dict[str, int]) -> bool:
    """True when SLURM_LOCALID belongs to an outer ``srun`` step (mpirun inside an allocation
    starts its ranks from daemons that srun launched, one per node: every rank inherits the
    daemon's SLURM_LOCALID 0), seen as SLURM_PROCID differing from the MPI launcher's rank."""
    if "SLURM_LOCALID" not in found or os.environ.get("SLURM_PROCID") is None:
        return False
    return any(os.environ.get(v) is not None and os.environ[v] != os.environ["SLURM_PROCID"]
               for v in _MPI_RANK_VARS)


def env_local_rank() -> int | None:
    """This process's node-local rank as its launcher set it, or None without a launcher.

    Read from ``SLURM_LOCALID`` (srun), ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI),
    ``LOCAL_RANK`` (torchrun), ``PMI_LOCAL_RANK`` / ``MPI_LOCALRANKID`` (MPICH/Hydra). A
    ``SLURM_LOCALID`` inherited from an outer srun step (mpirun inside ``sbatch``: its
    ``SLURM_PROCID`` differs from the MPI rank) is ignored.

    Raises ConfigError when a variable is not a non-negative integer, or when several are set
    and disagree (the message names each variable and value).
    """
    found = {var: _int_env(var) for var, _ in LOCAL_RANK_VARS if os.environ.get(var)}
    if _inherited_slurm(found):
        del found["SLURM_LOCALID"]
    values = set(found.values())
    if len(values) > 1:
        names = ", ".join(f"{k}={v}" for k, v in found.items())
        raise ConfigError(
            f"the launcher variables disagree about this process's node-local rank ({names}); "
            f"two launchers are nested or a variable was exported by hand: unset the stale "
            f"one(s) and launch with one launcher (mpirun, srun or torchrun)")
    return values.pop() if values else None


def node_split_key(rank: int) -> int:
    """The key that orders a node's ranks in MPI's shared-memory split: the launcher's
    node-local rank where it set one, so the split numbers the ranks as the launcher did (Open
    MPI oversubscribing a node numbers them 0, 2, 1, 3 by world rank), else the world rank
    (also when the launcher's variables disagree: that is reported after the split, on every
    rank, by ``hpclb.comm.world``; raising here would leave the other ranks in the split)."""
    try:
        env = env_local_rank()
    except ConfigError:
        return rank
    return rank if env is None else env


def local_size() -> int:
    """Ranks sharing this node, from the launcher's environment (:data:`LOCAL_SIZE_VARS`, the
    first positive integer); 1 when none says."""
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def launcher_world_size() -> int | None:
    """The number of ranks the launcher says it started (Open MPI, MPICH/Hydra, SLURM srun), or
    None when this process was not started by an MPI launcher."""
    for var in WORLD_SIZE_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    if os.environ.get("SLURM_STEP_ID") is not None and os.environ.get("SLURM_STEP_NUM_TASKS"):
        return int(os.environ["SLURM_STEP_NUM_TASKS"])
    return None


def torchrun_started() -> bool:
    """True when torchrun (or ``torch.distributed.launch``) set the rendezvous variables
    (:data:`TORCHRUN_VARS`)."""
    return all(os.environ.get(v) for v in TORCHRUN_VARS)


def launcher_kind() -> str | None:
    """Which launcher started this process: ``"horovod"`` (horovodrun's Gloo mode sets
    ``HOROVOD_RANK``), ``"torch"`` (torchrun / torch.distributed.launch), ``"mpi"`` (mpirun,
    srun, Hydra), or None (plain ``python``)."""
    if os.environ.get("HOROVOD_RANK") is not None and os.environ.get("HOROVOD_SIZE"):
        return "horovod"
    if os.environ.get("TORCHELASTIC_RUN_ID") or (
            launcher_world_size() is None
            and all(os.environ.get(v) for v in TORCHRUN_VARS[:3])):
        return "torch"
    if launcher_world_size() is not None:
        return "mpi"
    return None


def launcher_variables() -> dict[str, str]:
    """The scheduler's and launcher's variables set in this process (SLURM, PBS, Open MPI,
    MPICH/Hydra, MVAPICH, torchrun, horovodrun), name -> value, in a fixed order."""
    return {v: os.environ[v] for v in _SHOWN_VARS if os.environ.get(v) is not None}
