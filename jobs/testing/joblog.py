"""What a job's log has to tell its user, read from ``hpclb train``'s console lines by their
facts, not their sentences (the wording of those lines changes: the start-up line gained the
device, the resume line the checkpoint generation's file).

- :func:`startups`: each attempt's start-up line (``hpclb EXPERIMENT: ...``, rank 0 only): the
  world size (``N rank(s)``/``ranks``) and the global batch (``global batch G = N x b``).
- :func:`resumes`: each ``resumed ...`` line: the checkpoint file it names and the global step
  it continues from (``step S``).

Both raise AssertionError, quoting the line, when a line they recognise lacks the fact; the tests
then assert on the values (world size 2, the step the ranks were preempted after, a checkpoint
inside the job's run directory).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STARTUP = re.compile(r"^hpclb (?P<experiment>[\w.-]+): (?P<rest>.*)$", re.M)
_RANKS = re.compile(r"\b(\d+)\s*(?:rank\(s\)|ranks?\b|processes\b|workers\b)", re.I)
_BATCH = re.compile(r"\bglobal batch(?: size)?\b\D{0,3}?(\d+)(?:\s*=\s*(\d+)\s*[x×*]\s*(\d+))?",
                    re.I)
_RESUMED = re.compile(r"\bresum(?:ed|ing)\b", re.I)
_CHECKPOINT = re.compile(r"(?P<path>\S+\.pt)\b")
_STEP = re.compile(r"\bstep\s*[:=]?\s*(\d+)\b", re.I)


@dataclass(frozen=True)
class Startup:
    experiment: str
    world_size: int
    global_batch: int
    per_rank_batch: int | None  # when the line spells the split (G = N x b)
    line: str


@dataclass(frozen=True)
class Resume:
    checkpoint: str  # as printed (absolute, or relative to the job's directory)
    step: int        # the global step the run continues after
    line: str

    def inside(self, run_dir: Path, cwd: Path) -> bool:
        """Whether the checkpoint named is in ``run_dir`` (a relative name is read from
        ``cwd``, the job's directory); the file itself may be pruned by then."""
        return (cwd / self.checkpoint).resolve().is_relative_to(run_dir.resolve())


def startups(log: str, experiment: str | None = None) -> list[Startup]:
    """The start-up lines in ``log``, in order (one per attempt that got as far as training)."""
    found = []
    for m in _STARTUP.finditer(log):
        if experiment is not None and m["experiment"] != experiment:
            continue
        line, rest = m[0], m["rest"]
        ranks, batch = _RANKS.search(rest), _BATCH.search(rest)
        assert ranks and batch, f"start-up line without a world size or global batch: {line!r}"
        if batch[2] is not None:
            assert int(batch[2]) == int(ranks[1]), f"world size and batch split disagree: {line!r}"
        found.append(Startup(m["experiment"], int(ranks[1]), int(batch[1]),
                             int(batch[3]) if batch[3] is not None else None, line))
    return found


def resumes(log: str) -> list[Resume]:
    """The resume lines of ``hpclb train`` in ``log``, in order (the batch script's own ``[job]``
    lines are not them)."""
    found = []
    for line in log.splitlines():
        if line.startswith("[job]") or not _RESUMED.search(line):
            continue
        ckpt = _CHECKPOINT.search(line)
        if not ckpt:
            continue  # not a resume from a file (e.g. a message about --resume itself)
        step = _STEP.search(_CHECKPOINT.sub(" ", line))  # a step in a file name does not count
        assert step, f"resume line without the step it continues from: {line!r}"
        found.append(Resume(ckpt["path"], int(step[1]), line))
    return found
