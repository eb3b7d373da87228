"""The fat tree the projection runs on: where a job's nodes sit and how many ring flows share a
link (used by the closed form and by the SimGrid replay, :mod:`hpclb.bench.simulate`).

Two levels, full bisection: leaf switches of ``LEAF_NODES`` nodes, each leaf with one uplink to
each of ``LEAF_NODES`` spine switches. Routing is static D-mod-k, as in SimGrid's ``FAT_TREE``
cluster and most InfiniBand subnet managers: a flow to node ``d`` climbs through spine
``d mod LEAF_NODES``. Flows to different nodes of one leaf therefore come down on different
links, but two flows leaving one leaf towards nodes with the same position in their leaves
share an uplink (Hoefler, Schneider, Lumsdaine, "Multistage switches are not crossbars",
Cluster 2008). A ring allreduce moves in lock step, so its speed is set by its busiest link.
"""
from __future__ import annotations

import random
from collections import Counter

__all__ = ["LEAF_NODES", "PLACEMENTS", "host_order", "ring_link_load"]

LEAF_NODES = 32
PLACEMENTS = ("contiguous", "scattered")


def host_order(nodes: int, placement: str = "contiguous", seed: int = 0) -> list[int]:
    """The fat-tree host of each of ``nodes`` ranks (ring order): ``contiguous`` (rank r on host
    r: ring neighbours share a leaf) or ``scattered`` (a random allocation drawn with ``seed``
    from ``ceil(nodes / LEAF_NODES)`` full leaves: most ring flows cross the spine). Raises
    ValueError for another placement."""
    if placement == "contiguous":
        return list(range(nodes))
    if placement != "scattered":
        raise ValueError(f"placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    leaf = min(nodes, LEAF_NODES)
    return random.Random(seed).sample(range(-(-nodes // leaf) * leaf), nodes)


def ring_link_load(order: list[int]) -> int:
    """The most ring flows (rank i to rank i+1, hosts ``order``) that share one directed link of
    the fat tree under D-mod-k routing; 1 when no two share a link."""
    up, down = Counter(), Counter()
    for i, src in enumerate(order):
        dst = order[(i + 1) % len(order)]
        if src // LEAF_NODES != dst // LEAF_NODES:
            up[src // LEAF_NODES, dst % LEAF_NODES] += 1
            down[dst % LEAF_NODES, dst // LEAF_NODES] += 1
    return max([1, *up.values(), *down.values()])
