"""Job templates: rendering, the committed examples' LEGW numbers, directives, validation.

Fast (no scheduler): the real SLURM and the PBS emulation are in jobs/testing (`make test-slurm`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import quick_recipe

from hpclb import schedules
from hpclb.cli import main
from hpclb.config import load_recipe
from hpclb.errors import JobError
from hpclb.tools import jobs, jobs_spec, jobs_testing
from hpclb.tools.jobs import JobSpec, render

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = jobs.example_specs()


def train_line(text: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith("TRAIN=("))
    return shlex.split(line[len("TRAIN=("):-1])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def spec(**kw) -> JobSpec:
    base = dict(experiment="mnist-lstm", scheduler="slurm", nodes=2, gpus_per_node=4)
    return JobSpec(**{**base, **kw})


# --- the committed examples ------------------------------------------------------------------

def test_examples_cover_every_recipe_and_node_count():
    names = {rel for rel, _ in EXAMPLES}
    for exp in jobs.EXAMPLES:
        if exp in {s.experiment for _, s in EXAMPLES}:
            for n in jobs.EXAMPLE_NODES:
                assert f"slurm/{exp}-{n:03d}n.sbatch" in names
                assert f"pbs/{exp}-{n:03d}n.pbs" in names
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("rel,sp", EXAMPLES, ids=[r for r, _ in EXAMPLES])
def test_committed_example_is_current(rel, sp):
    path = REPO / "jobs" / rel
    assert path.is_file(), f"{rel} missing; run `hpclb jobs examples`"
    assert path.read_text() == render(sp)[0], f"{rel} is stale; run `hpclb jobs examples`"


@pytest.mark.parametrize("rel,sp", EXAMPLES, ids=[r for r, _ in EXAMPLES])
def test_example_batch_lr_warmup_are_legw_for_its_node_count(rel, sp):
    """The script's global batch is nodes x GPUs x per-GPU batch, and the LR/warmup in its header
    are what hpclb.schedules gives for that batch (sqrt LR, warmup W0*k epochs = same steps)."""
    text = (REPO / "jobs" / rel).read_text()
    recipe = load_recipe(sp.experiment)
    ranks = sp.nodes * sp.gpus_per_node
    B = sp.batch_size
    argv = train_line(text)
    assert int(flag(argv, "--batch-size")) == B
    assert flag(argv, "--scaling") == "legw"
    assert int(flag(argv, "--expect-world-size")) == ranks
    n, _ = jobs.train_set_size(recipe)
    b0, w0 = recipe["base_batch_size"], recipe["warmup_epochs"]
    eta0 = recipe["optimizers"][recipe["optimizer"]]["lr"]
    decay = dict(recipe["decay"])
    s = schedules.Schedule.from_recipe(base_lr=eta0, base_batch_size=b0, base_warmup_epochs=w0,
                                       global_batch_size=B, num_samples=n,
                                       epochs=recipe["epochs"], scheme="legw",
                                       decay=decay.pop("name"), decay_params=decay)
    k = B / b0
    assert s.peak_lr == pytest.approx(eta0 * math.sqrt(k))
    assert s.warmup_steps == round(w0 * n / b0)  # LEGW: the same warmup iterations at every k
    m = re.search(r"global batch (\d+) = (\d+) nodes x (\d+) ranks x (\d+) per rank", text)
    assert m and tuple(map(int, m.groups())) == (B, sp.nodes, sp.gpus_per_node, B // ranks)
    m = re.search(r"peak LR (\S+) -> (\S+) \(eta0\*sqrt\(k\)\)", text)
    assert float(m.group(2)) == pytest.approx(s.peak_lr, rel=1e-3)
    m = re.search(r"warmup (\S+) -> (\S+) epochs = (\d+) steps", text)
    assert float(m.group(2)) == pytest.approx(w0 * k, rel=1e-3)
    assert int(m.group(3)) == s.warmup_steps
    m = re.search(r"(\d+) steps/epoch x \S+ epochs = (\d+) steps", text)
    assert (int(m.group(1)), int(m.group(2))) == (s.steps_per_epoch, s.total_steps)


@pytest.mark.parametrize("rel,sp", [e for e in EXAMPLES if e[1].scheduler == "slurm"],
                         ids=[r for r, s in EXAMPLES if s.scheduler == "slurm"])
def test_slurm_example_directives(rel, sp):
    text = (REPO / "jobs" / rel).read_text()
    d = jobs_testing.directives(text, "#SBATCH")
    assert f"--nodes={sp.nodes}" in d
    assert f"--ntasks-per-node={sp.gpus_per_node}" in d
    assert "--gpus-per-task=1" in d and not any(x.startswith("--gpus-per-node") for x in d)
    assert f"--time={jobs_spec.format_time(jobs_spec.parse_time(sp.time), 'slurm')}" in d
    assert "--partition=gpu" in d and "--account=hpclb" in d
    assert any(re.fullmatch(r"--signal=B:USR2@\d+", x) for x in d)
    assert "--requeue" in d and "--open-mode=append" in d
    launch = re.search(r"^    srun --mpi=pmix (.*)\"\$\{TRAIN\[@\]\}\".* &$", text, re.M)
    assert launch, text
    assert f"--ntasks-per-node={sp.gpus_per_node}" in launch.group(1)
    assert "--gpus-per-task=1 --gpu-bind=single:1 " in launch.group(1)
    assert launch.group(1).endswith(f"{jobs.BLOCK_SIGNALS} ")
    argv = train_line(text)
    assert flag(argv, "--device") == "cuda" and flag(argv, "--backend") == "torch"
    assert 'wait "$LAUNCH"' in text and "trap 'forward USR2' USR2" in text
    assert re.search(r'if \[ "\$rc" -eq 75 \]; then\n.*\n\s+scontrol requeue "\$SLURM_JOB_ID"', text)


@pytest.mark.parametrize("rel,sp", [e for e in EXAMPLES if e[1].scheduler == "pbs"],
                         ids=[r for r, s in EXAMPLES if s.scheduler == "pbs"])
def test_pbs_example_directives(rel, sp):
    text = (REPO / "jobs" / rel).read_text()
    r = jobs_testing.pbs_resources(text)
    G = sp.gpus_per_node
    assert (r["select"], r["ngpus"], r["mpiprocs"]) == (sp.nodes, G, G)
    assert r["ncpus"] == G * 8 and r["ompthreads"] == 8
    assert r["walltime"] == jobs_spec.parse_time(sp.time) and r["rerunnable"] is True
    assert r["queue"] == "gpu" and r["account"] == "hpclb" and r["place"] == "scatter:excl"
    launch = re.search(rf'^    env --block-signal=TERM mpiexec -n {sp.nodes * G} --host "\$HOSTS" '
                       rf"--map-by ppr:{G}:node (.*)\"\$\{{TRAIN", text, re.M)
    assert launch and launch.group(1).endswith(f"{jobs.BLOCK_SIGNALS} "), text
    assert "-x CUDA_VISIBLE_DEVICES" not in text  # each node's own list, set by PBS there
    argv = train_line(text)
    assert flag(argv, "--device") == "cuda" and flag(argv, "--backend") == "torch"
    assert "awk '!seen[$0]++" in text and "$PBS_NODEFILE" in text


@pytest.mark.parametrize("rel", [r for r, _ in EXAMPLES])
def test_example_is_valid_bash(rel):
    subprocess.run(["bash", "-n", str(REPO / "jobs" / rel)], check=True)


# --- rendering choices -----------------------------------------------------------------------

def test_default_per_gpu_batch_runs_the_recipe_at_k1_on_one_node():
    text, plan = render(spec(nodes=1, gpus_per_node=4))
    assert plan.global_batch == 128 and plan.k == 1 and plan.per_rank_batch == 32


#: the variables a job exports only when asked (--fabric, --allreduce, device and interface names)
FABRIC_VARS = re.compile(r"\b(?:NCCL|UCX|OMPI_MCA)_\w+")


def fabric_exports(text: str) -> dict[str, str]:
    return {k: v for k, v in re.findall(r"^export (\w+)=(.*)$", text, re.M)
            if FABRIC_VARS.fullmatch(k)}


UNTUNED = [*EXAMPLES, ("slurm mpirun", spec(launcher="mpirun")), ("pbs", spec(scheduler="pbs")),
           ("cpu", spec(gpus_per_node=0, tasks_per_node=2))]


@pytest.mark.parametrize("name,sp", UNTUNED, ids=[name for name, _ in UNTUNED])
def test_a_job_trusts_the_site_unless_asked(name, sp):
    """No NCCL_ALGO, btl/pml/coll selection, HCA or interface name in a script nobody asked
    to tune (issue 51: the ring by default switched off NCCL's tree and NVLS at 1,024 GPUs, and
    mlx5/ib0 broke or fell back to TCP on sites whose names differ)."""
    path = REPO / "jobs" / name
    text = path.read_text() if path.is_file() else render(sp)[0]
    assert not FABRIC_VARS.search(text), FABRIC_VARS.findall(text)


ASKED = [
    ({"allreduce": "ring"}, {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                             "OMPI_MCA_coll_tuned_allreduce_algorithm": "ring",
                             "NCCL_ALGO": "Ring"}),
    ({"allreduce": "recursive_doubling"},
     {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "NCCL_ALGO": "Tree",
      "OMPI_MCA_coll_tuned_allreduce_algorithm": "recursive_doubling"}),
    ({"fabric": "ib"}, {"OMPI_MCA_pml": "ucx", "OMPI_MCA_btl": "^tcp,openib,uct",
                        "NCCL_IB_DISABLE": "0"}),
    ({"fabric": "tcp"}, {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,sm,tcp",
                         "NCCL_IB_DISABLE": "1"}),
    ({"fabric": "local"}, {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
                           "NCCL_IB_DISABLE": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
                           "NCCL_SOCKET_IFNAME": "lo"}),
    ({"ucx_net_devices": "mlx5_2:1"}, {"UCX_NET_DEVICES": "mlx5_2:1"}),
    ({"nccl_ib_hca": "mlx5_2"}, {"NCCL_IB_HCA": "mlx5_2"}),
    ({"socket_ifname": "eno1"}, {"NCCL_SOCKET_IFNAME": "eno1",
                                 "OMPI_MCA_btl_tcp_if_include": "eno1"}),
    ({"fabric": "tcp", "socket_ifname": "eno1"},
     {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,sm,tcp", "NCCL_IB_DISABLE": "1",
      "NCCL_SOCKET_IFNAME": "eno1", "OMPI_MCA_btl_tcp_if_include": "eno1"}),
]


@pytest.mark.parametrize("scheduler", jobs_spec.SCHEDULERS)
@pytest.mark.parametrize("kw,env", ASKED, ids=[",".join(f"{k}={v}" for k, v in kw.items())
                                               for kw, _ in ASKED])
def test_each_fabric_option_exports_exactly_its_variables(scheduler, kw, env):
    text = render(spec(scheduler=scheduler, **kw))[0]
    assert fabric_exports(text) == env
    if scheduler == "pbs":  # mpiexec forwards to the ranks what Open MPI does not read itself
        assert set(re.findall(r"-x ((?:NCCL|UCX)_\w+)", text)) == {
            k for k in env if not k.startswith("OMPI_MCA_")}


def test_env_modules_launcher_and_outputs():
    text = render(spec(venv=None, modules=["cuda/12.4", "openmpi/5.0"], launcher="mpirun",
                       out="runs/x", data_dir="/scratch/data", checkpoint_interval=0,
                       scaling="linear", epochs=5.0))[0]
    assert "module load cuda/12.4\nmodule load openmpi/5.0" in text and "activate" not in text
    assert re.search(r"^    env --block-signal=TERM mpirun -n 8 --map-by ppr:4:node "
                     r"--bind-to none env --block-signal=USR2 --block-signal=TERM ", text, re.M)
    argv = train_line(text)
    assert flag(argv, "--scaling") == "linear" and flag(argv, "--epochs") == "5"
    assert "--checkpoint-interval" not in argv and flag(argv, "--data-dir") == "$HPCLB_DATA"
    assert "OUT=runs/x" in text and "export HPCLB_DATA=/scratch/data" in text
    assert "(eta0*k)" in text


def test_cpu_only_nodes_use_tasks_per_node():
    text, plan = render(spec(gpus_per_node=0, tasks_per_node=16, per_gpu_batch=4))
    assert plan.global_batch == 2 * 16 * 4
    d = jobs_testing.directives(text, "#SBATCH")
    assert "--ntasks-per-node=16" in d and not any("gpus" in x for x in d)
    pbs = jobs_testing.pbs_resources(render(spec(scheduler="pbs", gpus_per_node=0, tasks_per_node=16))[0])
    assert "ngpus" not in pbs and pbs["mpiprocs"] == 16
    argv = train_line(text)  # CPU jobs: the command they always had
    assert "--device" not in argv and flag(argv, "--backend") == "mpi"
    assert "--gpu" not in text.split("TRAIN=(")[1]


def test_gpu_backend_device_and_binding_choices():
    text = render(spec(backend="mpi", gpu_bind="none"))[0]
    assert flag(train_line(text), "--backend") == "mpi"
    assert "--gpus-per-task=1 --gpu-bind=none " in text
    argv = train_line(render(spec(device="cpu"))[0])
    assert flag(argv, "--device") == "cpu"
    pbs = render(spec(scheduler="pbs"))[0]
    argv = train_line(pbs)
    assert (flag(argv, "--backend"), flag(argv, "--device")) == ("torch", "cuda")
    assert "# --backend torch on GPUs: NCCL moves the CUDA gradient buckets" in pbs
    assert "# --backend torch on GPUs" not in text  # mpi asked for: no NCCL reasoning


def test_signals_are_trapped_before_anything_else_runs():
    """The traps come right after `set -uo pipefail`, before cd/module/venv (a TERM there
    used to kill the batch shell: no requeue)."""
    for sched in jobs_spec.SCHEDULERS:
        text = render(spec(scheduler=sched, modules=["cuda"]))[0]
        body = [l for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]
        first = body.index("set -uo pipefail")
        assert "trap 'forward TERM' TERM" in body[first:first + 30]
        traps = body.index("trap 'forward TERM' TERM")
        assert traps < body.index("module load cuda") and traps < min(
            i for i, l in enumerate(body) if l.startswith("cd "))


def test_packaged_templates_are_the_checkout_templates():
    packaged = REPO / "hpclb" / "job_templates"
    for t in (REPO / "jobs" / "templates").glob("*.j2"):
        assert (packaged / t.name).read_text() == t.read_text(), t.name


def test_long_time_limits_per_scheduler():
    assert "#SBATCH --time=2-00:00:00" in render(spec(time="48:00:00"))[0]
    assert "#PBS -l walltime=48:00:00" in render(spec(scheduler="pbs", time="2-00:00:00"))[0]


# --- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    ({"nodes": 0}, r"--nodes 0: a job needs at least 1 node"),
    ({"nodes": 256, "per_gpu_batch": 128}, r"global batch 131072 is larger than the training set "
                                          r"\(60000 images of mnist\)"),
    ({"time": "00:20:00", "checkpoint_interval": 1800}, r"not more than --checkpoint-interval"),
    ({"time": "00:04:00"}, r"not longer than --signal-lead 300"),
    ({"time": "4h"}, r"HH:MM:SS"),
    ({"signal_lead": 5}, r"at least 30 s"),
    ({"nodes": 128, "per_gpu_batch": 32}, r"warmup .* must be shorter than training"),
    ({"experiment": "no-such"}, r"unknown experiment 'no-such'"),
    ({"tasks_per_node": 2}, r"one rank per GPU"),
    ({"per_gpu_batch": 0}, r"--per-gpu-batch 0"),
    ({"gpus_per_node": -1}, r"--gpus-per-node -1"),
    ({"scheduler": "lsf"}, r"--scheduler 'lsf'"),
    ({"out": "my runs/x"}, r"no spaces"),
    ({"out": "runs/$(id)"}, r"'runs/\$\(id\)': no spaces, quotes, shell operators, \$"),
    ({"venv": "envs/${USER}"}, r"\$ expansions"),
    ({"data_dir": "/data/`whoami`"}, r"no spaces"),
    ({"out": "runs/*"}, r"glob characters"),
    ({"optimizer": "lion"}, r"no tuned hyper-parameters"),
    ({"backend": "nccl"}, r"--backend 'nccl': choose one of"),
    ({"gpu_bind": "map_gpu:0"}, r"--gpu-bind 'map_gpu:0'"),
    ({"device": "cuda", "gpus_per_node": 0, "tasks_per_node": 2}, r"ask for GPUs"),
    ({"socket_ifname": "ib0;id"}, r"--socket-ifname 'ib0;id': no spaces, quotes, shell operators"),
    ({"ucx_net_devices": "mlx5_0:1 $(id)"}, r"--ucx-net-devices 'mlx5_0:1 \$\(id\)': no spaces"),
    ({"nccl_ib_hca": "`id`"}, r"--nccl-ib-hca '`id`': no spaces"),
    ({"partition": "gpu\nid"}, r"--partition 'gpu\\nid': holds a line break"),
])
def test_invalid_requests_name_the_fix(kw, match):
    with pytest.raises(JobError, match=match):
        render(spec(**kw))


MARK = "hpclbMARK"
#: what a user might pass that a shell would run: an operator, a command substitution in both
#: forms, a word break and a line break
HOSTILE = (f"ib0;{MARK}", f"$({MARK})", f"`{MARK}`", f"ib0 {MARK}", f"ib0\n{MARK}")
TEXT_FIELDS = [f.name for f in dataclasses.fields(JobSpec)
               if f.type in ("str", "str | None", "list[str]")]


def inert(text: str, value: str) -> list[str]:
    """Why ``value`` in the rendered ``text`` could run as a command: the script must pass
    ``bash -n``, and every line holding the marker must be a comment or hold ``value`` as one
    shell word (quoted)."""
    bad = []
    check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    if check.returncode:
        bad.append(f"bash -n: {check.stderr}")
    for line in text.splitlines():
        if MARK in line and not line.lstrip().startswith("#"):
            try:
                words = shlex.split(line.split("=", 1)[1] if line.startswith("TRAIN=(") else line)
            except ValueError as e:
                words = [f"unparsable ({e})"]
            if value not in words and value + ")" not in words:
                bad.append(f"{value!r} is not one word in {line!r}")
    return bad


def test_every_text_option_is_refused_or_quoted(tmp_path):
    """Every text field of a job (``export`` values, directives, paths, names, choices, the
    recipe path) set to each of :data:`HOSTILE` is refused naming its flag, or reaches the script
    only as one quoted word or inside a comment (before: ``--socket-ifname``,
    ``--ucx-net-devices`` and ``--nccl-ib-hca`` went unquoted into ``export`` lines)."""
    assert {"socket_ifname", "ucx_net_devices", "nccl_ib_hca", "experiment", "modules",
            "optimizer"} <= set(TEXT_FIELDS)
    recipe = Path(quick_recipe(tmp_path)).read_text()
    accepted, bad = [], []
    for name in TEXT_FIELDS:
        flag = {"experiment": "EXPERIMENT", "modules": "--module"}.get(
            name, "--" + name.replace("_", "-"))
        for value in HOSTILE:
            if name == "experiment":  # an existing recipe at a hostile path
                path = tmp_path / f"{value}.yaml"
                path.write_text(recipe)
                value = str(path)
            try:
                text, _ = render(spec(**{name: [value] if name == "modules" else value}))
            except JobError as e:
                if flag not in str(e) or value not in str(e) and repr(value)[1:-1] not in str(e):
                    bad.append(f"{flag} {value!r}: refused without naming it: {e}")
                continue
            accepted.append((name, value))
            bad += [f"{flag}: {why}" for why in inert(text, value)]
    assert not bad, bad
    assert [n for n, _ in accepted] == ["experiment"] * 4, accepted  # the path, quoted; no \n


def test_train_set_sizes_table():
    assert jobs.train_set_size({"name": "x", "data": {"name": "imagenet"}}) == (1_281_167, "images")
    n, unit = jobs.train_set_size({"name": "x", "data": {"name": "ptb", "seq_len": 35}})
    assert n == 929_588 // 35 and "35 tokens" in unit
    assert jobs.train_set_size({"name": "x", "data": {"name": "ptb"}, "model": {"num_steps": 20}})[0] \
        == 929_588 // 20
    with pytest.raises(JobError, match="seq_len"):
        jobs.train_set_size({"name": "x", "data": {"name": "ptb"}})
    with pytest.raises(JobError, match="data-set registry"):
        jobs.train_set_size({"name": "x", "data": {"name": "cifar"}})
    assert jobs.train_set_size({"name": "x", "data": {"name": "mnist", "train_samples": 4096}}) \
        == (4096, "images")


def test_pbs_directive_parser_rejects_bad_lines():
    good = render(spec(scheduler="pbs"))[0]
    with pytest.raises(JobError, match="-r x"):
        jobs_testing.pbs_resources(good.replace("#PBS -r y", "#PBS -r x"))
    with pytest.raises(JobError, match="chunk count"):
        jobs_testing.pbs_resources(good.replace("select=2:", "select=:"))
    with pytest.raises(JobError, match="no walltime"):
        jobs_testing.pbs_resources(good.replace("#PBS -l walltime", "# -l walltime"))


# --- command line ----------------------------------------------------------------------------

def test_cli_render_prints_and_writes(tmp_path, capsys):
    assert main(["jobs", "render", "mnist-lstm", "--scheduler", "slurm", "--nodes", "16",
                 "--gpus-per-node", "4", "--per-gpu-batch", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "--batch-size 2048" in out
    path = tmp_path / "j" / "job.pbs"
    assert main(["jobs", "render", "mnist-lstm", "--scheduler", "pbs", "--nodes", "1",
                 "--gpus-per-node", "4", "-o", str(path)]) == 0
    assert "#PBS -l select=1:" in path.read_text()
    assert "global batch 128" in capsys.readouterr().err


def test_cli_render_error_exit_2(capsys):
    assert main(["jobs", "render", "mnist-lstm", "--scheduler", "slurm", "--nodes", "0",
                 "--gpus-per-node", "4"]) == 2
    assert "hpclb: error: --nodes 0" in capsys.readouterr().err



@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_a_missing_virtualenv_stops_the_job_naming_the_fix(tmp_path, scheduler):
    """Submitted from a directory without the (relative) virtualenv, the job says so and exits 2
    before it launches anything (a fresh-user review ran a sweep's printed sbatch command from
    another directory: `hpclb` was then not found, far from the cause)."""
    script = tmp_path / "job.sh"
    script.write_text(render(spec(scheduler=scheduler, venv=".venv-absent"))[0])
    env = {"PATH": "/usr/bin:/bin", "PBS_O_WORKDIR": str(tmp_path),
           "SLURM_SUBMIT_DIR": str(tmp_path), "PBS_NODEFILE": "/dev/null"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"[job] error: no virtualenv .venv-absent/bin/activate in {tmp_path}: submit from " \
           "the directory that holds it, or render with --venv ABSOLUTE_PATH" in done.stderr


@pytest.mark.parametrize("array", [False, True])
def test_a_refused_qrerun_ends_the_job_as_cut(tmp_path, array):
    """Many PBS sites keep qrerun for operators: the job then exited 0 (a cut run looked
    finished) after one line. Now it ends with exit 75 and says how to resume: qsub the script
    again, or submit the sweep again (its missing points only). Run here: the script's tail,
    from the requeue test on, with a qrerun that refuses and one that accepts."""
    import subprocess

    from hpclb.tools import sweep
    from hpclb.tools.jobs import render
    from hpclb.tools.jobs_spec import JobSpec

    if array:
        recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 512,
                                              "test_samples": 200})
        text = sweep.submit_sweep(recipe, [128, 256], ["legw"], submit=False,
                                  job=JobSpec(recipe, "pbs", 1, 0, venv=None),
                                  runs_dir=tmp_path / "runs", log=lambda m: None).read_text()
    else:
        text, _ = render(JobSpec("mnist-lstm", "pbs", 1, 0, tasks_per_node=2))
    tail = text[text.index('if [ "$rc" -eq 75 ]'):]
    for answer, status, said in ((1, 75, "qrerun refused: " + (
            "submit the sweep again" if array else "qsub this script again")), (0, 0, "")):
        bin_dir = tmp_path / f"bin{answer}"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "qrerun").write_text(f"#!/bin/sh\nexit {answer}\n")
        (bin_dir / "qrerun").chmod(0o755)
        r = subprocess.run(["bash", "-c", f"rc=75\n{tail}"], capture_output=True, text=True,
                           env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PBS_JOBID": "7.pbs"})
        assert r.returncode == status and said in r.stderr, (r.returncode, r.stderr)


def test_a_venv_missing_where_the_job_is_submitted_is_warned(tmp_path, monkeypatch, capsys):
    """The script activates --venv (default .venv) in the submit directory; rendered where
    there is none, every task would stop with exit 2 on the cluster, and nothing said so."""
    from hpclb import cli

    argv = ["jobs", "render", "--scheduler", "slurm", "mnist-lstm", "--nodes", "1",
            "--gpus-per-node", "1", "-o", str(tmp_path / "job.sbatch"), "--overwrite"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 0
    assert "--venv .venv: the job activates it in the directory it is submitted from" in \
        capsys.readouterr().err
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    for extra in ([], ["--venv", "/opt/any/venv"]):
        assert cli.main(argv + extra) == 0
        assert "warning" not in capsys.readouterr().err
