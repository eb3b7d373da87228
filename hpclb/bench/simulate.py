"""Replay of one training step's gradient sync on SimGrid (``hpclb bench model --simulate``).

SimGrid (Casanova et al., JPDC 2014; https://simgrid.org) is an existing flow-level network
simulator whose sharing model (max-min bandwidth sharing over each link a flow crosses) has
been validated against packet-level simulation and real networks (Velho et al., TOMACS 2013).
This module gives it hpclb's exact schedule and lets it time the communication:

* **Platform**: ``nodes`` hosts on a two-level fat tree (SimGrid's ``FAT_TREE`` cluster,
  D-mod-k routing, :mod:`hpclb.bench.fattree`): leaf switches of up to 32 nodes, as many spine
  switches as a leaf has nodes (full bisection); the job's nodes contiguous or scattered. Every
  link runs at ``link_gbps`` x ``link_efficiency`` with ``hop_latency_s`` per link, full duplex
  (``SPLITDUPLEX``); network model ``CM02`` (plain max-min sharing; the default ``LV08``
  carries TCP-calibrated factors that do not describe InfiniBand or RoCE).
* **Schedule**: the buckets of :func:`hpclb.sync.buckets.plan_buckets` in the order GradientSync
  reduces them, each released at the moment its last gradient is ready (``ready_s``, from the
  backward profile, :mod:`hpclb.bench.schedule`), reduced one after another (hpclb's
  communication thread and NCCL's stream both run one collective at a time).
* **Allreduce of one bucket** (hierarchical, as NCCL and Horovod run it): reduce-scatter inside
  the node over NVLink, a ring allreduce across the nodes, allgather inside the node. The
  NVLink phases are closed-form sleeps (they share no link with the network); the ring runs on
  SimGrid: every node sends to the next one and receives from the previous one, step after
  step, each step paying ``alpha_sw_s`` of software before its message.

Simplifications (documented in docs/projection.md): the node's 4 GPUs run 4 rings on a quarter
of the bucket each; they cross the same NIC and links at the same time, so one ring of the whole
bucket stands for them (the same bytes on every link, at the same moments). The ``2 (N - 1)``
ring steps of a bucket are grouped into at most ``max_messages`` messages per node, each carrying
its steps' bytes, paying their software cost and the latency of the steps it stands for; the
ring's step-by-step dependency between neighbours stays. ``tests/test_simulate.py`` checks that
the grouping does not move the result by more than 1 %.

The simulation runs in a child process (``python -m hpclb.bench.simulate``: JSON in, JSON out):
SimGrid's engine is one per process. Without SimGrid, :func:`require` raises
:class:`SimulatorMissing` with the command that installs it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpclb.bench.fattree import LEAF_NODES, host_order

__all__ = ["DIST_PACKAGES", "INSTALL_HINT", "SimSetting", "SimulatorMissing", "available",
           "require", "simulate_many"]

#: where Debian's python3-simgrid lives; HPCLB_SIMGRID_PATH names another directory
DIST_PACKAGES = os.environ.get("HPCLB_SIMGRID_PATH", "/usr/lib/python3/dist-packages")
INSTALL_HINT = ("SimGrid is not importable: install Debian's python3-simgrid (3.32) with "
                "`make install-simgrid` (root: apt-get install -y python3-simgrid), or set "
                f"HPCLB_SIMGRID_PATH to the directory holding simgrid's module (looked in "
                f"{DIST_PACKAGES})")


class SimulatorMissing(RuntimeError):
    """SimGrid cannot be imported (exit 2 from the command line, with :data:`INSTALL_HINT`)."""


def _import_simgrid():
    """The ``simgrid`` module, from the environment or Debian's dist-packages; None if absent."""
    try:
        import simgrid
        return simgrid
    except ImportError:
        pass
    if Path(DIST_PACKAGES).is_dir() and DIST_PACKAGES not in sys.path:
        sys.path.append(DIST_PACKAGES)
        try:
            import simgrid
            return simgrid
        except ImportError:
            sys.path.remove(DIST_PACKAGES)
    return None


def available() -> bool:
    """Whether SimGrid imports here (checked in a child process: importing it starts threads)."""
    code = "import hpclb.bench.simulate as s, sys; sys.exit(0 if s._import_simgrid() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def require() -> None:
    """Raise :class:`SimulatorMissing` (with the install command) unless SimGrid imports."""
    if not available():
        raise SimulatorMissing(INSTALL_HINT)


@dataclass
class SimSetting:
    """One replay: ``buckets`` as ``[bytes, ready_s]`` in reduction order (bytes on the wire per
    GPU, ready_s from the step's start), the step's ``compute_s`` (s), ``nodes`` of
    ``gpus_per_node``, links of ``link_gbps`` (Gb/s) at ``link_efficiency``, ``hop_latency_s``
    per link, ``alpha_sw_s`` (s per ring-step message), NVLink ``nvlink_Bps`` (bytes/s per GPU)
    and ``alpha_nvlink_s``, at most ``max_messages`` messages per node per bucket, and the
    nodes' ``placement`` on the fat tree (:func:`hpclb.bench.fattree.host_order`, ``seed``);
    ``topology`` ``hierarchical`` or ``flat`` (one ring over all GPUs, NCCL 2's in 2017)."""
    buckets: list[list[float]]
    compute_s: float
    nodes: int
    link_gbps: float
    alpha_sw_s: float
    link_efficiency: float = 0.90
    hop_latency_s: float = 0.5e-6
    gpus_per_node: int = 4
    nvlink_Bps: float = 150e9
    alpha_nvlink_s: float = 2e-6
    max_messages: int = 8
    placement: str = "contiguous"
    seed: int = 0
    topology: str = "hierarchical"


def _platform_xml(s: SimSetting) -> str:
    """A two-level full-bisection fat tree of ``s.nodes`` hosts (one leaf when it fits)."""
    leaf = min(s.nodes, LEAF_NODES)
    leaves = -(-s.nodes // leaf)
    params = f"1;{leaf};1;1" if leaves == 1 else f"2;{leaf},{leaves};1,{leaf};1,1"
    bw = s.link_gbps * s.link_efficiency
    return (f'<?xml version="1.0"?>\n<!DOCTYPE platform SYSTEM '
            f'"https://simgrid.org/simgrid.dtd">\n<platform version="4.1">\n'
            f'<cluster id="fattree" prefix="node-" suffix="" radical="0-{leaf * leaves - 1}" '
            f'speed="1Gf" bw="{bw}Gbps" lat="{s.hop_latency_s}s" topology="FAT_TREE" '
            f'topo_parameters="{params}" sharing_policy="SPLITDUPLEX"/>\n</platform>\n')


def _groups(steps: int, max_messages: int) -> list[int]:
    """``steps`` ring steps cut into at most ``max_messages`` near-equal groups (steps each)."""
    m = max(1, min(steps, max_messages))
    return [steps // m + (1 if i < steps % m else 0) for i in range(m)]


def _node_actor(sg, s: SimSetting, rank: int, order: list[int], done: list[float]) -> None:
    """Node ``rank``: every bucket in order: wait until it is ready, reduce-scatter inside the
    node, the ring across the nodes, allgather inside the node (``flat``: one ring over every
    GPU, whose ``2 (N g - 1)`` steps each send ``1 / (N g)`` of the bucket across each node
    boundary; its hops inside a node are faster than the NIC and run within the step)."""
    N, g = s.nodes, s.gpus_per_node
    flat = s.topology == "flat"
    ring = N * g if flat else N     # ring members; a flat ring crosses each node boundary once
    nxt = sg.Mailbox.by_name(f"ring-{(rank + 1) % N}")
    mine = sg.Mailbox.by_name(f"ring-{rank}")
    same_leaf = order[rank] // LEAF_NODES == order[(rank + 1) % N] // LEAF_NODES
    route_lat = (2 if same_leaf else 4) * s.hop_latency_s
    for nbytes, ready in s.buckets:
        now = sg.Engine.clock
        if ready > now:
            sg.this_actor.sleep_for(ready - now)
        intra = 0.0 if flat else (g - 1) * s.alpha_nvlink_s + (g - 1) / g * nbytes / s.nvlink_Bps
        sg.this_actor.sleep_for(intra)
        if N > 1:
            for k in _groups(2 * (ring - 1), s.max_messages):
                sg.this_actor.sleep_for(k * s.alpha_sw_s + (k - 1) * route_lat)
                out = nxt.put_async(k, max(1, round(k * nbytes / ring)))
                mine.get()
                out.wait()
        sg.this_actor.sleep_for(intra)
    done[rank] = sg.Engine.clock


def _run(s: SimSetting) -> dict:
    """Run one replay in this process (SimGrid must import); returns the times in seconds."""
    sg = _import_simgrid()
    if sg is None:
        raise SimulatorMissing(INSTALL_HINT)
    t0 = time.perf_counter()
    e = sg.Engine(["hpclb", "--log=root.thres:critical", "--cfg=network/model:CM02",
                   "--cfg=network/crosstraffic:0"])
    with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
        f.write(_platform_xml(s))
    try:
        e.load_platform(f.name)
    finally:
        os.unlink(f.name)
    done, order = [0.0] * s.nodes, host_order(s.nodes, s.placement, s.seed)
    hosts = sorted(e.all_hosts, key=lambda h: int(h.name.split("-")[1]))
    for rank in range(s.nodes):
        sg.Actor.create(f"node-{rank}", hosts[order[rank]], _node_actor, sg, s, rank, order,
                        done)
    e.run()
    comm_end = max(done)
    step = max(s.compute_s, comm_end)
    return {"comm_end_s": comm_end, "step_s": step, "efficiency": s.compute_s / step,
            "exposed_comm_s": step - s.compute_s, "sim_wall_s": time.perf_counter() - t0}


def simulate_many(settings: list[SimSetting], timeout_s: float = 600) -> list[dict]:
    """Replay each setting on SimGrid, one child process each, at most two at a time; returns,
    in order, ``{comm_end_s, step_s, efficiency, exposed_comm_s, sim_wall_s}`` per setting
    (seconds; efficiency = compute_s / step_s). Raises :class:`SimulatorMissing` without
    SimGrid, RuntimeError when a child fails."""
    procs, out = [], []
    for s in settings:
        if len(procs) == 2:
            out.append(_collect(procs.pop(0), timeout_s))
        p = subprocess.Popen([sys.executable, "-m", "hpclb.bench.simulate"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        p.stdin.write(json.dumps(asdict(s)))
        p.stdin.close()
        procs.append(p)
    return out + [_collect(p, timeout_s) for p in procs]


def _collect(p: subprocess.Popen, timeout_s: float) -> dict:
    """The JSON result of a child started by :func:`simulate_many`."""
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        raise RuntimeError(f"SimGrid replay ran past {timeout_s:g} s") from None
    text, err = p.stdout.read(), p.stderr.read()
    if p.returncode == 2:
        raise SimulatorMissing(INSTALL_HINT)
    if p.returncode != 0:
        raise RuntimeError(f"SimGrid replay failed (exit {p.returncode}): {err.strip()[-2000:]}")
    return json.loads(text)


if __name__ == "__main__":
    try:
        result = _run(SimSetting(**json.load(sys.stdin)))
    except SimulatorMissing as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result))
