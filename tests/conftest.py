"""Shared fixtures. MPI-marked tests run under `mpirun -n N python -m pytest --with-mpi`;
they must pass at any world size, and share verdicts so one failing rank cannot hang another."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpclb.comm.launcher import remove_stale_session_dirs

REPO = Path(__file__).resolve().parents[1]
_LEFT_BEHIND: list[str] = []


@pytest.fixture(autouse=True)
def _no_left_behind_mpirun_sessions(request):
    """Remove the session directories of ``mpirun`` processes that are gone before and after
    every test, and name the tests that left some (in the terminal summary). A SIGKILLed
    ``mpirun`` leaves ``$TMPDIR/ompi.<pid>`` behind, and a later ``mpirun`` given the same
    process id fails at start-up ("The PMIx server's listener thread failed to start"):
    ``hpclb/comm/launcher.py``."""
    remove_stale_session_dirs()
    yield
    if remove_stale_session_dirs():
        _LEFT_BEHIND.append(request.node.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _LEFT_BEHIND:
        terminalreporter.write_sep("-", "mpirun session directories left behind (removed)")
        for nodeid in _LEFT_BEHIND:
            terminalreporter.write_line(nodeid)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The staged real MNIST (`make data`); tests that need it skip with the fix otherwise."""
    root = Path(os.environ.get("HPCLB_DATA", REPO / "data")) / "mnist"
    if not (root / "train-images-idx3-ubyte").is_file():
        pytest.skip(f"real MNIST not staged in {root}; run `make data`")
    return root


@pytest.fixture(scope="session")
def comm():
    """The world communicator (mpi under mpirun, else self); checks HPCLB_EXPECT_WORLD_SIZE."""
    from hpclb.comm.world import get_communicator

    c = get_communicator("auto")
    expected = os.environ.get("HPCLB_EXPECT_WORLD_SIZE")
    if expected is not None and c.world_size != int(expected):
        pytest.fail(f"world size {c.world_size}, expected {expected}: the mpirun belongs to a "
                    f"different MPI than mpi4py's")
    return c


def all_ranks_ok(comm, ok: bool, what: str) -> None:
    """Fail on every rank when any rank's check failed (no rank is left in a collective)."""
    verdicts = comm.allgather_object((bool(ok), what))
    bad = [f"rank {r}: {w}" for r, (v, w) in enumerate(verdicts) if not v]
    assert not bad, "; ".join(bad)


@pytest.fixture
def in_process(capsys):
    """``run(*argv) -> (rc, stderr)`` through :func:`hpclb.cli.main` in this process; the signal
    handlers `hpclb train` installs are put back afterwards."""
    import signal

    from hpclb import cli
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}

    def run(*argv):
        rc = cli.main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return rc, err

    yield run
    for s, h in saved.items():
        signal.signal(s, h)
