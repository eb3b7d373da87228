"""The launcher's node-local ranks against the communicator's, with real ``mpirun`` (not under
``make test-mpi``: each test starts its own job): Open MPI oversubscribing this machine numbers
the local ranks 0, 2, 1, 3 by world rank, which is a valid numbering the communicator adopts
(it was refused on two ranks while the other two hung); launcher variables that disagree on one
rank stop every rank with the same message, none left waiting."""
from __future__ import annotations

import sys

import pytest
from helpers import LAUNCH_ENV, MPIRUN, run_bounded

pytestmark = pytest.mark.timeout(150)

SCRIPT = """
import os, sys
from hpclb.comm.world import get_communicator
from hpclb.errors import ConfigError
try:
    c = get_communicator(sys.argv[1], device="cpu")
except ConfigError as e:
    print(f"REFUSED {os.environ['OMPI_COMM_WORLD_RANK']}: {e}", flush=True)
    sys.exit(2)
c.barrier()
print(f"LOCAL {c.rank} {os.environ['OMPI_COMM_WORLD_LOCAL_RANK']} {c.local_rank}", flush=True)
"""


def _launch(tmp_path, ranks, backend, wrapper=()):
    if not MPIRUN.exists():
        pytest.skip("no mpirun beside the interpreter (make install provides one)")
    script = tmp_path / "local.py"
    script.write_text(SCRIPT)
    return run_bounded([str(MPIRUN), "-n", str(ranks), *wrapper, sys.executable, str(script),
                        backend], capture_output=True, text=True, timeout=120,
                       env={**LAUNCH_ENV, "PYTHONPATH": str(__import__("conftest").REPO)})


@pytest.mark.parametrize("backend", ["mpi", "torch"], ids=["mpi-backend", "torch-backend"])
def test_the_launchers_local_numbering_is_adopted(tmp_path, backend):
    """Four ranks on this machine with mpirun's default binding: every rank's local rank is the
    one mpirun gave it (whatever its order), and the job runs a collective."""
    p = _launch(tmp_path, 4, backend)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = sorted(tuple(map(int, line.split()[1:])) for line in p.stdout.splitlines()
                  if line.startswith("LOCAL"))
    assert len(rows) == 4 and all(launcher == local for _, launcher, local in rows), rows
    assert sorted(local for *_, local in rows) == [0, 1, 2, 3]


def test_launcher_variables_that_disagree_on_one_rank_stop_every_rank(tmp_path):
    """LOCAL_RANK exported by hand on rank 1 only (it disagrees with Open MPI's): both ranks
    refuse with the message naming rank 1, and the job ends (before: rank 1 raised alone)."""
    wrapper = ("bash", "-c", 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then export LOCAL_RANK=7; '
               'fi; exec "$@"', "wrap")
    p = _launch(tmp_path, 2, "mpi", wrapper)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    refused = [line for line in p.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2, out
    assert all("unusable on 1 rank(s) (rank 1: the launcher variables disagree" in line
               for line in refused), refused
