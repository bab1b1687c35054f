"""Communication: alpha-beta models of ring collectives and point-to-point on the cluster topology.

For n ranks, S bytes, per-rank bandwidth β and per-message latency α
(shared/REFERENCES.md, "Collectives"; Thakur et al. 2005, ring algorithms):

    all-reduce                  2(n−1)·α + 2·(n−1)/n · S/β
    all-gather / reduce-scatter  (n−1)·α +   (n−1)/n · S/β      (S = the full, gathered size)
    send/recv                         α +            S/β

A group whose ranks are ``stride`` apart spans nodes when stride·n exceeds
the GPUs of a node. Its ring then crosses the inter-node network, whose
per-node bandwidth is shared by the GPUs of the node that communicate at
the same time (shared/REFERENCES.md). Every rank runs the collectives of a
mesh axis at the same moment, so all gpus_per_node GPUs of a node share it:
each gets inter_bw / gpus_per_node (on a DGX, its own NIC: 200 Gb/s of
8×200 Gb/s). NCCL's multi-ring all-reduce can do better than this for a
single group that owns whole nodes; the model does not assume it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster


@dataclass(frozen=True, kw_only=True)
class GroupLink:
    """The effective link of one process group."""

    bandwidth_bytes_per_s: float
    """Per-rank bandwidth the ring sees (its bottleneck link)."""
    latency_s: float
    """Per-message latency of the slowest hop."""
    crosses_nodes: bool
    """True when the group spans more than one node."""


def group_link(cluster: Cluster, *, size: int, stride: int) -> GroupLink:
    """Link of a group of ``size`` ranks spaced ``stride`` apart (ranks fill nodes in order)."""
    assert size >= 1 and stride >= 1
    gpn = cluster.gpus_per_node
    if size == 1 or stride * size <= gpn:
        link = cluster.intra_node
        return GroupLink(
            bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
            latency_s=link.latency_s,
            crosses_nodes=False,
        )
    per_group = cluster.inter_node.bandwidth_bytes_per_s / gpn
    return GroupLink(
        bandwidth_bytes_per_s=min(cluster.intra_node.bandwidth_bytes_per_s, per_group),
        latency_s=cluster.inter_node.latency_s,
        crosses_nodes=True,
    )


def allreduce_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring all-reduce: 2(n−1)·α + 2(n−1)/n·S/β (0 for a single rank)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * size_bytes / link.bandwidth_bytes_per_s


def allgather_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring all-gather of a ``size_bytes`` result: (n−1)·α + (n−1)/n·S/β."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    latency_s, s_per_byte = allgather_coefficients(n, link)
    return latency_s + s_per_byte * size_bytes


def allgather_coefficients(n: int, link: GroupLink) -> tuple[float, float]:
    """(latency (n−1)·α, seconds per byte (n−1)/(n·β)) of a ring all-gather or reduce-scatter;
    an all-reduce costs twice both. (0, 0) for a single rank."""
    if n <= 1:
        return 0.0, 0.0
    return (n - 1) * link.latency_s, (n - 1) / n / link.bandwidth_bytes_per_s


def reduce_scatter_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring reduce-scatter of a ``size_bytes`` input: same cost as the all-gather."""
    return allgather_time_s(size_bytes, n, link)


def p2p_time_s(size_bytes: float, link: GroupLink) -> float:
    """One send/recv: α + S/β."""
    if size_bytes <= 0:
        return 0.0
    return link.latency_s + size_bytes / link.bandwidth_bytes_per_s
