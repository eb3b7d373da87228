"""What every ``hpclb`` command shares: logging, the error line, the early preemption signals,
the communicator start-up and the exit status of an exception.

Standard library, :mod:`hpclb.errors` and :mod:`hpclb._io` only: ``hpclb.cli`` imports this
module before it installs the signal handlers, so nothing heavy (torch, numpy, mpi4py) may load
here.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import traceback

from hpclb._io import file_in_the_way
from hpclb.errors import EXIT_FAILURE, HpclbError

__all__ = ["PATH_OPTIONS", "PREEMPTIBLE_COMMANDS", "PendingSignal", "check_path_options",
           "command_of", "error", "exit_status", "install_early_signals",
           "preempted_during_start_up", "setup_logging", "start_comm"]

# Commands whose USR2/TERM means "checkpoint and exit 75" (the job templates requeue on 75).
PREEMPTIBLE_COMMANDS = ("train", "sweep")
_SIGNALS = {signal.SIGUSR2, signal.SIGTERM}


def setup_logging(rank: int) -> None:
    """INFO from rank 0, WARNING from the others, on stderr, each line tagged with the rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[hpclb{'' if rank == 0 else f' rank {rank}'}] %(message)s",
                        stream=sys.stderr)


#: the options of every command that name where it writes (or reads data), by argparse dest
PATH_OPTIONS = {"out": "--out", "out_dir": "--out-dir", "output": "--output",
                "runs_dir": "--runs-dir", "data_dir": "--data-dir"}
_POSITIONALS = {("data", "out"): "OUT"}  # (command, dest) of a positional: its usage name


def check_path_options(args) -> str | None:
    """The one-line error for a path option of :data:`PATH_OPTIONS` given empty (it would
    silently mean the default) or under a file (``--out notes.txt/x.json``: a folder of it is a
    file, so nothing can be written there); None when every one given is usable. ``hpclb jobs``
    paths but ``--output`` are the cluster's, not checked against this machine's files."""
    for dest, flag in PATH_OPTIONS.items():
        flag = _POSITIONALS.get((args.command, dest), flag)
        value = getattr(args, dest, None)
        if value is None:
            continue
        if str(value).strip() == "":
            return (f"{flag} {value!r}: empty; give a path, or leave {flag} out for its "
                    f"default")
        blocker = None if args.command == "jobs" and dest != "output" else \
            file_in_the_way(value)
        if blocker is not None:
            return (f"{flag} {value}: {blocker} is a file, not a directory, so nothing can be "
                    f"written under it; choose another {flag}")
    return None


def error(msg: str) -> None:
    """Print ``hpclb: error: msg`` on stderr."""
    print(f"hpclb: error: {msg}", file=sys.stderr, flush=True)


class PendingSignal:
    """USR2/TERM handler for the whole life of `hpclb train` outside the training loop: the
    scheduler's signal may come during start-up (imports, data, MPI init) or after the last
    step; then it must neither kill the rank (a finished run would be reported as failed) nor
    be lost (the loop's PreemptionFlag takes ``pending`` over and checkpoints at its first step).
    """

    pending = False

    def __call__(self, _signum, _frame) -> None:
        self.pending = True


_early_signal: PendingSignal | None = None
_ignore_at_exit_registered = False


def _ignore_signals_at_exit() -> None:
    """Ignore USR2/TERM for the rest of the interpreter's life. At exit CPython puts back the
    default action (terminate) of every signal that had a Python handler, so a scheduler signal
    (or the job script's repeat of it) during MPI_Finalize and module teardown would end a run
    that already wrote its summary (or its preemption checkpoint) with 140/143; an ignored
    signal keeps SIG_IGN through that teardown."""
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def exit_promptly(status: int) -> None:
    """End the ``hpclb`` process with ``status`` (an int, or None for 0) without tearing the
    interpreter down: with torch loaded, CPython's module teardown costs 2-4 s of CPU after the
    last line (measured 3.3 s after an error message on a loaded 2-core node). First what that
    teardown would do that matters: the ``atexit`` callbacks (multiprocessing's, tqdm's, ...),
    ``logging.shutdown()``, ``MPI_Finalize`` where mpi4py initialised MPI (mpi4py finalises at
    interpreter teardown, which ``os._exit`` skips), every open file object flushed, stdout and
    stderr flushed; then ``os._exit`` (about 0.1 s here in all). Where a child process or a
    non-daemon thread is still alive, the ordinary exit (``sys.exit``) is taken: it waits for
    them."""
    import gc
    import io
    import multiprocessing
    import threading

    status = 0 if status is None else status
    alive = [t for t in threading.enumerate()
             if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if alive or multiprocessing.active_children():
        sys.exit(status)
    atexit._run_exitfuncs()
    logging.shutdown()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)  # concrete: a fast check
    for f in gc.get_objects():
        if issubclass(type(f), buffered) and not f.closed:  # type(): no __class__ lookup
            try:
                f.flush()
            except (OSError, ValueError):
                pass  # a pipe whose reader left, a file closed underneath
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def command_of(argv: list[str]) -> str | None:
    """The command of an ``hpclb`` command line: its first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def install_early_signals(argv: list[str], fresh: bool = True) -> PendingSignal | None:
    """Catch USR2/TERM from the first instruction of a preemptible command, then unblock them.

    Runs before any heavy import (torch, numpy: seconds of start-up during which the default
    action would kill the rank with 140/143); from interpreter exit on they are ignored (the work
    is done, and CPython's teardown would put the killing default back). The job templates start
    every rank with USR2 and TERM blocked (``env --block-signal``) so that a signal during
    interpreter start-up stays pending; it is delivered here, at the unblock, to the handler.
    Other commands get the default actions, unblocked. ``fresh=False`` keeps the handler main()
    installed (a flag already set stays set). Returns the handler (None for other commands).
    """
    global _early_signal, _ignore_at_exit_registered
    command = command_of(argv)
    if command in PREEMPTIBLE_COMMANDS:
        if not _ignore_at_exit_registered:  # runs after the exit hooks of later imports (LIFO)
            atexit.register(_ignore_signals_at_exit)
            _ignore_at_exit_registered = True
        if fresh or _early_signal is None or signal.getsignal(signal.SIGUSR2) is not _early_signal:
            _early_signal = PendingSignal()
        for s in _SIGNALS:
            signal.signal(s, _early_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    return _early_signal if command in PREEMPTIBLE_COMMANDS else None


def preempted_during_start_up(comm, early: PendingSignal) -> bool:
    """True on every rank when any rank got USR2/TERM before training began (one object
    allgather, taken by all ranks at the same point of start-up)."""
    return any(comm.allgather_object(bool(early.pending)))


def start_comm(backend: str, device: str = "cpu", share_gpu: bool = False):
    """The communicator of ``--backend`` on ``device`` (auto|cpu|cuda, bound before MPI/NCCL
    start) with logging set up for its rank; None (after printing why) when the launcher, the
    backend or the device do not fit, for the command to exit 2. Rank 0 warns when GPUs are
    visible but the run uses the CPU."""
    from hpclb.comm.device import gpus_idle_warning
    from hpclb.comm.world import get_communicator  # heavy (torch): after the signal handlers

    try:
        comm = get_communicator(backend, device=device, share_gpu=share_gpu)
    except (RuntimeError, ValueError) as e:
        error(str(e))
        return None
    setup_logging(comm.rank)
    if comm.rank == 0:
        warning = gpus_idle_warning(comm.device)
        if warning:
            logging.getLogger("hpclb").warning(warning)
    return comm


def exit_status(e: Exception, comm) -> int:
    """Report ``e`` and return the exit status, from the class attributes of
    :mod:`hpclb.errors` (any other exception: ``exit_code`` 1, not ``agreed``).

    ``agreed`` (every rank raised it together, e.g. a ConfigError: 2, an AgreedFailure: 1):
    rank 0 prints the message, no rank aborts. Otherwise the failing rank prints
    ``TypeName on rank r of n: message`` and aborts the whole MPI job (when there are other
    ranks) so no rank waits forever in a collective. An exception from the user's own code
    (anything but hpclb's own errors) also names the phase, the user's file:line and
    ``HPCLB_TRACEBACK=1`` (:func:`hpclb.train.usercode.describe`); under ``$HPCLB_TRACEBACK`` the
    traceback is printed (before the abort) and, at one process, the exception re-raised."""
    code = getattr(e, "exit_code", EXIT_FAILURE)
    if getattr(e, "agreed", False):
        if comm.rank == 0:
            error(str(e))
        return code
    where = f" on rank {comm.rank} of {comm.world_size}" if comm.world_size > 1 else ""
    context = ""
    if not isinstance(e, HpclbError):  # not hpclb's own: point into the user's code
        from hpclb.train.usercode import describe

        context = describe(e)
    error(f"{type(e).__name__}{where}: {e}{context}")
    if os.environ.get("HPCLB_TRACEBACK") and comm.world_size > 1:
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        sys.stderr.flush()
    if comm.world_size > 1:
        comm.abort(code)
    if os.environ.get("HPCLB_TRACEBACK"):
        raise e
    return code

