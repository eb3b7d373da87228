"""What ``hpclb jobs render`` is asked for: the choices it offers, :class:`JobSpec`, time limits,
and the checks of a request (:func:`validate`), each failing with a :class:`JobError` whose
message says what to change.

Standard library only (and :mod:`hpclb.errors`), so that the command line builds its parser,
and ``hpclb jobs render --help`` prints, without loading torch; the plan and the rendering are
in :mod:`hpclb.tools.jobs`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from hpclb.errors import JobError

__all__ = ["SCHEDULERS", "FABRICS", "ALLREDUCE", "SLURM_LAUNCHERS", "JOB_BACKENDS", "GPU_BINDS",
           "DEVICES", "JobSpec", "parse_time", "format_time", "check_path", "check_one_line",
           "validate"]

SCHEDULERS = ("slurm", "pbs")
FABRICS = ("auto", "ib", "tcp", "local")
ALLREDUCE = ("ring", "segmented_ring", "recursive_doubling", "rabenseifner", "auto")
SLURM_LAUNCHERS = ("srun", "mpirun")
JOB_BACKENDS = ("mpi", "torch", "horovod")
# srun --gpu-bind values the templates offer: single:1 = one GPU per task, the closest to its
# cores; closest = every GPU near the task's cores; none = every rank sees the node's GPUs.
GPU_BINDS = ("single:1", "closest", "none")
DEVICES = ("cuda", "cpu")  # hpclb train --device in a job

# what may go unquoted into a script line: no spaces, quotes, shell operators, expansions ($,
# backticks) or glob/brace characters
_PATH_OK = re.compile(r"^[^\s'\";&|<>`\\$()*?\[\]{}]+$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)$")


@dataclass
class JobSpec:
    """Everything ``hpclb jobs render`` takes; see :func:`hpclb.tools.jobs.render` and the CLI
    help."""

    experiment: str
    scheduler: str
    nodes: int
    gpus_per_node: int
    per_gpu_batch: int | None = None
    tasks_per_node: int | None = None       # default: gpus_per_node (one rank per GPU), or 1
    cpus_per_task: int | None = None        # default: 8 with GPUs, 1 without
    time: str = "04:00:00"
    partition: str | None = None            # SLURM partition / PBS queue
    account: str | None = None
    job_name: str | None = None
    out: str | None = None                  # run directory (relative to the submit directory)
    log: str | None = None                  # scheduler's stdout+stderr (its directory must exist)
    data_dir: str | None = None
    venv: str | None = ".venv"
    modules: list[str] = field(default_factory=list)
    fabric: str = "auto"                    # auto: the site's MPI and NCCL choose
    allreduce: str = "auto"                 # auto: the libraries choose
    ucx_net_devices: str | None = None
    nccl_ib_hca: str | None = None
    socket_ifname: str | None = None
    signal_lead: int = 300                  # seconds before the limit the USR2 comes
    checkpoint_interval: int = 1800         # seconds between periodic checkpoints (0: epochs)
    launcher: str = "srun"                  # SLURM: srun --mpi=pmix, or the MPI's mpirun
    scaling: str = "legw"
    optimizer: str | None = None
    epochs: float | None = None
    seed: int = 0
    exclusive: bool = True
    backend: str | None = None              # default: torch (NCCL) with GPUs, mpi without
    device: str | None = None               # hpclb train --device; default cuda with GPUs
    gpu_bind: str = "single:1"              # SLURM srun --gpu-bind with GPUs (GPU_BINDS)
    batch_size: int | None = None           # the global batch; default the recipe's B0


def parse_time(text: str) -> int:
    """``[D-]HH:MM:SS`` (SLURM and PBS both accept it) to seconds; JobError otherwise."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise JobError(f"--time {text!r}: write the time limit as HH:MM:SS or D-HH:MM:SS "
                       f"(e.g. 04:00:00)")
    d, h, mi, s = (int(g or 0) for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def format_time(seconds: int, scheduler: str) -> str:
    """Seconds as the scheduler's time limit: SLURM ``D-HH:MM:SS`` / PBS ``HHH:MM:SS``."""
    h, rem = divmod(int(seconds), 3600)
    m, s = divmod(rem, 60)
    if scheduler == "slurm" and h >= 24:
        return f"{h // 24}-{h % 24:02d}:{m:02d}:{s:02d}"
    return f"{h:02d}:{m:02d}:{s:02d}"


def check_path(what: str, value: str | None) -> None:
    """JobError unless ``value`` (None passes) can go unquoted into a directive line."""
    if value is not None and not _PATH_OK.match(value):
        raise JobError(f"{what} {value!r}: no spaces, quotes, shell operators, $ expansions or "
                       f"glob characters (it goes unquoted into #SBATCH/#PBS and script lines); "
                       f"give the path or name itself")


def check_one_line(what: str, value: str) -> None:
    """JobError unless ``value`` is printable text: a line break (or another control character)
    in a value the script shows in a comment or a quoted word would end the line there, and the
    rest would run as a command."""
    if not value.isprintable():
        raise JobError(f"{what} {value!r}: holds a line break or control character, which a job "
                       f"script cannot take (the rest of the line would run as a command); "
                       f"remove it")


def _flag(field_name: str) -> str:
    return {"experiment": "EXPERIMENT", "modules": "--module"}.get(
        field_name, "--" + field_name.replace("_", "-"))


def _check_ranks(spec: JobSpec) -> None:
    """Nodes, GPUs, tasks, CPUs and the per-GPU batch."""
    if not isinstance(spec.nodes, int) or spec.nodes < 1:
        raise JobError(f"--nodes {spec.nodes}: a job needs at least 1 node")
    if spec.gpus_per_node < 0:
        raise JobError(f"--gpus-per-node {spec.gpus_per_node}: must be >= 0 (0 = CPU-only "
                       f"nodes, then give --tasks-per-node)")
    if spec.tasks_per_node is not None and spec.tasks_per_node < 1:
        raise JobError(f"--tasks-per-node {spec.tasks_per_node}: must be >= 1")
    if spec.gpus_per_node and spec.tasks_per_node not in (None, spec.gpus_per_node):
        raise JobError(f"--tasks-per-node {spec.tasks_per_node} with --gpus-per-node "
                       f"{spec.gpus_per_node}: hpclb runs one rank per GPU; drop --tasks-per-node")
    if spec.per_gpu_batch is not None and spec.per_gpu_batch < 1:
        raise JobError(f"--per-gpu-batch {spec.per_gpu_batch}: must be >= 1")
    if spec.batch_size is not None and (isinstance(spec.batch_size, bool) or
                                        not isinstance(spec.batch_size, int) or
                                        spec.batch_size < 1):
        raise JobError(f"--batch-size {spec.batch_size!r}: the global batch must be an integer "
                       f">= 1 (samples per step over all ranks)")
    if spec.batch_size is not None and spec.per_gpu_batch is not None:
        raise JobError(f"--batch-size {spec.batch_size} and --per-gpu-batch "
                       f"{spec.per_gpu_batch}: give one; --batch-size (the global batch) keeps "
                       f"the LR and warmup the same at any node count")
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise JobError(f"--cpus-per-task {spec.cpus_per_task}: must be >= 1")


def _check_choices(spec: JobSpec) -> None:
    """Fabric, allreduce, backend, device, GPU binding and SLURM launcher."""
    if spec.fabric not in FABRICS:
        raise JobError(f"--fabric {spec.fabric!r}: choose one of {FABRICS}")
    if spec.allreduce not in ALLREDUCE:
        raise JobError(f"--allreduce {spec.allreduce!r}: choose one of {ALLREDUCE}")
    if spec.backend is not None and spec.backend not in JOB_BACKENDS:
        raise JobError(f"--backend {spec.backend!r}: choose one of {JOB_BACKENDS}")
    if spec.device not in (None, *DEVICES):
        raise JobError(f"--device {spec.device!r}: choose cuda or cpu")
    if spec.device == "cuda" and not spec.gpus_per_node:
        raise JobError("--device cuda with --gpus-per-node 0: ask for GPUs (--gpus-per-node G, "
                       "one rank per GPU) or drop --device")
    if spec.gpu_bind not in GPU_BINDS:
        raise JobError(f"--gpu-bind {spec.gpu_bind!r}: choose one of {GPU_BINDS}")
    if spec.scheduler == "slurm" and spec.launcher not in SLURM_LAUNCHERS:
        raise JobError(f"--launcher {spec.launcher!r}: choose one of {SLURM_LAUNCHERS}")


def _check_times(spec: JobSpec) -> None:
    """The time limit against the preemption lead time and the checkpoint interval."""
    limit = parse_time(spec.time)
    if limit <= 0:
        raise JobError(f"--time {spec.time}: the time limit must be > 0")
    if spec.signal_lead < 30:
        raise JobError(f"--signal-lead {spec.signal_lead}: give the ranks at least 30 s between "
                       f"the USR2 and the time limit to finish a step and write the checkpoint")
    if spec.signal_lead >= limit:
        raise JobError(f"--time {spec.time} ({limit} s) is not longer than --signal-lead "
                       f"{spec.signal_lead} s: the job would be told to checkpoint before it "
                       f"starts; give a longer --time or a shorter --signal-lead")
    if spec.checkpoint_interval < 0:
        raise JobError(f"--checkpoint-interval {spec.checkpoint_interval}: must be >= 0 "
                       f"(0 = only at epoch ends and on preemption)")
    if spec.checkpoint_interval and spec.checkpoint_interval >= limit - spec.signal_lead:
        raise JobError(f"--time {spec.time} ({limit} s) leaves {limit - spec.signal_lead} s "
                       f"before the preemption signal, not more than --checkpoint-interval "
                       f"{spec.checkpoint_interval} s: no periodic checkpoint would ever be "
                       f"written; give a longer --time or a shorter --checkpoint-interval")


def validate(spec: JobSpec) -> None:
    """JobError, naming the flag and the fix, for anything in ``spec`` a job cannot run with
    (checked in this order: line breaks, scheduler, ranks, choices, times, then the values that
    go unquoted into the script: paths, names, interfaces; the others are quoted or checked
    against their choices)."""
    for f in fields(spec):  # every text the script may show, quoted or not: one line
        value = getattr(spec, f.name)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                check_one_line(_flag(f.name), v)
    if spec.scheduler not in SCHEDULERS:
        raise JobError(f"--scheduler {spec.scheduler!r}: choose one of {SCHEDULERS}")
    _check_ranks(spec)
    _check_choices(spec)
    _check_times(spec)
    # what goes unquoted into directives, `export` and other script lines
    for what, value in (("--out", spec.out), ("--log", spec.log), ("--data-dir", spec.data_dir),
                        ("--venv", spec.venv), ("--partition", spec.partition),
                        ("--account", spec.account), ("--job-name", spec.job_name),
                        ("--ucx-net-devices", spec.ucx_net_devices),
                        ("--nccl-ib-hca", spec.nccl_ib_hca),
                        ("--socket-ifname", spec.socket_ifname),
                        *(("--module", m) for m in spec.modules)):
        check_path(what, value)
