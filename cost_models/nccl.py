"""Collectives as NCCL runs them: NCCL's own tuning model, for the algorithm and protocol NCCL picks.

NCCL prices every (algorithm, protocol) pair of a collective when a communicator starts and runs
the cheapest one for each message (``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in
``src/graph/tuning.cc``; the constants below are that file's at NVIDIA/nccl commit 5067397c,
2026, in µs and GB/s there, in seconds and bytes/s here). For S bytes (the full, gathered size of
an all-gather or reduce-scatter; the buffer of an all-reduce):

    time(S) = latency(algorithm, protocol) + S / bandwidth(algorithm, protocol)

    bandwidth = bus bandwidth · conversion, bus = channels · per-channel bandwidth, refined per
        protocol (LL: half the bus, at most llMaxBw; LL128: 92%, at most a per-channel cap; tree:
        92%, at most a per-channel cap), conversion n/steps for ring and NVLS (steps = 2(n−1) for
        an all-reduce, n−1 for an all-gather or reduce-scatter) and ½ for a tree all-reduce
    ring latency = base + (steps − inter steps)·max(hop, net overhead) + inter steps·net hop,
        inter steps = 2(nodes−1) for an all-reduce, nodes−1 otherwise
    tree latency = base + 2·((ranks per node − 1)·hop + log₂(nodes)·net hop)
    NVLS latency = the NVLink hop (one node); NVLS tree = base + hop + 2·log₂(nodes)·net hop
    PAT (all-gather, reduce-scatter, one rank per node) = base + log₂(nodes)·net hop/3.5 + 2.8 µs·n

with the tree's size correction (``treeCorrectionFactor``) and the multi-node ring all-reduce's
plateau (latency × 1.4). Left out of the port, and why: the tree's × 0.85 for a balanced-tree
topology pattern and Blackwell's NVLS-tree size correction on x86 (the topology search decides
both); per-channel bandwidth is one figure inside and across nodes where NCCL's search returns
two (its ring graph makes them agree across nodes); the NVLS graph shares the ring's channels.
Algorithms: ring and tree (all-reduce), NVLS on one node and NVLS tree
across nodes where Hopper or later GPUs share an NVSwitch, PAT where each node holds one rank
of the group. CollNet (SHARP) is not assumed. Protocols: LL, LL128 (on NVLink systems only, as
NCCL enables it), Simple.

What NCCL learns from its topology search and this model takes from the cluster (``NcclGroup``):
the channels (inside a node 12 on Ampere, 16 on Hopper and later: the defaults of AutoParallel's
port of this model, meta-pytorch/autoparallel ``cost_models/nccl_cost_model.py``, a stated
assumption; across nodes 8, one per NIC, as NCCL's own tuning logs show on H100), the
bus bandwidth of a ring inside a node (the cluster's intra-node figure, an nccl-tests bus
bandwidth) and across nodes: the network interfaces of the group's ranks on one node, each GPU
its own NIC (rail-aligned rings), so a group with r ranks per node gets r NICs, never more than
NVLink carries. The CPU is taken as Intel for the LL bandwidth cap across nodes (``llMaxBws``).

All-to-all and send/recv are not in NCCL's tuning model (NCCL runs them as point-to-point
transfers over its channels): ``p2p_time_s`` and ``all_to_all_time_s`` price them with the
Simple protocol's ring hop latencies and the link the transfer crosses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.gpus import ARCHS

US = 1e-6
GB = 1e9

ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("ll", "ll128", "simple")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

# baseLatencies[algorithm][protocol] (µs)
_BASE_US = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
    "pat": (8.0, 8.0, 8.0),
}
# hwLatencies[hw][algorithm][protocol] (µs): one hop over NVLink, PCI or the network
_HOP_US = {
    "nvlink": {
        "tree": (0.6, 1.25, 4.0),
        "ring": (0.6, 1.9, 3.4),
        "nvls": (0.0, 0.0, 25.0),
        "nvls_tree": (0.0, 0.0, 25.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "pci": {
        "tree": (1.0, 1.9, 4.0),
        "ring": (1.0, 2.5, 5.7),
        "nvls": (0.0, 0.0, 0.0),
        "nvls_tree": (0.0, 0.0, 0.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "net": {
        "tree": (5.0, 8.5, 14.0),
        "ring": (2.7, 4.0, 14.0),
        "nvls": (0.0, 0.0, 18.0),
        "nvls_tree": (0.0, 0.0, 20.9),
        "pat": (0.0, 0.0, 14.0),
    },
}
# per arch, indexed by nodes (1, 2, 3+) (GB/s)
_LL_MAX_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
_LL_MAX_INTEL = (39.0, 39.0, 20.4)  # llMaxBws row 0: across nodes, Intel CPUs
_RING_LL128_PER_CHANNEL = {
    "volta": (20.0, 20.0, 20.0),
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 36.7),
    "blackwell": (40.0, 40.0, 40.0),
}
_TREE_LL128_PER_CHANNEL = {
    "volta": (20.0, 20.0, 20.0),
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 29.0),
    "blackwell": (55.6, 31.67, 20.0),
}
_TREE_PER_CHANNEL = {
    "volta": (26.5, 18.5, 10.0),
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (38.7, 41.4, 36.0),
    "blackwell": (70.0, 42.8, 24.0),
}
_NVLS_TREE_PER_CHANNEL = {
    "volta": (26.5, 18.5, 10.0),
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (0.0, 57.7, 45.5),
    "blackwell": (0.0, 96.0, 80.0),
}
_NVLS_EFFICIENCY = {"volta": 0.0, "ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}
# treeCorrectionFactor[protocol][log2(S / 64 B)], 64 B to 256 MB
# fmt: off
_TREE_CORRECTION = (  # LL, LL128, Simple
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
# fmt: on
_NET_OVERHEAD_US = 1.0  # getNetOverhead: Intel x86 (×3 for Simple)
CHANNELS = {"volta": 12, "ampere": 12, "hopper": 16, "blackwell": 16}
NET_CHANNELS = 8


@dataclass(frozen=True, kw_only=True)
class NcclGroup:
    """One communicator as NCCL's tuning model sees it."""

    ranks: int
    """Ranks in the group (n)."""
    nodes: int
    """Nodes they span; ranks per node = ranks / nodes."""
    arch: str
    """GPU generation: ``volta``, ``ampere``, ``hopper`` or ``blackwell``."""
    nvlink: bool
    """GPUs of a node talk over NVLink (else PCI): NVLink hop latencies and LL128."""
    nvswitch: bool
    """The node's GPUs share an NVSwitch: NVLS where the arch has it."""
    intra_bus_bytes_per_s: float
    """Bus bandwidth of a ring inside a node (all channels)."""
    nic_bytes_per_s: float
    """Network bandwidth of one GPU's NIC."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if not 1 <= self.nodes <= self.ranks:
            raise ValueError(f"{self.ranks} ranks cannot span {self.nodes} nodes")

    @property
    def per_node(self) -> int:
        """Ranks of the group on one node (NCCL's nRanks / nNodes, rounded down where a group
        is not aligned to nodes)."""
        return self.ranks // self.nodes

    @property
    def channels(self) -> int:
        """Channels NCCL runs: inside a node the arch's default (``CHANNELS``); across nodes
        ``NET_CHANNELS``, one per rail of an 8-NIC node, as NCCL's ring graph has on H100
        (NCCL 2.27.5 tuning logs: LL128's per-channel cap binds at 8 × 36.7 GB/s)."""
        return CHANNELS[self.arch] if self.nodes == 1 else NET_CHANNELS

    @property
    def bus_bytes_per_s(self) -> float:
        """A ring's bus bandwidth: NVLink inside a node; across nodes also at most the NICs of
        the group's ranks on one node (one each)."""
        if self.nodes == 1:
            return self.intra_bus_bytes_per_s
        return min(self.intra_bus_bytes_per_s, self.per_node * self.nic_bytes_per_s)


def _bucket(nodes: int) -> int:
    """NCCL's index by node count: 1, 2, 3 or more."""
    return min(nodes, 3) - 1


def _steps(collective: str, n: int) -> int:
    return 2 * (n - 1) if collective == "all_reduce" else n - 1


def _enabled(collective: str, algorithm: str, protocol: str, g: NcclGroup) -> bool:
    """Whether NCCL would consider this pair for the group (tuning.cc's enable rules)."""
    if algorithm in ("nvls", "nvls_tree", "pat") and protocol != "simple":
        return False
    if protocol == "ll128" and not g.nvlink:
        return False
    if algorithm == "tree":
        return collective == "all_reduce"
    nvls = g.nvswitch and _NVLS_EFFICIENCY[g.arch] > 0 and g.per_node >= 2  # ncclNvlsInit: 2+ local GPUs
    if algorithm == "nvls":  # multi-node NVLS needs CollNet, not assumed
        return nvls and g.nodes == 1
    if algorithm == "nvls_tree":
        return nvls and collective == "all_reduce" and g.nodes > 1
    if algorithm == "pat":  # ncclPatEnable: one rank per node (nNodes == nRanks)
        return collective != "all_reduce" and g.nodes > 1 and g.ranks == g.nodes
    return True


def bandwidth_bytes_per_s(collective: str, algorithm: str, protocol: str, g: NcclGroup) -> float:
    """Algorithm bandwidth (time = S / it) of the pair on the group; 0 where NCCL disables it."""
    if g.ranks <= 1 or not _enabled(collective, algorithm, protocol, g):
        return 0.0
    ch, b, nodes = g.channels, _bucket(g.nodes), g.nodes
    per_channel = g.bus_bytes_per_s / GB / ch
    if algorithm in ("nvls", "nvls_tree"):
        intra = g.intra_bus_bytes_per_s / GB / ch * _NVLS_EFFICIENCY[g.arch] * (ch - 1) / ch
        intra *= 2.0 if collective == "all_reduce" else (g.per_node - 1) / g.per_node
        inter = (
            g.per_node * g.nic_bytes_per_s / GB / ch * (2 if nodes <= 2 and algorithm == "nvls_tree" else 1)
        )
        cap = _NVLS_TREE_PER_CHANNEL[g.arch][b] if algorithm == "nvls_tree" else math.inf
        per_channel = min(intra, cap) if nodes == 1 else min(intra, inter, cap)
    bus = ch * per_channel
    ll_max = _LL_MAX_ONE_NODE[g.arch] if nodes == 1 else _LL_MAX_INTEL[b]
    if algorithm == "ring" and protocol == "ll":
        bus = min(ll_max, bus * 0.5)
    if algorithm == "ring" and protocol == "ll128":
        bus = min(bus * 0.92, ch * _RING_LL128_PER_CHANNEL[g.arch][b])
    if algorithm == "tree":
        bus = min(bus * 0.92, ch * _TREE_PER_CHANNEL[g.arch][b])
        if protocol == "ll":
            bus = min(bus / 3.8, ll_max)
        if protocol == "ll128":
            bus = min(bus * (7 / 9 if nodes == 1 else 120 / 128), ch * _TREE_LL128_PER_CHANNEL[g.arch][b])
    if algorithm == "pat":
        bus *= 0.75
    if algorithm in ("ring", "nvls", "nvls_tree") and not (
        algorithm == "nvls" and collective != "all_reduce"
    ):
        bus *= g.ranks / _steps(collective, g.ranks)  # bus → algorithm bandwidth
    elif algorithm == "tree":
        bus *= 0.5
    return bus * GB


def latency_s(collective: str, algorithm: str, protocol: str, g: NcclGroup) -> float:
    """The pair's latency on the group (before the size-dependent refinements of ``time_s``)."""
    p = PROTOCOLS.index(protocol)
    intra_hw = "nvlink" if g.nvlink else "pci"
    hop = _HOP_US[intra_hw][algorithm][p]
    net = _HOP_US["net"]["tree" if g.ranks == g.nodes else algorithm][p]  # ppn == 1: the tree's
    n, nodes, base = g.ranks, g.nodes, _BASE_US[algorithm][p]
    levels = int(math.log2(nodes))
    if algorithm == "ring":
        overhead = _NET_OVERHEAD_US * (3 if protocol == "simple" else 1) if nodes > 1 else 0.0
        inter_steps = 0 if nodes == 1 else (2 if collective == "all_reduce" else 1) * (nodes - 1)
        us = base + (_steps(collective, n) - inter_steps) * max(hop, overhead) + inter_steps * net
    elif algorithm == "tree":
        us = base + 2 * ((g.per_node - 1) * hop + levels * net)
    elif algorithm == "nvls":
        us = hop
    elif algorithm == "nvls_tree":
        us = base + hop + 2 * levels * net
    else:  # pat
        us = base + levels * net / 3.5 + n * 2.8
    return us * US


def terms(
    collective: str, size_bytes: float, algorithm: str, protocol: str, g: NcclGroup
) -> tuple[float, float] | None:
    """(latency s, seconds per byte) of the pair for a message of ``size_bytes`` (``ncclTopoGetAlgoTime``:
    the tree's size correction and the multi-node ring all-reduce's plateau applied); None where
    the pair is disabled."""
    bw = bandwidth_bytes_per_s(collective, algorithm, protocol, g)
    if bw <= 0:
        return None
    lat = latency_s(collective, algorithm, protocol, g)
    log_size = int(math.log2(size_bytes / 64)) if size_bytes >= 64 else -1  # NCCL's log2i(S >> 6)
    if algorithm == "tree" and collective == "all_reduce" and 0 <= log_size < 23:
        bw *= _TREE_CORRECTION[PROTOCOLS.index(protocol)][log_size]
    if (
        algorithm == "ring"
        and protocol == "simple"
        and collective == "all_reduce"
        and g.nodes > 1
        and size_bytes / (g.channels * g.ranks) >= 64
    ):
        lat *= 1.9 if g.arch == "volta" else 1.4
    return lat, 1 / bw


def time_s(collective: str, size_bytes: float, algorithm: str, protocol: str, g: NcclGroup) -> float:
    """Latency + S / bandwidth of the pair (``terms``); infinite where the pair is disabled."""
    got = terms(collective, size_bytes, algorithm, protocol, g)
    return math.inf if got is None else got[0] + got[1] * size_bytes


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The pair NCCL runs for one message, and its time."""

    algorithm: str
    protocol: str
    latency_s: float
    seconds_per_byte: float

    def seconds(self, size_bytes: float) -> float:
        """The pair's time for ``size_bytes``."""
        return self.latency_s + self.seconds_per_byte * size_bytes


def choose(collective: str, size_bytes: float, g: NcclGroup) -> Choice:
    """The cheapest enabled (algorithm, protocol) for ``size_bytes`` on ``g``, as NCCL picks
    (ties: the first in NCCL's order, tree before ring, LL before LL128 before Simple)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"NCCL's tuning model covers {COLLECTIVES}, not {collective!r}")
    best: Choice | None = None
    for algorithm in ALGORITHMS:
        for protocol in PROTOCOLS:
            got = terms(collective, size_bytes, algorithm, protocol, g)
            if got is None:
                continue
            pick = Choice(algorithm=algorithm, protocol=protocol, latency_s=got[0], seconds_per_byte=got[1])
            if best is None or pick.seconds(size_bytes) < best.seconds(size_bytes):
                best = pick
    if best is None:
        raise ValueError(f"no NCCL algorithm runs {collective} on {g}")
    return best


def p2p_terms(g: NcclGroup) -> tuple[float, float]:
    """(latency s, seconds per byte) of one send/recv between two ranks of ``g``: the ring's
    Simple hop (NVLink or PCI inside a node; the network's across nodes), and the link the bytes
    cross (NVLink's bus inside a node, one NIC across nodes)."""
    simple = PROTOCOLS.index("simple")
    if g.nodes == 1:
        hop = _HOP_US["nvlink" if g.nvlink else "pci"]["ring"][simple]
        return (_BASE_US["ring"][simple] + hop) * US, 1 / g.intra_bus_bytes_per_s
    return (_BASE_US["ring"][simple] + _HOP_US["net"]["ring"][simple]) * US, 1 / g.nic_bytes_per_s


def all_to_all_terms(g: NcclGroup) -> tuple[float, float]:
    """(latency s, seconds per byte) of an all-to-all of the S bytes each rank holds, as n − 1
    concurrent transfers of S/n bytes: a Simple hop per peer, the bytes for peers on the node
    over NVLink and those for other nodes over the rank's NIC, the slower of the two."""
    n = g.ranks
    if n <= 1:
        return 0.0, 0.0
    simple = PROTOCOLS.index("simple")
    local = (g.per_node - 1) / n / g.intra_bus_bytes_per_s
    remote = (n - g.per_node) / n / g.nic_bytes_per_s if g.nodes > 1 else 0.0
    hop = _HOP_US["net" if g.nodes > 1 else ("nvlink" if g.nvlink else "pci")]["ring"][simple]
    return (_BASE_US["ring"][simple] + (n - 1) * hop) * US, max(local, remote)


__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "PROTOCOLS",
    "Choice",
    "NcclGroup",
    "all_to_all_terms",
    "bandwidth_bytes_per_s",
    "choose",
    "latency_s",
    "p2p_terms",
    "terms",
    "time_s",
]
