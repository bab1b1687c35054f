"""Communication: alpha-beta models of ring collectives and point-to-point on the cluster topology.

For n ranks, S bytes, per-rank bandwidth β and per-message latency α
(shared/REFERENCES.md, "Collectives"; Thakur et al. 2005, ring algorithms):

    all-reduce                  2(n−1)·α + 2·(n−1)/n · S/β
    all-gather / reduce-scatter  (n−1)·α +   (n−1)/n · S/β      (S = the full, gathered size)
    all-to-all                   (n−1)·α +   (n−1)/n · S/β      (S = what each rank holds before)
    send/recv                         α +            S/β

The all-to-all is the pairwise exchange (Thakur et al. 2005 §3.5): n − 1 steps, in each a rank
sends the S/n bytes bound for one peer; expert parallelism's dispatch and combine (rows routed
evenly: S/n to each expert rank, Lepikhin et al. 2020 GShard §2.2).

A group whose ranks are ``stride`` apart spans nodes when stride·n exceeds
the GPUs of a node. Its ring then crosses the inter-node network, whose
per-node bandwidth is shared by the GPUs of the node that communicate at
the same time (shared/REFERENCES.md). Every rank runs the collectives of a
mesh axis at the same moment, so all gpus_per_node GPUs of a node share it:
each gets inter_bw / gpus_per_node (on a DGX, its own NIC: 200 Gb/s of
8×200 Gb/s). NCCL's multi-ring all-reduce can do better than this for a
single group that owns whole nodes; the model does not assume it.

Measured collectives (``autopar profile-comm``, attached with ``Cluster.from_profile``)
replace these formulas for the collectives and group sizes they cover: each fit is
time(S) = a + b·S with a and b fitted to the timings, S the same full size as above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.cluster import Cluster
from autopar.cost_models import nccl
from autopar.gpus import arch_of
from autopar.measurements import COLLECTIVES
from autopar.mesh import Axis

NVLINK_MIN_BYTES_PER_S = 100e9
"""An intra-node link faster than this is NVLink (PCIe 5.0 x16 moves 64 GB/s each way), and its
GPUs share an NVSwitch (every preset's 8-GPU NVLink node does)."""

BULK_BYTES = 2**28
"""A message large enough that bandwidth rules (256 MiB): where a collective's bytes are compared
per byte without one message's size at hand (expert against dense gradient reductions)."""


@dataclass(frozen=True, kw_only=True)
class GroupLink:
    """The effective link of one process group."""

    bandwidth_bytes_per_s: float
    """Per-rank bandwidth the ring sees (its bottleneck link)."""
    latency_s: float
    """Per-message latency of the slowest hop."""
    crosses_nodes: bool
    """True when the group spans more than one node."""
    measured: tuple[tuple[str, float, float], ...] = ()
    """(collective, a, b) fits time(S) = a + b·S measured for this group (profile-comm)."""
    nccl: nccl.NcclGroup | None = None
    """The group as NCCL's tuning model sees it (NVIDIA GPUs), else None: α-β rings."""

    def fit(self, collective: str) -> tuple[float, float] | None:
        """The measured (a, b) of ``collective`` on this group, or None."""
        for name, a, b in self.measured:
            if name == collective:
                return a, b
        return None


def group_link(cluster: Cluster, axis: Axis) -> GroupLink:
    """Link of a group of ``axis.size`` ranks spaced ``axis.stride`` apart (ranks fill nodes in
    order: ``Axis.crosses_nodes``), with the cluster's measured fits for groups of this size
    attached."""
    size, gpn = axis.size, cluster.gpus_per_node
    crosses = axis.crosses_nodes(gpn)
    measured: list[tuple[str, float, float]] = []
    if cluster.comm_profile is not None and size > 1:
        for name in COLLECTIVES:
            f = cluster.comm_profile.fit(
                name, group_size=2 if name == "send_recv" else size, crosses_nodes=crosses
            )
            if f is not None:
                measured.append((name, f.latency_s, f.seconds_per_byte))
    group = nccl_group(cluster, axis)
    if not crosses:
        link = cluster.intra_node
        return GroupLink(
            bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
            latency_s=link.latency_s,
            crosses_nodes=False,
            measured=tuple(measured),
            nccl=group,
        )
    per_group = cluster.inter_node.bandwidth_bytes_per_s / gpn
    return GroupLink(
        bandwidth_bytes_per_s=min(cluster.intra_node.bandwidth_bytes_per_s, per_group),
        latency_s=cluster.inter_node.latency_s,
        crosses_nodes=True,
        measured=tuple(measured),
        nccl=group,
    )


def nccl_group(cluster: Cluster, axis: Axis) -> nccl.NcclGroup | None:
    """``axis``'s groups as NCCL's tuning model sees them, on a cluster of NVIDIA GPUs (None
    otherwise): ranks per node from the axis's stride (``Axis.per_node``), NVLink and NVSwitch
    where the intra-node link is faster than PCIe can be (``NVLINK_MIN_BYTES_PER_S``), each GPU
    one NIC of the node's network (a DGX's eight rails)."""
    arch = arch_of(cluster.device.name)
    if arch is None or axis.size <= 1:
        return None
    gpn = cluster.gpus_per_node
    per_node = axis.per_node(gpn)
    fast = cluster.intra_node.bandwidth_bytes_per_s >= NVLINK_MIN_BYTES_PER_S
    return nccl.NcclGroup(
        ranks=axis.size,
        nodes=-(-axis.size // per_node),  # a group not aligned to nodes touches one more
        arch=arch,
        nvlink=fast,
        nvswitch=fast,
        intra_bus_bytes_per_s=cluster.intra_node.bandwidth_bytes_per_s,
        nic_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s / gpn,
    )


def unmeasured(link: GroupLink, n: int, collectives: tuple[str, ...]) -> list[str]:
    """The ``collectives`` this group of n ranks uses that were not measured (for notes)."""
    if n <= 1:
        return []
    return [c for c in collectives if link.fit(c) is None]


def coefficients(collective: str, n: int, link: GroupLink, size_bytes: float) -> tuple[float, float]:
    """(a, b) with time(S) = a + b·S for ``collective`` over n ranks, as it runs a message of
    ``size_bytes``: the measured fit (for a ``_bf16`` reduction not measured, the fp32 one's: the
    same bytes); else on NVIDIA GPUs NCCL's (``nccl``: the algorithm and protocol NCCL picks at
    this size, its latency and bandwidth); else the ring's (n−1)·α and (n−1)/(n·β) for an
    all-gather or reduce-scatter, twice both for an all-reduce, (α, 1/β) for a send/recv.
    (0, 0) for a single rank."""
    if n <= 1:
        return 0.0, 0.0
    base = collective.removesuffix("_bf16")  # on bf16 tensors: the same bytes, where not measured
    got = link.fit(collective) or link.fit(base)
    if got is not None:
        return got
    collective = base
    if link.nccl is not None:
        if collective == "send_recv":  # a pipeline's hop: across nodes wherever its group is
            return nccl.p2p_terms(replace(link.nccl, ranks=2, nodes=2 if link.crosses_nodes else 1))
        group = link.nccl
        if n != group.ranks:
            raise ValueError(f"{collective} over {n} ranks priced on a group of {group.ranks}")
        if collective == "all_to_all":
            return nccl.all_to_all_terms(group)
        pick = nccl.choose(collective, size_bytes, group)
        return pick.latency_s, pick.seconds_per_byte
    if collective == "send_recv":
        return link.latency_s, 1 / link.bandwidth_bytes_per_s
    lat, spb = (n - 1) * link.latency_s, (n - 1) / n / link.bandwidth_bytes_per_s
    return (2 * lat, 2 * spb) if collective == "all_reduce" else (lat, spb)


def _time_s(collective: str, size_bytes: float, n: int, link: GroupLink) -> float:
    if n <= 1 or size_bytes <= 0:
        return 0.0
    a, b = coefficients(collective, n, link, size_bytes)
    return a + b * size_bytes


def allreduce_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring all-reduce: 2(n−1)·α + 2(n−1)/n·S/β (0 for a single rank), or the measured fit."""
    return _time_s("all_reduce", size_bytes, n, link)


def allgather_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring all-gather of a ``size_bytes`` result: (n−1)·α + (n−1)/n·S/β, or the measured fit."""
    return _time_s("all_gather", size_bytes, n, link)


def reduce_scatter_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Ring reduce-scatter of a ``size_bytes`` input: the all-gather's cost, or the measured fit."""
    return _time_s("reduce_scatter", size_bytes, n, link)


def all_to_all_time_s(size_bytes: float, n: int, link: GroupLink) -> float:
    """Pairwise-exchange all-to-all of the ``size_bytes`` each rank holds: (n−1)·α + (n−1)/n·S/β
    (the all-gather's coefficients: n − 1 messages of S/n bytes each), or the measured fit."""
    return _time_s("all_to_all", size_bytes, n, link)


def p2p_time_s(size_bytes: float, link: GroupLink) -> float:
    """One send/recv: α + S/β, or the measured fit."""
    return _time_s("send_recv", size_bytes, 2, link)
