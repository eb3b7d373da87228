"""``hpclb sweep ... --submit slurm|pbs``: a sweep as ONE job array, a task per point.

Task ``t`` runs ``hpclb sweep <the same sweep> --task-index I`` for the ``t``-th submitted
point ``I`` (its index in the sweep's ordered points: batch, then seed, then scheme), which
trains that point as :func:`hpclb.tools.sweep.run_sweep` does, with the same identity and run
directory: a recorded point is skipped, a cut one resumes from its checkpoint, and its row goes
into the sweep's results under the sweep's ``.results.lock``. Only points not yet recorded are
submitted, and at k = 1 one per seed: that task trains the B0 run and records the other
schemes' rows from it (at k = 1 every scheme is the B0 recipe). The script is the one ``hpclb
jobs render`` writes (:func:`hpclb.tools.jobs.render` with an
:class:`~hpclb.tools.jobs.ArrayJob`), so a preempted task (USR2 from SLURM, TERM from PBS)
checkpoints, exits 75 and requeues itself (``scontrol requeue`` / ``qrerun`` of that task).

Each submission is appended to ``<runs_dir>/<experiment>/array-jobs.json`` (scheduler, job id,
script, the tasks' points, time), which ``hpclb sweep ... --status`` reads.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from hpclb._io import write_text_atomic
from hpclb.errors import ConfigError
from hpclb.tools.jobs import ArrayJob, JobSpec, render
from hpclb.tools.jobs_spec import check_one_line
from hpclb.tools.sweep_points import Point

__all__ = ["STATE_FILE", "array_status", "submit_array", "sweep_argv", "task_indices",
           "task_points"]

STATE_FILE = "array-jobs.json"
_TASK_ID = {"slurm": "SLURM_ARRAY_TASK_ID", "pbs": "PBS_ARRAY_INDEX"}
_SUBMIT = {"slurm": ["sbatch", "--parsable"], "pbs": ["qsub"]}


def task_indices(points: list[Point], recorded: Callable[[Point], bool],
                 base_batch: int) -> list[int]:
    """The indices of the points to submit: each one not ``recorded``, but at k = 1 only the
    first of each seed (its task records the other schemes' rows from its run)."""
    chosen, b0_seeds = [], set()
    for i, p in enumerate(points):
        if recorded(p) or (p.batch == base_batch and p.seed in b0_seeds):
            continue
        b0_seeds |= {p.seed} if p.batch == base_batch else set()
        chosen.append(i)
    return chosen


def task_points(points: list[Point], index: int, base_batch: int) -> list[Point]:
    """Point ``index`` and, at k = 1, the other schemes' points of its seed (their rows come
    from its run); ConfigError for an index outside the sweep."""
    if not 0 <= index < len(points):
        raise ConfigError(f"--task-index {index}: the sweep has {len(points)} point(s), 0 to "
                          f"{len(points) - 1}; give the same --batch-sizes, --schemes and "
                          f"--seeds as the submission")
    p = points[index]
    return [p] + [q for q in points if p.batch == base_batch and q != p and q.batch == p.batch
                  and q.seed == p.seed]


def sweep_argv(experiment: str, batch_sizes, schemes, seeds, **flags: Any) -> list[str]:
    """The ``hpclb sweep`` command line of a sweep: ``flags`` by name (``runs_dir`` is
    ``--runs-dir``; True: the flag alone; None and False: left out)."""
    argv = ["hpclb", "sweep", str(experiment), "--batch-sizes", ",".join(map(str, batch_sizes)),
            "--schemes", ",".join(schemes), "--seeds", ",".join(map(str, seeds))]
    for name, value in flags.items():
        if value is not None and value is not False:
            text = f"{value:.12g}" if isinstance(value, float) else str(value)
            argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [text])
    return argv


def _sized(job: JobSpec, ranks: int) -> JobSpec:
    """``job`` with ``--tasks-per-node`` of CPU-only nodes from the points' ``ranks`` and no
    periodic checkpoint (a sweep checkpoints at epoch ends and on the signal); ConfigError when
    its ranks are not ``ranks``."""
    if job.tasks_per_node is None and not job.gpus_per_node and ranks % job.nodes == 0:
        job = replace(job, tasks_per_node=ranks // job.nodes)
    per_node = job.tasks_per_node or job.gpus_per_node or 1
    if job.nodes * per_node != ranks:
        raise ConfigError(f"--submit: the job's --nodes {job.nodes} x {per_node} rank(s) per "
                          f"node = {job.nodes * per_node} ranks, but the points run on --ranks "
                          f"{ranks}; give --ranks {job.nodes * per_node} or a job of {ranks} "
                          f"ranks")
    return replace(job, checkpoint_interval=0)


def submit_array(job: JobSpec, sweep_dir: Path, argv: list[str], points: list[Point],
                 indices: list[int], *, ranks: int, name: str, submit: bool = True,
                 log: Callable[[str], Any] = print) -> Path:
    """Render the job array of ``indices`` (points of ``points``; each task runs ``argv`` with
    ``--task-index``) into ``sweep_dir``, submit it unless not ``submit``, and record the
    submission (:data:`STATE_FILE`); returns the script. ConfigError where the scheduler's
    submit command is missing, RuntimeError when it fails."""
    job = replace(_sized(job, ranks), job_name=job.job_name or f"{name}-sweep")
    slurm = job.scheduler == "slurm"
    rendered_by = shlex.join(argv) + f" --submit {job.scheduler}"
    check_one_line("the sweep's command", rendered_by)
    task = f'"${{TASKS[${{{_TASK_ID[job.scheduler]}:-0}}]}}"'  # the t-th task's point
    array = ArrayJob(f"0-{len(indices) - 1}" if len(indices) > 1 else ("0" if slurm else ""),
                     f"{shlex.join(argv)} --verbose --task-index {task}",
                     tuple(f"{i}: {points[i]} -> {sweep_dir / points[i].dir_name}"
                           for i in indices), rendered_by, tuple(indices))
    text, _ = render(job, array)
    script = sweep_dir / f"{job.job_name}.{'sbatch' if slurm else 'pbs'}"
    script.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(script, text)
    script.chmod(0o755)
    cmd = [*_SUBMIT[job.scheduler], str(script)]
    log(f"sweep {name}: {len(indices)} task(s), point(s) {', '.join(map(str, indices))} of "
        f"{len(points)}: {script}")
    if not submit:
        log(f"sweep {name}: not submitted; to submit: {shlex.join(cmd)}")
        return script
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise ConfigError(f"--submit {job.scheduler}: {cmd[0]} is not on PATH here; submit "
                          f"from the cluster's login node, or write the script with --no-submit "
                          f"and run `{shlex.join(cmd)}` there") from None
    if done.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}: "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    log(f"sweep {name}: {shlex.join(cmd)}: {done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    state = _submissions(sweep_dir) + [{
        "scheduler": job.scheduler, "job_id": job_id, "script": str(script),
        "tasks": {str(t): points[i].dir_name for t, i in enumerate(indices)},
        "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
    write_text_atomic(sweep_dir / STATE_FILE, json.dumps(state, indent=1) + "\n")
    return script


def _submissions(sweep_dir: Path) -> list[dict]:
    """The submissions recorded in ``sweep_dir`` (oldest first; [] without a readable file)."""
    try:
        state = json.loads((sweep_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return []
    return state if isinstance(state, list) else []


def _queue(entry: dict) -> str:
    """The array's tasks by state, as the scheduler reports them now."""
    if entry.get("scheduler") != "slurm":
        return f"qstat -t {entry.get('job_id')} for its subjobs"
    if not shutil.which("squeue"):
        return "squeue is not on PATH here"
    try:
        r = subprocess.run(["squeue", "-h", "-r", "-j", str(entry["job_id"]), "-o", "%T"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"squeue failed ({e})"
    states = Counter(r.stdout.split()) if r.returncode == 0 else Counter()
    return ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or \
        "no task in the queue"


def array_status(sweep_dir: Path) -> str | None:
    """The latest job array submitted for the sweep in ``sweep_dir``: its id, tasks, script
    and (SLURM) its tasks' states from ``squeue``; None when none was submitted."""
    entries = _submissions(sweep_dir)
    if not entries:
        return None
    e = entries[-1]
    return (f"array job {e.get('job_id')} ({e.get('scheduler')}, {len(e.get('tasks', {}))} "
            f"task(s), submitted {e.get('submitted')}, {e.get('script')}): {_queue(e)}")
