"""The stall report tells a mismatched collective (a peer in a different collective: same
number, other label) from a slow one (peers not there yet, or the transfer itself); scripted
peers answer over a fake side channel, as in test_parallel_unit."""
from __future__ import annotations

import time

import pytest

from hpclb.comm.base import SideChannel
from hpclb.comm.testing import ScaledComm
from hpclb.comm.watchdog import HISTORY, StallWatchdog

pytestmark = pytest.mark.timeout(60, method="thread")
G = "step 3 gradient bucket 1/2 (0.50 MiB float32, 4 tensors from gen.fc.weight)"
D = "step 3 gradient bucket 1/1 (0.10 MiB float32, 2 tensors from disc.fc.weight)"


class ScriptedPeers(SideChannel):
    """Answers every question with the given ranks' states (``label_at_seq`` as given)."""

    def __init__(self, states):
        self.states, self.inbox, self.asked = states, [], []

    def send(self, obj, dest=None):
        if obj.get("kind") == "ask":
            self.asked.append(obj["seq"])
            self.inbox += [(r, {"kind": "state", "id": obj["id"], **st})
                           for r, st in self.states.items()]

    def poll(self):
        out, self.inbox = self.inbox, []
        return out


def stall(states: dict, world: int, labels: list[str]):
    """This rank enters ``labels`` as its collectives and waits in the last one until the
    first report; returns (report, the seq the peers were asked about)."""
    peers = ScriptedPeers(states)
    wd = StallWatchdog(ScaledComm(world, side=peers))
    wd.register_timeout(0.1)
    reports = []
    try:
        for lab in labels:
            seq = wd.entered(lab)
        with wd.waiting(seq, labels[-1], 0.1, on_stall=reports.append):
            deadline = time.monotonic() + 10
            while not reports and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        wd.stop()
    assert reports, "no stall report"
    return reports[0], peers.asked[0]


def test_peer_in_a_different_collective_of_the_same_number_is_mismatched():
    """Two GradientSyncs on one communicator: rank 1's #2 is the discriminator's bucket while
    this rank's #2 is the generator's; both have 'joined' #2, yet it is not slow."""
    r, asked = stall({1: {"entered": 2, "entered_label": D, "entered_ago_s": 0.2,
                          "waiting": (2, D, 0.2), "label_at_seq": D}}, 2, ["warm-up", G])
    assert asked == 2
    assert r.verdict == "mismatched" and r.mismatched == [1] and r.missing == []
    assert "MISMATCHED collective, not a slow one" in r.message
    assert f"rank 1 started #2 as '{D}'" in r.message and f"this rank's #2 is '{G}'" in r.message
    assert "message size, network" not in r.message


def test_peer_waiting_in_an_earlier_collective_with_another_label_is_mismatched():
    r, _ = stall({1: {"entered": 1, "entered_label": D, "entered_ago_s": 1.0,
                      "waiting": (1, D, 1.0), "label_at_seq": None}}, 2, [G, "metrics"])
    assert r.verdict == "mismatched" and r.mismatched == [1] and r.missing == [1]
    assert f"is waiting in #1 '{D}' for 1.0 s, where this rank's #1 was '{G}'" in r.message


def test_peers_not_there_yet_are_slow_not_mismatched():
    """Rank 1 computes (no wait), rank 2 waits in #1 which matches this rank's #1 (it is
    behind), rank 3 does not answer: three kinds of 'not joined', none mismatched."""
    r, _ = stall({1: {"entered": 1, "entered_label": G, "entered_ago_s": 2.0, "idle_s": 1.5,
                      "label_at_seq": None},
                  2: {"entered": 1, "entered_label": G, "entered_ago_s": 2.0,
                      "waiting": (1, G, 2.0), "label_at_seq": None}}, 4, [G, D])
    assert r.verdict == "not joined" and r.mismatched == [] and r.missing == [1, 2, 3]
    assert "slow, not mismatched: rank(s) 1, 2, 3 have not joined it yet" in r.message
    assert "still computing, slow" in r.details[1] and "(behind: slow)" in r.details[2]
    assert "no reply" in r.details[3]


def test_all_joined_with_the_same_collective_is_a_slow_transfer():
    r, _ = stall({1: {"entered": 2, "entered_label": G, "entered_ago_s": 0.3,
                      "waiting": (2, G, 0.3), "label_at_seq": G}}, 2, ["x", G])
    assert r.verdict == "slow" and r.missing == [] and r.mismatched == []
    assert "collective itself is slow (message size, network)" in r.message


def test_history_is_bounded():
    wd = StallWatchdog(ScaledComm(1))
    for i in range(HISTORY + 10):
        wd.entered(f"c{i + 1}")
    assert len(wd._history) == HISTORY and wd._history[HISTORY + 10] == f"c{HISTORY + 10}"
    assert 10 not in wd._history


class _Aborts(ScaledComm):
    def abort(self, code: int = 1) -> None:
        self.aborted = code


def test_a_peer_that_exited_before_this_collective_is_mismatched_and_the_job_ends():
    """Rank 1's watchdog said, as its process exited, that it had started #1 only (fewer
    epochs or larger batches than this rank): while this rank waits in #2 the report names it
    as exited, a mismatch, and ends the job (the wait could never end) without abort_s."""
    peers = ScriptedPeers({})
    peers.inbox.append((1, {"kind": "exited", "entered": 1, "entered_label": G,
                            "entered_ago_s": 0.5, "idle_s": 0.5, "label_at_seq": None}))
    comm = _Aborts(2, side=peers)
    comm.aborted = None
    wd = StallWatchdog(comm)
    wd.register_timeout(0.1)
    reports = []
    try:
        wd.entered(G)
        with wd.waiting(wd.entered(D), D, 0.1, on_stall=reports.append):
            deadline = time.monotonic() + 10
            while comm.aborted is None and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        wd.stop()
    r = reports[0]
    assert r.verdict == "mismatched" and r.mismatched == [1] and r.missing == [1]
    assert f"rank 1 has exited: it left after its collective #1 '{G}' and will never start " \
           f"#2" in r.message
    assert "no reply" not in r.message and comm.aborted == 1


def test_a_stopping_watchdog_tells_its_peers():
    peers = ScriptedPeers({})
    sent = []
    peers.send = lambda obj, dest=None: sent.append(obj)
    wd = StallWatchdog(ScaledComm(2, side=peers))
    wd.register_timeout(0.1)
    wd.entered(G)
    wd.stop()
    assert sent and sent[-1]["kind"] == "exited" and sent[-1]["entered"] == 1
    assert sent[-1]["entered_label"] == G
