"""A missing optional package is named, with the extra that installs it, in one line before the
command does anything (issue 34, item 4): before, ``jobs render`` ended in a traceback, ``scale
--scheduler`` in a traceback after writing its recipe, and ``sweep`` in a traceback after
training its first point (the others never ran). The packages are hidden from the real command
line by a ``sitecustomize`` that sets ``sys.modules[name] = None`` (an import then fails as for a
package that is not installed)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import LAUNCH_ENV, quick_recipe, run_hpclb

from hpclb.config import resolve

pytestmark = pytest.mark.timeout(200)


def without(tmp_path: Path, *modules: str) -> dict:
    """:data:`LAUNCH_ENV` in which ``modules`` cannot be imported."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    path = [str(site), *filter(None, [LAUNCH_ENV.get("PYTHONPATH")])]
    return {**LAUNCH_ENV, "PYTHONPATH": os.pathsep.join(path)}


def named_the_extra(p, package: str, purpose: str) -> None:
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert f"hpclb: error: {purpose} needs {package}, which is not installed: pip install " \
           f"'hpclb[experiments]'" in out, out
    assert "Traceback" not in out and out.count("hpclb: error:") == 1, out


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != "site" and
                  "site" not in p.relative_to(root).parts)


def test_jobs_render_without_jinja2(tmp_path):
    p = run_hpclb("jobs", "render", "mnist-lstm", "--scheduler", "slurm", "--nodes", "1",
                  "--gpus-per-node", "1", "-o", tmp_path / "job.sbatch", timeout=120,
                  env=without(tmp_path, "jinja2"))
    named_the_extra(p, "jinja2", "rendering job templates")
    assert files_under(tmp_path) == []


def test_scale_with_scheduler_without_jinja2_writes_no_recipe(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = resolve(quick_recipe(tmp_path), out=str(run))
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": 1}))
    before = files_under(tmp_path)
    p = run_hpclb("scale", run, "--to-batch", "256", "--scheduler", "slurm", "--nodes", "1",
                  "--gpus-per-node", "1", timeout=120, env=without(tmp_path, "jinja2"))
    named_the_extra(p, "jinja2", "rendering job templates")
    assert files_under(tmp_path) == before  # no recipe-b256-legw.yaml


def test_sweep_without_matplotlib_trains_nothing(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path)
    before = files_under(tmp_path)
    p = run_hpclb("sweep", recipe, "--batch-sizes", "128,256", "--schemes", "legw",
                  "--runs-dir", tmp_path / "runs", "--out-dir", tmp_path / "results",
                  "--data-dir", mnist_dir.parent, timeout=150,
                  env=without(tmp_path, "matplotlib"))
    named_the_extra(p, "matplotlib", "the sweep's figure")
    assert files_under(tmp_path) == before  # no run directory, no results


def test_seq2seq_task_without_sacrebleu_is_refused_before_training(monkeypatch):
    """BLEU is computed at the first evaluation, after an epoch of training: the task asks for
    sacrebleu when it is built, before any step."""
    from hpclb.errors import MissingExtraError
    from hpclb.tasks.seq2seq import Seq2seqTask

    monkeypatch.setitem(sys.modules, "sacrebleu", None)
    with pytest.raises(MissingExtraError, match=r"BLEU \(test_bleu\) needs sacrebleu.*"
                                                r"pip install 'hpclb\[experiments\]'"):
        Seq2seqTask({"train": [("a b", "c d")] * 4, "test": [("a", "c")]}, vocab_size=8,
                    max_length=4, eval_samples=1)
