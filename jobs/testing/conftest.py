"""Before and after every job test, remove the session directories of ``mpirun`` processes that
are gone: a later ``mpirun`` given the same process id would stop at start-up ("The PMIx
server's listener thread failed to start"; ``hpclb/comm/launcher.py``)."""
import pytest

from hpclb.comm.launcher import remove_stale_session_dirs


@pytest.fixture(autouse=True)
def _no_left_behind_mpirun_sessions():
    remove_stale_session_dirs()
    yield
    remove_stale_session_dirs()
