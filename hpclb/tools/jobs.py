"""Job scripts for SLURM (sbatch) and PBS Pro from ``jobs/templates`` (Jinja2).

``hpclb jobs render EXPERIMENT --scheduler slurm|pbs --nodes N --gpus-per-node G ...`` turns a
recipe into a batch script: ``N`` nodes × ``G`` ranks (one rank per GPU; ``--tasks-per-node`` for
CPU-only nodes), the global batch ``--batch-size B`` (default the recipe's ``B0``; each rank takes
``B / (N·G)`` samples, a JobError when it does not divide; ``--per-gpu-batch b`` instead asks
for ``B = N·G·b``, which changes with the node count), and the LEGW plan for that
batch (peak LR ``η0·√k``, warmup ``W0·k`` epochs = the same number of steps at every ``k``)
computed by :mod:`hpclb.schedules` exactly as ``hpclb train --batch-size B --scaling legw`` will.
The rendered ``hpclb train`` line passes only the global batch and the scheme; the derived LR
and warmup are printed in the script's header for the reader.

Every bad request is a :class:`JobError` whose message says what to change (zero nodes, a global
batch larger than the training set, a time limit shorter than the checkpoint interval or the
preemption lead time, a warmup longer than training, ...).

Training-set sizes: the loaders need the data on disk to count it, but a job is rendered on a
login node that may not hold it, so the data-set registry
(:func:`hpclb.data.registry.train_set_sizes`) keeps the published sizes (a recipe's
``data.train_samples`` subset wins when it is smaller).

The request itself (:class:`JobSpec`, the choices, time limits, the checks) is in
:mod:`hpclb.tools.jobs_spec`, which the command line imports without torch; reading rendered
scripts back (for the tests) is in :mod:`hpclb.tools.jobs_testing`.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hpclb import __version__, schedules
from hpclb.config import available_experiments, load_recipe
from hpclb.data.registry import check_subset, train_set_sizes
from hpclb.errors import PREEMPTED_EXIT_CODE, ConfigError, JobError
from hpclb.extras import require
from hpclb.plugins import add_search_path, is_plugin
from hpclb.tasks import load_plugin_data
from hpclb.tools.jobs_spec import (
    SCHEDULERS,
    JobSpec,
    check_one_line,
    check_path,
    format_time,
    parse_time,
    validate,
)

# JobSpec (hpclb.tools.jobs_spec, torch-free for the command line) is what render takes.
__all__ = ["ArrayJob", "BLOCK_SIGNALS", "TOKEN_UNITS", "SEQ_LEN_KEYS", "EXAMPLE_NODES", "EXAMPLES",
           "FABRIC_ENV", "JobSpec", "Plan", "train_set_size", "default_backend", "plan_for",
           "interconnect", "render", "template_engine", "example_specs", "write_examples"]

# Each rank starts with the preemption signals blocked until hpclb has its handler in place
# (hpclb.cli unblocks them); GNU coreutils >= 8.31 (Debian 11+, RHEL 9+).
BLOCK_SIGNALS = "env --block-signal=USR2 --block-signal=TERM"

# Training-set sizes, in the unit the loader counts one sample in (the denominator of an epoch),
# come from the data-set registry (hpclb.data.registry). Word-level LMs count tokens; their
# loaders cut the token stream into sequences of `seq_len` tokens, so one sample is one sequence
# (see :func:`train_set_size`).
TOKEN_UNITS = ("tokens",)
SEQ_LEN_KEYS = ("seq_len", "bptt", "num_steps", "sequence_length")


def train_set_size(recipe: dict[str, Any]) -> tuple[int, str]:
    """(number of training samples, unit) for a recipe, from the data-set registry
    (:func:`hpclb.data.registry.train_set_sizes`).

    Token-counted sets are turned into sequences of the recipe's ``data.seq_len`` (or ``bptt``,
    ``num_steps``; also looked up under ``model``). ``data.train_samples`` (a smoke-run subset)
    wins when smaller. JobError for a data set the table does not know.
    """
    data = recipe.get("data") or {}
    name = data.get("name")
    if is_plugin(name):
        return _plugin_train_set_size(recipe, data)
    sizes = train_set_sizes()
    if name not in sizes:
        raise JobError(f"data set {name!r} of recipe {recipe.get('name')!r} has no training-set "
                       f"size in the data-set registry ({', '.join(sizes)}); register it with "
                       f"hpclb.data.registry.register_dataset(..., train_size=, unit=)")
    size, unit, _ = sizes[name]
    if unit in TOKEN_UNITS:
        model = recipe.get("model") or {}
        seq = next((src[k] for src in (data, model) for k in SEQ_LEN_KEYS if k in src), None)
        if not isinstance(seq, int) or seq <= 0:
            raise JobError(f"recipe {recipe.get('name')!r}: {name} is counted in tokens; give "
                           f"data.seq_len (tokens per sequence) so a sample can be counted")
        size, unit = (size - 1) // seq, f"sequences of {seq} tokens"
    subset = data.get("train_samples")
    check_subset("data.train_samples", subset, size, f"{name}'s training split", unit)
    if isinstance(subset, int) and 0 < subset < size:
        size = subset
    return size, unit


def _plugin_train_set_size(recipe: dict[str, Any], data: dict[str, Any]) -> tuple[int, str]:
    """A plug-in data set (``module:function``): ``data.train_samples`` when given, else the
    length of the training split the function returns here ($HPCLB_DATA or ./data)."""
    subset = data.get("train_samples")
    if isinstance(subset, int) and subset > 0:
        return subset, "samples"
    add_search_path(recipe.get("plugin_path", []))
    try:
        return len(load_plugin_data(data, None)[0]), "samples"
    except Exception as e:  # noqa: BLE001 (any failure of the user's loader)
        raise JobError(f"recipe {recipe.get('name')!r}: cannot count the training samples of "
                       f"plug-in data {data.get('name')!r} here ({e}); give data.train_samples "
                       f"in the recipe, or stage the data under $HPCLB_DATA") from e


def _g(x: float) -> str:
    return f"{x:.4g}"


@dataclass(frozen=True)
class Plan:
    """The LEGW (or other scheme's) numbers of one job; all batches in samples."""

    global_batch: int
    per_rank_batch: int
    base_batch: int
    k: float
    base_lr: float
    peak_lr: float
    base_warmup_epochs: float
    warmup_epochs: float
    warmup_steps: int
    steps_per_epoch: int
    total_steps: int
    epochs: float
    num_samples: int
    sample_unit: str
    data_name: str
    lr_rule: str
    warmup_rule: str

    # Strings for the template's header.
    k_str = property(lambda s: _g(s.k))
    base_lr_str = property(lambda s: _g(s.base_lr))
    peak_lr_str = property(lambda s: _g(s.peak_lr))
    base_warmup_epochs_str = property(lambda s: _g(s.base_warmup_epochs))
    warmup_epochs_str = property(lambda s: _g(s.warmup_epochs))
    epochs_str = property(lambda s: _g(s.epochs))


def default_backend(gpus_per_node: int) -> str:
    """The communication backend a job should use: ``torch`` on GPUs (NCCL moves the CUDA
    gradient buckets GPU to GPU over NVLink and GPUDirect RDMA, with no CUDA-aware MPI build
    needed; the ``mpi`` backend stages every bucket through pinned host memory unless mpi4py
    sits on a CUDA-aware MPI), ``mpi`` on CPU-only nodes."""
    return "torch" if gpus_per_node else "mpi"


def plan_for(recipe: dict[str, Any], global_batch: int, per_rank_batch: int, scaling: str,
             epochs: float | None = None, optimizer: str | None = None) -> Plan:
    """The schedule ``hpclb train`` will derive for this recipe at ``global_batch``."""
    n, unit = train_set_size(recipe)
    if global_batch > n:
        raise JobError(f"the global batch {global_batch} is larger than the training set "
                       f"({n} {unit} of {recipe['data']['name']}): give a smaller --batch-size "
                       f"(at most {n}), or with --per-gpu-batch at most "
                       f"{n // max(1, global_batch // per_rank_batch)} per rank at this size")
    opt = optimizer or recipe["optimizer"]
    if opt not in recipe.get("optimizers", {}):
        raise JobError(f"--optimizer {opt}: the recipe {recipe['name']} has no tuned "
                       f"hyper-parameters for it; choose one of {sorted(recipe['optimizers'])}")
    if scaling not in schedules.SCHEMES:
        raise JobError(f"--scaling {scaling!r} is not one of {tuple(schedules.SCHEMES)}")
    base_lr = float(recipe["optimizers"][opt]["lr"])
    b0 = int(recipe["base_batch_size"])
    w0 = float(recipe["warmup_epochs"])
    n_epochs = float(recipe["epochs"] if epochs is None else epochs)
    decay = dict(recipe["decay"])
    try:
        s = schedules.Schedule.from_recipe(
            base_lr=base_lr, base_batch_size=b0, base_warmup_epochs=w0,
            global_batch_size=global_batch, num_samples=n, epochs=n_epochs, scheme=scaling,
            decay=decay.pop("name"), decay_params=decay)
    except ValueError as e:
        raise JobError(f"{recipe['name']} at global batch {global_batch} ({scaling}): {e}") from e
    lr_rule, warmup_rule = schedules.SCHEMES[scaling]
    return Plan(global_batch=global_batch, per_rank_batch=per_rank_batch, base_batch=b0,
                k=global_batch / b0, base_lr=base_lr, peak_lr=s.peak_lr, base_warmup_epochs=w0,
                warmup_epochs=schedules.scale_warmup_epochs(w0, b0, global_batch, warmup_rule),
                warmup_steps=s.warmup_steps, steps_per_epoch=s.steps_per_epoch,
                total_steps=s.total_steps, epochs=n_epochs, num_samples=n, sample_unit=unit,
                data_name=recipe["data"]["name"],
                lr_rule={"sqrt": "eta0*sqrt(k)", "linear": "eta0*k", "none": "eta0"}[lr_rule],
                warmup_rule={"legw": "W0*k epochs", "goyal": "5 epochs from eta0",
                             "fixed": "W0 epochs", "none": "no warmup"}[warmup_rule])


# What --fabric exports (auto: nothing, the site's MPI and NCCL choose): Open MPI's pml and
# btl, and whether NCCL may use InfiniBand. ib: UCX over the HCA, no TCP fallback; tcp: ob1 over
# Ethernet; local: emulated nodes on one host (the test cluster), over loopback.
FABRIC_ENV = {
    "auto": [],
    "ib": [("OMPI_MCA_pml", "ucx"), ("OMPI_MCA_btl", "^tcp,openib,uct"), ("NCCL_IB_DISABLE", "0")],
    "tcp": [("OMPI_MCA_pml", "ob1"), ("OMPI_MCA_btl", "self,sm,tcp"), ("NCCL_IB_DISABLE", "1")],
    "local": [("OMPI_MCA_pml", "ob1"), ("OMPI_MCA_btl", "self,tcp"), ("NCCL_IB_DISABLE", "1")],
}


def interconnect(spec: JobSpec) -> list[tuple[str, str]]:
    """Environment for the fabric and the allreduce algorithm, in the order it is exported: only
    what was asked for (the defaults, ``--fabric auto --allreduce auto``, export nothing).

    ``--fabric``: :data:`FABRIC_ENV`. ``--socket-ifname I`` (``lo`` with ``local``): NCCL's
    sockets and Open MPI's tcp btl on ``I``. ``--ucx-net-devices``, ``--nccl-ib-hca``: as given.
    ``--allreduce A``: Open MPI's tuned component fixed to ``A`` (dynamic rules on) and NCCL's
    matching ``NCCL_ALGO`` (Ring, else Tree).
    """
    env = list(FABRIC_ENV[spec.fabric])
    ifname = spec.socket_ifname or ("lo" if spec.fabric == "local" else None)
    if ifname:
        env += [("OMPI_MCA_btl_tcp_if_include", ifname), ("NCCL_SOCKET_IFNAME", ifname)]
    if spec.ucx_net_devices:
        env.append(("UCX_NET_DEVICES", spec.ucx_net_devices))
    if spec.nccl_ib_hca:
        env.append(("NCCL_IB_HCA", spec.nccl_ib_hca))
    if spec.allreduce != "auto":
        env += [("OMPI_MCA_coll_tuned_use_dynamic_rules", "1"),
                ("OMPI_MCA_coll_tuned_allreduce_algorithm", spec.allreduce),
                ("NCCL_ALGO", "Ring" if "ring" in spec.allreduce else "Tree")]
    return env


def _templates_dir() -> Path:
    """jobs/templates of the checkout, else the copy packaged as hpclb/job_templates."""
    repo = Path(__file__).resolve().parents[2] / "jobs" / "templates"
    if repo.is_dir():
        return repo
    return Path(str(resources.files("hpclb") / "job_templates"))


def _render_args(spec: JobSpec) -> str:
    args = [spec.experiment, "--scheduler", spec.scheduler, "--nodes", str(spec.nodes),
            "--gpus-per-node", str(spec.gpus_per_node)]
    defaults = JobSpec(spec.experiment, spec.scheduler, spec.nodes, spec.gpus_per_node)
    for name in ("batch_size", "per_gpu_batch", "tasks_per_node", "cpus_per_task", "time",
                 "partition", "account", "job_name", "out", "log", "data_dir", "venv", "fabric",
                 "allreduce", "ucx_net_devices", "nccl_ib_hca", "socket_ifname", "signal_lead",
                 "checkpoint_interval", "launcher", "scaling", "optimizer", "epochs", "seed",
                 "backend", "device", "gpu_bind"):
        v = getattr(spec, name)
        if v != getattr(defaults, name) and v is not None:
            args += [f"--{name.replace('_', '-')}", str(v)]
    for m in spec.modules:
        args += ["--module", m]
    if not spec.exclusive:
        args.append("--shared")
    return " ".join(shlex.quote(a) for a in args)


def _train_argv(spec: JobSpec, plan: Plan, ranks: int, backend: str) -> str:
    """The ``hpclb train`` line every rank runs."""
    train = ["hpclb", "train", shlex.quote(spec.experiment), "--batch-size",
             str(plan.global_batch), "--scaling", spec.scaling, "--expect-world-size", str(ranks),
             "--backend", backend,
             "--out", '"$OUT"', "--seed", str(spec.seed)]
    device = spec.device or ("cuda" if spec.gpus_per_node else None)
    if device:  # CPU-only jobs keep the command they always had
        train += ["--device", device]
    if spec.optimizer:
        train += ["--optimizer", shlex.quote(spec.optimizer)]
    if spec.epochs is not None:
        train += ["--epochs", f"{spec.epochs:g}"]
    if spec.data_dir:
        train += ["--data-dir", '"$HPCLB_DATA"']
    if spec.checkpoint_interval:
        train += ["--checkpoint-interval", str(spec.checkpoint_interval)]
    return " ".join(train)


def _launch(spec: JobSpec, ranks: int, tasks: int, cpus: int,
            env: list[tuple[str, str]]) -> str:
    """The launcher that starts the ranks: srun or mpirun (SLURM), mpiexec (PBS)."""
    if spec.scheduler == "slurm":
        if spec.launcher == "srun":
            launch = (f"srun --mpi=pmix --kill-on-bad-exit=0 --ntasks={ranks} "
                      f"--ntasks-per-node={tasks} --cpus-per-task={cpus}")
            if spec.gpus_per_node:
                launch += f" --gpus-per-task=1 --gpu-bind={spec.gpu_bind}"
            return launch
        return (f"env --block-signal=TERM mpirun -n {ranks} --map-by ppr:{tasks}:node "
                f"--bind-to none")
    forward = ["OMP_NUM_THREADS", "PATH", "VIRTUAL_ENV"]
    forward += (["LD_LIBRARY_PATH"] if spec.modules else [])
    forward += (["HPCLB_DATA"] if spec.data_dir else [])
    forward += [k for k, _ in env if not k.startswith("OMPI_MCA_")]
    return (f'env --block-signal=TERM mpiexec -n {ranks} --host "$HOSTS" '
            f'--map-by ppr:{tasks}:node --bind-to none '
            + " ".join(f"-x {k}" for k in forward))


def _recipe(spec: JobSpec) -> dict[str, Any]:
    """The recipe of ``spec`` (JobError for one that does not load)."""
    try:
        return load_recipe(spec.experiment, epochs=spec.epochs)
    except ConfigError as e:
        raise JobError(str(e)) from e


def _plan(spec: JobSpec) -> tuple[dict[str, Any], Plan, int]:
    """(recipe, plan, ranks per node) of a validated ``spec``."""
    recipe = _recipe(spec)
    tasks = spec.tasks_per_node or spec.gpus_per_node or 1
    ranks = spec.nodes * tasks
    per_gpu = spec.per_gpu_batch or recipe.get("per_gpu_batch")
    batch = spec.batch_size or (ranks * int(per_gpu) if per_gpu else
                                int(recipe["base_batch_size"]))
    _check_divides(spec, batch, ranks, given=bool(spec.batch_size or per_gpu))
    plan = plan_for(recipe, batch, batch // ranks, spec.scaling, spec.epochs, spec.optimizer)
    return recipe, plan, tasks


def _check_divides(spec: JobSpec, batch: int, ranks: int, given: bool) -> None:
    """JobError when the global ``batch`` does not split evenly over the job's ``ranks``."""
    if batch % ranks == 0:
        return
    what = (f"--batch-size {batch}" if given else
            f"the recipe's base batch B0 = {batch} (the default global batch)")
    per = "--gpus-per-node" if spec.gpus_per_node else "--tasks-per-node"
    lower, upper = batch // ranks * ranks, (batch // ranks + 1) * ranks
    fits = [n for n in range(1, spec.nodes * 2 + 1) if batch % (n * (ranks // spec.nodes)) == 0]
    raise JobError(f"{what} does not divide evenly over --nodes {spec.nodes} x {per} "
                   f"{ranks // spec.nodes} = {ranks} ranks (each rank takes batch / ranks "
                   f"samples); give a --batch-size that is a multiple of {ranks} "
                   f"({', '.join(str(b) for b in (lower, upper) if b > 0)}) or a node count "
                   f"that divides it ({', '.join(map(str, fits[-3:])) or 'none'})")


def template_engine():
    """jinja2, which renders the job templates; MissingExtraError naming ``pip install
    'hpclb[experiments]'`` without it (callers that write other files first call this before
    them)."""
    return require("jinja2", "rendering job templates")


@dataclass(frozen=True)
class ArrayJob:
    """A job array in place of one training run (``hpclb sweep --submit``): ``indices`` the
    scheduler's task range (``0-N``; empty: one plain job), ``command`` each task's command
    line, already quoted (it reads its point from ``$TASKS``), ``points`` the header's lines
    (``I: point -> run directory``), ``rendered_by`` the command that rendered it, ``tasks``
    the point of each task (``$TASKS``: task t runs point ``tasks[t]``)."""

    indices: str
    command: str
    points: tuple[str, ...]
    rendered_by: str
    tasks: tuple[int, ...]


def render(spec: JobSpec, array: ArrayJob | None = None) -> tuple[str, Plan | None]:
    """(script text, plan) for ``spec``; JobError with the fix for anything invalid,
    MissingExtraError without jinja2. With ``array``: a job array whose every task runs
    ``array.command`` in the batch shell (no plan: the points have their own batches)."""
    jinja2 = template_engine()

    validate(spec)
    if array is None:
        recipe, plan, tasks = _plan(spec)
    else:
        recipe, plan, tasks = _recipe(spec), None, spec.tasks_per_node or spec.gpus_per_node or 1
    check_one_line("the recipe's name", recipe["name"])  # shown in the header's comments
    if plan is not None:
        check_one_line("the recipe's data.name", plan.data_name)
    context = _context(spec, recipe, plan, tasks, array)
    tmpl_name = "slurm.sbatch.j2" if spec.scheduler == "slurm" else "pbs.pbs.j2"
    loader = jinja2.FileSystemLoader(str(_templates_dir()))
    jenv = jinja2.Environment(loader=loader, trim_blocks=True, lstrip_blocks=True,
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)
    return jenv.get_template(tmpl_name).render(**context), plan


def _context(spec: JobSpec, recipe: dict[str, Any], plan: Plan | None, tasks: int,
             array: ArrayJob | None) -> dict[str, Any]:
    """The templates' variables."""
    ranks = spec.nodes * tasks
    name = spec.job_name or (f"{recipe['name']}-sweep" if array else
                             f"{recipe['name']}-{spec.nodes}n")
    out = None if array else \
        spec.out or f"runs/{recipe['name']}-{spec.nodes}n{tasks}r-b{plan.global_batch}"
    check_path("--out", out)
    check_path("--job-name", name)
    cpus = spec.cpus_per_task or (8 if spec.gpus_per_node else 1)
    backend = spec.backend or default_backend(spec.gpus_per_node)
    env = interconnect(spec)
    slurm = spec.scheduler == "slurm"
    # one log per array task: SLURM's %A_%a (array job, task), PBS Pro's ^array_index^
    tasked = bool(array and array.indices)
    log = spec.log or (f"{name}-{'%A_%a' if tasked else '%j'}.out" if slurm else
                       f"{name}.{'^array_index^.' if tasked else ''}log")
    return dict(
        job_name=name, experiment=recipe["name"], nodes=spec.nodes, tasks_per_node=tasks,
        gpus_per_node=spec.gpus_per_node, cpus_per_task=cpus,
        time_limit=format_time(parse_time(spec.time), spec.scheduler), partition=spec.partition,
        account=spec.account, exclusive=spec.exclusive, out=out, data_dir=spec.data_dir,
        log=log, venv=spec.venv, modules=spec.modules, fabric=spec.fabric, interconnect=env,
        signal_lead=spec.signal_lead, preempted_exit_code=PREEMPTED_EXIT_CODE,
        train_argv=array.command if array else _train_argv(spec, plan, ranks, backend),
        launch="" if array else _launch(spec, ranks, tasks, cpus, env),
        block_signals=BLOCK_SIGNALS, gpu_bind=spec.gpu_bind, backend=backend,
        scaling=spec.scaling, plan=plan, array=array,
        rendered_by=array.rendered_by if array else f"hpclb jobs render {_render_args(spec)}",
        version=__version__)


# The committed examples (jobs/slurm, jobs/pbs): experiment -> global batch (--batch-size) at 1,
# 16, 256 nodes of 4 GPUs. MNIST-LSTM stops at k = 64 at 256 nodes (the paper's "batch x64
# without loss"; a larger k would need more warmup epochs than the 20 epochs of training). PTB
# has only 26,559 sequences of 35 tokens: 1,024 ranks x 1 (k = 51.2) already leaves 26 steps per
# epoch.
EXAMPLE_NODES = (1, 16, 256)
EXAMPLES: dict[str, dict[str, Any]] = {
    "mnist-lstm": {"gpus_per_node": 4, "batch_size": {1: 128, 16: 2048, 256: 8192},
                   "time": "01:00:00", "checkpoint_interval": 600},
    "ptb-large": {"gpus_per_node": 4, "batch_size": {1: 20, 16: 320, 256: 1024},
                  "time": "12:00:00", "checkpoint_interval": 1800},
    # 31k verse pairs: k = 64 at 256 nodes is 4 steps per epoch, about as far as it goes
    "gnmt": {"gpus_per_node": 4, "batch_size": {1: 128, 16: 2048, 256: 8192},
             "time": "12:00:00", "checkpoint_interval": 1800},
    # B0 = 1024; 256 nodes x 4 x 32 = 32K, the paper's LEGW point (LR 32, 10 warmup epochs)
    "resnet-50": {"gpus_per_node": 4, "batch_size": {1: 1024, 16: 8192, 256: 32768},
                  "time": "24:00:00", "checkpoint_interval": 1800},
}


def example_specs() -> list[tuple[str, JobSpec]]:
    """(relative path, spec) of every committed example whose recipe exists."""
    have = set(available_experiments())
    specs = []
    for exp, ex in EXAMPLES.items():
        if exp not in have:
            continue
        for n in EXAMPLE_NODES:
            for sched in SCHEDULERS:
                spec = JobSpec(exp, sched, n, ex["gpus_per_node"],
                               batch_size=ex["batch_size"][n], time=ex["time"],
                               checkpoint_interval=ex["checkpoint_interval"],
                               partition="gpu", account="hpclb")
                ext = "sbatch" if sched == "slurm" else "pbs"
                specs.append((f"{sched}/{exp}-{n:03d}n.{ext}", spec))
    return specs


def write_examples(root: str | Path) -> list[Path]:
    """Render every example into ``root`` (jobs/); returns the paths written."""
    written = []
    for rel, spec in example_specs():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(spec)[0])
        path.chmod(0o755)
        written.append(path)
    return written
