"""``hpclb jobs render --batch-size B``: the global batch is fixed by the user, the per-rank
batch derived, and the LEGW plan in the header follows from B alone, at any node count (before:
no such flag; the default was B0 / GPUs-per-node per rank, so 2 nodes trained at k = 2)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from hpclb.errors import JobError
from hpclb.tools.jobs import JobSpec, render


def _train_argv(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("TRAIN=("))
    return shlex.split(line[len("TRAIN=("):-1])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _plan_lines(text: str) -> list[str]:
    """The header's LEGW plan without its first line (which names nodes and ranks)."""
    lines = text.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("# LEGW plan"))
    return lines[i + 1:i + 4]


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_global_batch_and_plan_are_the_same_at_every_node_count(scheduler):
    texts = {}
    for nodes in (1, 2, 4, 8):
        text, plan = render(JobSpec("mnist-lstm", scheduler, nodes, 4, batch_size=1024))
        argv = _train_argv(text)
        assert int(_flag(argv, "--batch-size")) == plan.global_batch == 1024
        assert plan.per_rank_batch == 1024 // (4 * nodes) and plan.k == 8
        assert f"global batch 1024 = {nodes} nodes x 4 ranks x {1024 // (4 * nodes)} per rank" \
            in text
        assert "--batch-size 1024" in text.splitlines()[2]  # the render command it states
        texts[nodes] = _plan_lines(text)
    assert all(t == texts[1] for t in texts.values()), texts
    assert "= 8 x B0 (128); peak LR 0.002 -> 0.005657 (eta0*sqrt(k))" in texts[1][0]


def test_default_global_batch_is_b0_whatever_the_node_count():
    for nodes in (1, 2, 4):
        _, plan = render(JobSpec("mnist-lstm", "slurm", nodes, 4))
        assert (plan.global_batch, plan.k, plan.per_rank_batch) == (128, 1, 32 // nodes)


@pytest.mark.parametrize("kw, message", [
    ({"nodes": 3, "batch_size": 1024},
     r"--batch-size 1024 does not divide evenly over --nodes 3 x --gpus-per-node 4 = 12 ranks "
     r".*a multiple of 12 \(1020, 1032\) or a node count that divides it \(1, 2, 4\)"),
    ({"nodes": 3}, r"the recipe's base batch B0 = 128 \(the default global batch\) does not "
                   r"divide evenly over --nodes 3 x --gpus-per-node 4 = 12 ranks"),
    ({"batch_size": 0}, r"--batch-size 0: the global batch must be an integer >= 1"),
    ({"batch_size": 256, "per_gpu_batch": 32}, r"--batch-size 256 and --per-gpu-batch 32: give "
                                               r"one"),
    ({"batch_size": 65536}, r"global batch 65536 is larger than the training set .* give a "
                            r"smaller --batch-size \(at most 60000\)"),
])
def test_bad_batch_is_refused_naming_the_flag(kw, message):
    with pytest.raises(JobError, match=message):
        render(JobSpec(**{"experiment": "mnist-lstm", "scheduler": "slurm", "nodes": 2,
                          "gpus_per_node": 4, **kw}))


def test_cli_batch_size(tmp_path):
    base = [sys.executable, "-m", "hpclb", "jobs", "render", "mnist-lstm", "--scheduler",
            "slurm", "--gpus-per-node", "4", "--batch-size", "1024"]
    ok = subprocess.run(base + ["--nodes", "2"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert _flag(_train_argv(ok.stdout), "--batch-size") == "1024"
    assert "--expect-world-size 8" in ok.stdout
    bad = subprocess.run(base + ["--nodes", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert re.search(r"hpclb: error: --batch-size 1024 does not divide evenly over --nodes 3",
                     bad.stderr), bad.stderr


def test_render_refuses_to_replace_a_script_without_overwrite(tmp_path):
    """``hpclb jobs render -o FILE`` on an existing file: exit 2 naming ``--overwrite``; with
    it, the file is replaced."""
    import subprocess
    import sys
    out = tmp_path / "job.sbatch"
    out.write_text("# the user's own script\n")
    argv = [sys.executable, "-m", "hpclb", "jobs", "render", "mnist-lstm", "--scheduler", "slurm",
            "--nodes", "1", "--gpus-per-node", "4", "-o", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--overwrite" in r.stderr, r.stderr
    assert out.read_text() == "# the user's own script\n"
    r = subprocess.run([*argv, "--overwrite"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("#!")
