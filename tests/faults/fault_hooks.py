"""Checkpoint-write faults for the fault matrix, installed by importing this module before
``hpclb.cli.main`` (tests/faults/conftest.py ``HOOKED``: ``python -c "...; import fault_hooks;
from hpclb.cli import main; sys.exit(main())" train ...``). No LD_PRELOAD and no tiny tmpfs
needed: the hooks wrap hpclb's own writer.

Environment:

- ``HOOK_SAVE``: the checkpoint save (1-based, counted in this process, rank 0 saves) to hit;
- ``HOOK_MODE``: ``enospc``: the write raises ``OSError(ENOSPC)`` after its first 4 KiB, as a
  full disk does; ``signal``: ``HOOK_SIGNAL`` (USR2/TERM) is sent to this process during the
  write (after its first 4 KiB; the write goes on).
"""
import errno
import os
import signal

from hpclb.train import checkpoint

_saves = {"n": 0, "bytes": 0}
_save, _write = checkpoint.CheckpointStore.save, checkpoint._HashingWriter.write


def _hit() -> bool:
    return _saves["n"] == int(os.environ.get("HOOK_SAVE", "0"))


def save(self, state, step=None):
    _saves["n"] += 1
    _saves["bytes"] = 0
    return _save(self, state, step)


def write(self, data):
    before = _saves["bytes"]
    _saves["bytes"] += len(data)
    if _hit() and before < 4096 <= _saves["bytes"]:
        mode = os.environ.get("HOOK_MODE")
        if mode == "enospc":
            self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise self.error
        if mode == "signal":
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ["HOOK_SIGNAL"]))
    return _write(self, data)


checkpoint.CheckpointStore.save = save
checkpoint._HashingWriter.write = write
