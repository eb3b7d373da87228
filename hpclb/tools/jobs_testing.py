"""Reading rendered job scripts back, for the tests and the emulated schedulers of
``jobs/testing`` (``pbs_run.py`` starts a PBS script from what :func:`pbs_resources` finds)."""
from __future__ import annotations

import re
from typing import Any

from hpclb.errors import JobError
from hpclb.tools.jobs_spec import parse_time

__all__ = ["directives", "pbs_resources"]


def directives(text: str, prefix: str) -> list[str]:
    """The scheduler directives of a script (``#SBATCH`` / ``#PBS`` lines before the first
    command), each without the prefix: ``["--nodes=16", ...]`` / ``["-l select=...", ...]``."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(prefix + " "):
            out.append(s[len(prefix) + 1:].strip())
        elif s and not s.startswith("#"):
            break
    return out


def _pbs_resource_list(res: dict[str, Any], val: str) -> None:
    """One ``#PBS -l`` line (select, walltime, place) into ``res``."""
    for part in val.split(","):
        key, _, v = part.partition("=")
        if key == "select":
            chunks = v.split(":")
            if not chunks[0].isdigit():
                raise JobError(f"#PBS -l select={v}: the chunk count must come first")
            res["select"] = int(chunks[0])
            for c in chunks[1:]:
                k, _, n = c.partition("=")
                if not n.isdigit():
                    raise JobError(f"#PBS -l select: {c!r} is not name=integer")
                res[k] = int(n)
        elif key == "walltime":
            res["walltime"] = parse_time(v)
        elif key == "place":
            res["place"] = v
        else:
            raise JobError(f"#PBS -l {key}: not a resource these templates use")


def pbs_resources(text: str) -> dict[str, Any]:
    """A PBS script's request: {'select': N, 'ncpus', 'ngpus', 'mpiprocs', 'ompthreads' (per
    chunk), 'walltime' (s), 'rerunnable' (bool), 'place', 'queue', 'account', 'name', and for
    a job array 'array': (first, last, step)};
    JobError for a directive PBS Pro would reject."""
    res: dict[str, Any] = {"rerunnable": None}
    for d in directives(text, "#PBS"):
        opt, _, val = d.partition(" ")
        val = val.strip()
        if opt == "-l":
            _pbs_resource_list(res, val)
        elif opt == "-r":
            if val not in ("y", "n"):
                raise JobError(f"#PBS -r {val}: must be y or n")
            res["rerunnable"] = val == "y"
        elif opt == "-J":  # a job array: X-Y[:Z], X < Y (PBS Pro refuses one subjob)
            m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?", val)
            if not m or int(m[1]) >= int(m[2]):
                raise JobError(f"#PBS -J {val}: must be X-Y[:Z] with X < Y")
            res["array"] = (int(m[1]), int(m[2]), int(m[3] or 1))
        elif opt in ("-q", "-A", "-N", "-o", "-j"):
            res[{"-q": "queue", "-A": "account", "-N": "name", "-o": "output",
                 "-j": "join"}[opt]] = val
        else:
            raise JobError(f"#PBS {opt}: not a directive these templates use")
    for key in ("select", "ncpus", "mpiprocs", "walltime"):
        if key not in res:
            raise JobError(f"PBS script has no {key}")
    return res
