"""Start-up checks that every rank runs and all ranks answer together.

:func:`agreed` runs a check on every rank and compares the verdicts (one allgather), so a check
that fails on one rank (a folder only it cannot see, a file it cannot read) ends every rank with
that rank's message instead of leaving the others waiting in the next collective.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

from hpclb.comm.base import Communicator
from hpclb.errors import AgreedFailure, ConfigError, HpclbError
from hpclb.train.usercode import describe

__all__ = ["agreed"]


def agreed(comm: Communicator, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank, then compare verdicts (one allgather): if any rank failed, every
    rank raises the first failing rank's error (a ConfigError stays one; the message names that
    rank and ``what`` unless every rank failed alike), so a check that passes on some ranks and
    fails on others (a folder one rank cannot see) ends the job within seconds instead of
    hanging the others in the next collective."""
    try:
        result, verdict = fn(), None
    except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
        if comm.world_size == 1:
            raise
        config = isinstance(e, ConfigError)
        context = "" if isinstance(e, HpclbError) else describe(e)  # the user's code: where
        if context and os.environ.get("HPCLB_TRACEBACK"):
            traceback.print_exc()  # only this rank holds it
        result, verdict = None, (type(e).__name__, f"{e}{context}", config)
    verdicts = comm.allgather_object(verdict) if comm.world_size > 1 else [verdict]
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if failed:
        rank, (kind, msg, config) = failed[0]
        alike = len(failed) == len(verdicts) and all(v == failed[0][1] for _, v in failed)
        where = f"rank {rank} of {comm.world_size}, {what}: " if not alike else ""
        raise (ConfigError if config else AgreedFailure)(f"{where}{msg}" if config
                                                         else f"{where}{kind}: {msg}")
    return result
