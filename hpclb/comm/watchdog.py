"""Stall watchdog: report a collective that waits too long, naming the ranks that have not joined.

Every rank numbers the collectives it starts (``entered()``: 1, 2, 3, ... in the same order on
every rank, because every rank starts the same collectives in the same order). While a thread
waits for one (``waiting(seq, ...)``), a daemon thread watches the clock; after ``timeout_s`` it
asks every other rank, over the communicator's side channel (MPI point-to-point on a duplicate
communicator, or the torch.distributed store), for the number of the last collective it started.
A rank that has not reached ``seq``, or does not answer within the grace period, has not joined.
The report goes to ``on_stall`` (default: one line on stderr) and repeats every ``timeout_s``
while the wait lasts; after ``abort_s`` the watchdog ends the job (``comm.abort``).

The report tells a *mismatched* collective from a *slow* one. Every rank remembers the labels of
its last :data:`HISTORY` collectives and answers with the label it gave number ``seq`` and the
one it waits in: a peer whose collective #n has a different label than this rank's #n (two
``GradientSync`` objects or optimizers on one communicator, a rank that skipped a step) is in a
different collective, and waiting will not fix that; a peer that has not reached ``seq`` (still
computing, or waiting in an earlier collective that matches) is slow, or all ranks have joined
and the transfer itself is slow.

Every rank's watchdog thread answers such questions, also while its main thread computes,
sleeps or waits elsewhere; a rank that cannot answer (dead, or stuck in native code that holds
the Python GIL) is named as "no reply". A watchdog that stops (its process exits) tells the
peers the last collective it started: a peer whose process exited before starting ``seq``
(it finished after fewer collectives, e.g. fewer epochs or larger batches, or it raised) is
named as mismatched, and since the wait can never end, the report is followed by
``comm.abort``.
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from hpclb.comm.base import Communicator

__all__ = ["ABORT_ON_EXCEPTION_ENV", "DEFAULT_POLL_S", "HISTORY", "StallReport",
           "install_abort_on_exception", "print_report", "StallWatchdog",
           "watchdog_for"]

DEFAULT_POLL_S = 1.0
HISTORY = 1024  # labels of this many recent collectives, to compare with the peers'


@dataclass
class StallReport:
    """What one rank saw when a collective stalled.

    ``seq``/``label``: the collective; ``rank``: the reporting rank; ``waited_s``: seconds it has
    waited; ``missing``: ranks that have not joined (None when unknown: no side channel);
    ``mismatched``: ranks whose collective of the same number (or the one they wait in) has a
    different label, i.e. they are in a different collective; ``verdict``: ``"mismatched"``,
    ``"not joined"`` (slow peers), ``"slow"`` (all joined: the transfer is slow) or
    ``"unknown"``; ``details``: rank -> what that rank said (or that it did not answer);
    ``message``: one line.
    """

    seq: int
    label: str
    rank: int
    waited_s: float
    missing: list[int] | None
    details: dict[int, str] = field(default_factory=dict)
    message: str = ""
    mismatched: list[int] = field(default_factory=list)
    verdict: str = "unknown"


def print_report(report: StallReport) -> None:
    """The default ``on_stall``: the report's message on stderr."""
    print(report.message, file=sys.stderr, flush=True)


@dataclass
class _Wait:
    seq: int
    label: str
    timeout_s: float
    on_stall: Callable[[StallReport], None]
    abort_s: float | None
    since: float
    next_report: float
    query_id: tuple | None = None
    query_deadline: float = 0.0
    reports: int = 0


class StallWatchdog:
    """One per communicator (:func:`watchdog_for`); thread-safe.

    Args: ``comm``; ``poll_s`` (seconds between the thread's looks at the clock and at incoming
    questions; lowered automatically to a quarter of the smallest timeout registered).
    """

    def __init__(self, comm: Communicator, poll_s: float = DEFAULT_POLL_S):
        self.comm = comm
        self.channel = comm.side_channel() if comm.world_size > 1 else None
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._ids = itertools.count()
        self._seq = 0
        self._entered_label = ""
        self._history: dict[int, str] = {}  # seq -> label, the last HISTORY collectives
        self._entered_at = time.monotonic()
        self._left_at = time.monotonic()
        self._replies: dict[tuple, dict[int, dict]] = {}
        self._exited: dict[int, dict] = {}  # rank -> its last state, sent as its process exited
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what this rank has done ---------------------------------------------------------------
    def entered(self, label: str) -> int:
        """Record that this rank starts its next collective (``label`` describes it); returns
        its sequence number."""
        with self._lock:
            self._seq += 1
            self._entered_label, self._entered_at = label, time.monotonic()
            self._history[self._seq] = label
            self._history.pop(self._seq - HISTORY, None)
            return self._seq

    @property
    def seq(self) -> int:
        """The number of the last collective this rank started."""
        return self._seq

    def register_timeout(self, timeout_s: float) -> None:
        """Make the thread look often enough for ``timeout_s`` (seconds) and start it."""
        self._poll_s = max(0.02, min(self._poll_s, timeout_s / 4))
        self.start()

    @contextmanager
    def waiting(self, seq: int, label: str, timeout_s: float,
                on_stall: Callable[[StallReport], None] | None = None,
                abort_s: float | None = None) -> Iterator[None]:
        """Watch the calling thread's wait for collective ``seq``: report after ``timeout_s``
        seconds (then every ``timeout_s``), abort the job after ``abort_s`` (None: never)."""
        now = time.monotonic()
        w = _Wait(seq, label, timeout_s, on_stall or print_report, abort_s, now, now + timeout_s)
        key = next(self._ids)
        with self._lock:
            self._waits[key] = w
        try:
            yield
        finally:
            with self._lock:
                del self._waits[key]
                if not self._waits:
                    self._left_at = time.monotonic()

    # -- the thread -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpclb-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (before MPI is finalised: it may be inside an MPI call)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._poll_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._tick()
            except Exception as e:  # the watchdog must never take the job down by itself
                print(f"hpclb: rank {self.comm.rank}: stall watchdog error: {e!r}",
                      file=sys.stderr, flush=True)
        if self.channel is not None:  # tell the peers: a wait for this rank is a lost cause
            try:
                self.channel.send({"kind": "exited", **self._state()})
            except Exception:  # noqa: BLE001 (MPI may be going down)
                pass

    def _state(self, asked_seq: int | None = None) -> dict:
        now = time.monotonic()
        with self._lock:
            waits = sorted(self._waits.values(), key=lambda w: w.seq)
            state = {"entered": self._seq, "entered_label": self._entered_label,
                     "entered_ago_s": now - self._entered_at,
                     "label_at_seq": self._history.get(asked_seq)}
            if waits:
                state["waiting"] = (waits[0].seq, waits[0].label, now - waits[0].since)
            else:
                state["idle_s"] = now - self._left_at
        return state

    def _tick(self) -> None:
        now = time.monotonic()
        if self.channel is not None:
            for src, msg in self.channel.poll():
                if msg.get("kind") == "ask":
                    self.channel.send({"kind": "state", "id": msg["id"],
                                       **self._state(msg.get("seq"))}, src)
                elif msg.get("kind") == "state":
                    self._replies.setdefault(msg["id"], {})[src] = msg
                elif msg.get("kind") == "exited":
                    self._exited[src] = msg
        with self._lock:
            waits = list(self._waits.values())
        for w in waits:
            if w.query_id is not None:
                got = self._replies.get(w.query_id, {})
                if len(got) >= self.comm.world_size - 1 or now >= w.query_deadline:
                    self._report(w, self._replies.pop(w.query_id, {}), now)
            elif now >= w.next_report:
                if self.channel is None:
                    self._report(w, None, now)
                else:
                    w.query_id = (self.comm.rank, w.seq, w.reports)
                    w.query_deadline = now + max(4 * self._poll_s, 1.0)
                    self.channel.send({"kind": "ask", "id": w.query_id, "seq": w.seq})
            if w.abort_s is not None and now - w.since >= w.abort_s and w.reports:
                print(f"hpclb: rank {self.comm.rank}: aborting the job: collective #{w.seq} "
                      f"'{w.label}' has waited {now - w.since:.1f} s (abort after "
                      f"{w.abort_s:g} s)", file=sys.stderr, flush=True)
                self.comm.abort(1)

    def _report(self, w: _Wait, replies: dict[int, dict] | None, now: float) -> None:
        waited = now - w.since
        me = self.comm.rank
        head = (f"hpclb: rank {me}: collective #{w.seq} '{w.label}' has waited {waited:.1f} s "
                f"(stall timeout {w.timeout_s:g} s)")
        details: dict[int, str] = {}
        mismatched: list[int] = []
        if replies is None:
            missing = None
            msg = f"{head}; cannot tell which ranks are missing (no side channel: one process, " \
                  f"or MPI without MPI_THREAD_MULTIPLE)"
        else:
            missing, mismatched = self._classify(w, replies, details)
            msg = self._message(head, w, missing, mismatched, details)
        w.reports += 1
        w.query_id = None
        w.next_report = now + w.timeout_s
        verdict = ("unknown" if replies is None else "mismatched" if mismatched else
                   "not joined" if missing else "slow")
        report = StallReport(w.seq, w.label, me, waited, missing, details, msg,
                             mismatched if replies is not None else [], verdict)
        try:
            w.on_stall(report)
        except Exception as e:
            print(f"{msg}\n(on_stall raised {e!r})", file=sys.stderr, flush=True)
        gone = [r for r in mismatched if r in self._exited]
        if gone:  # the collective can never complete: end the job now, not after abort_s
            print(f"hpclb: rank {me}: aborting the job: rank(s) {', '.join(map(str, gone))} "
                  f"exited without starting collective #{w.seq} '{w.label}'", file=sys.stderr,
                  flush=True)
            self.comm.abort(1)

    def _classify(self, w: _Wait, replies: dict[int, dict],
                  details: dict[int, str]) -> tuple[list[int], list[int]]:
        """(ranks that have not joined #seq, ranks in a different collective); fills
        ``details`` with one phrase per other rank."""
        missing, mismatched = [], []
        for r in range(self.comm.world_size):
            if r == self.comm.rank:
                continue
            done = self._exited.get(r)
            if done is not None and done["entered"] < w.seq:
                missing.append(r)
                mismatched.append(r)
                details[r] = (f"has exited: it left after its collective #{done['entered']} "
                              f"'{done['entered_label']}' and will never start #{w.seq}")
                continue
            st = replies.get(r)
            if st is None:
                missing.append(r)
                details[r] = "no reply (dead, or stuck in code that holds the GIL)"
                continue
            theirs = st.get("label_at_seq")
            if st["entered"] >= w.seq:
                if theirs is not None and theirs != w.label:
                    mismatched.append(r)
                    details[r] = f"started #{w.seq} as '{theirs}'"
                else:
                    details[r] = f"joined (started #{st['entered']})"
                continue
            missing.append(r)
            if "waiting" in st:
                s, lab, t = st["waiting"]
                mine = self._history.get(s)
                if mine is not None and mine != lab:
                    mismatched.append(r)
                    details[r] = (f"is waiting in #{s} '{lab}' for {t:.1f} s, where this rank's "
                                  f"#{s} was '{mine}'")
                    continue
                where = f"is waiting in #{s} '{lab}' for {t:.1f} s (behind: slow)"
            else:
                where = (f"is not communicating ({st['idle_s']:.1f} s since its last wait: "
                         f"still computing, slow)")
            last = (f"last started #{st['entered']} '{st['entered_label']}' "
                    f"{st['entered_ago_s']:.1f} s ago") if st["entered"] else \
                "has started no watched collective yet"
            details[r] = f"{last} and {where}"
        return missing, mismatched

    def _message(self, head: str, w: _Wait, missing: list[int], mismatched: list[int],
                 details: dict[int, str]) -> str:
        if mismatched:
            return (f"{head}; MISMATCHED collective, not a slow one: rank(s) "
                    f"{', '.join(map(str, mismatched))} are in a different collective or have "
                    f"exited: " + "; ".join(f"rank {r} {details[r]}" for r in mismatched)
                    + f" (this rank's #{w.seq} is '{w.label}'). The ranks issue collectives in "
                    f"different orders or numbers (e.g. two GradientSyncs or optimizers on one "
                    f"communicator, a step skipped on some ranks, or ranks given different "
                    f"settings such as the number of epochs or the batch size); waiting will not "
                    f"resolve it")
        if missing:
            return (f"{head}; slow, not mismatched: rank(s) {', '.join(map(str, missing))} have "
                    f"not joined it yet: " + "; ".join(f"rank {r} {details[r]}" for r in missing))
        return (f"{head}; all {self.comm.world_size} ranks have joined it with the same "
                f"collective, so the collective itself is slow (message size, network) rather "
                f"than stalled or mismatched")


_watchdogs: "weakref.WeakKeyDictionary[Communicator, StallWatchdog]" = weakref.WeakKeyDictionary()
_watchdogs_lock = threading.Lock()


def watchdog_for(comm: Communicator) -> StallWatchdog:
    """The watchdog of ``comm`` (created on first use, which every rank must reach together:
    it may create the side channel, a collective). Its thread is stopped at interpreter exit,
    before mpi4py finalises MPI."""
    with _watchdogs_lock:
        wd = _watchdogs.get(comm)
        if wd is None:
            wd = _watchdogs[comm] = StallWatchdog(comm)
            atexit.register(wd.stop)
        return wd


ABORT_ON_EXCEPTION_ENV = "HPCLB_ABORT_ON_EXCEPTION"


def install_abort_on_exception(comm: Communicator) -> bool:
    """Make an uncaught exception on this rank end every rank of the job (library mode).

    Installs ``sys.excepthook`` and ``threading.excepthook``: the exception's traceback and one
    line ``hpclb: rank r of n: uncaught TypeName: message; aborting every rank`` go to stderr,
    then ``comm.abort(1)`` (``MPI_Abort``), so the other ranks do not wait forever in their next
    collective. Idempotent; a world of one rank is left alone. Opt out with
    ``$HPCLB_ABORT_ON_EXCEPTION=0`` (then this returns False and installs nothing). Returns True
    when the hooks are in place.
    """
    if comm.world_size == 1 or os.environ.get(ABORT_ON_EXCEPTION_ENV, "1").strip().lower() in (
            "0", "false", "no", "off"):
        return False
    if getattr(sys.excepthook, "_hpclb_abort", False):
        return True
    previous_sys, previous_thread = sys.excepthook, threading.excepthook

    def abort(kind: str, exc_type, exc, tb, previous) -> None:
        previous(*((exc_type, exc, tb) if kind == "main" else (tb,)))
        print(f"hpclb: rank {comm.rank} of {comm.world_size}: uncaught {exc_type.__name__}"
              f"{' in thread ' + kind if kind != 'main' else ''}: {exc}; aborting every rank "
              f"(opt out: {ABORT_ON_EXCEPTION_ENV}=0)", file=sys.stderr, flush=True)
        comm.abort(1)

    def sys_hook(exc_type, exc, tb) -> None:  # SystemExit never gets here: exit as asked
        abort("main", exc_type, exc, tb, previous_sys)

    def thread_hook(args) -> None:
        if args.exc_type is SystemExit:
            return previous_thread(args)
        name = args.thread.name if args.thread is not None else "?"
        abort(name, args.exc_type, args.exc_value, args, previous_thread)

    sys_hook._hpclb_abort = True
    sys.excepthook, threading.excepthook = sys_hook, thread_hook
    return True
