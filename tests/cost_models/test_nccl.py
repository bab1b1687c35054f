"""NCCL's tuning model (cost_models/nccl.py): hand arithmetic, and NCCL's own tuning output."""

from __future__ import annotations

import math

import pytest

from autopar import Cluster
from autopar.cost_models import comm, nccl
from autopar.gpus import arch_of
from autopar.mesh import Axis

A100 = dict(arch="ampere", nvlink=True, nvswitch=True, intra_bus_bytes_per_s=230e9, nic_bytes_per_s=25e9)
# NCCL 2.27.5 on H100 NVSwitch nodes with 8 × 400 Gb/s RoCE: its ring graph runs 8 channels of 48 GB/s
# (384 GB/s inside a node), one NIC of 48 GB/s per GPU
H100_LOGGED = dict(
    arch="hopper", nvlink=True, nvswitch=True, intra_bus_bytes_per_s=384e9, nic_bytes_per_s=48e9
)

# (nodes, ranks per node) → (latency µs, bandwidth GB/s) per protocol (LL, LL128, Simple), as NCCL
# 2.27.5 printed them in its tuning table on H100 (collected in meta-pytorch/autoparallel,
# autoparallel/cost_models/nccl_cost_model.py, _H100_AGRS_RING and _H100_AR_RING)
LOGGED_ALL_GATHER_RING = {
    (2, 1): ((11.6, 48.0), (22.5, 88.3), (22.4, 96.0)),
    (2, 8): ((23.3, 41.6), (44.6, 313.2), (70.0, 409.6)),
    (4, 2): ((18.7, 23.3), (33.6, 100.9), (64.0, 109.7)),
    (8, 1): ((41.6, 23.3), (73.5, 50.5), (106.4, 54.9)),
    (8, 8): ((81.5, 20.7), (148.4, 298.3), (296.8, 390.1)),
    (32, 4): ((186.3, 20.6), (320.4, 178.0), (768.8, 193.5)),
}
LOGGED_ALL_REDUCE_RING = {
    (2, 8): ((40.0, 20.8), (75.2, 156.6), (131.6, 204.8)),
    (4, 4): ((46.8, 10.9), (83.6, 94.2), (174.0, 102.4)),
    (16, 2): ((119.6, 10.5), (194.8, 45.6), (537.2, 49.5)),
}


@pytest.mark.parametrize(
    ("collective", "table"), [("all_gather", LOGGED_ALL_GATHER_RING), ("all_reduce", LOGGED_ALL_REDUCE_RING)]
)
def test_ring_latency_and_bandwidth_match_nccls_own_tuning_table(collective: str, table: dict) -> None:
    """Every logged latency to 0.1 µs; LL and Simple bandwidths to 0.5% (LL128's where its
    per-channel cap binds: eight channels of 36.7 GB/s)."""
    for (nodes, per_node), logged in table.items():
        g = nccl.NcclGroup(ranks=nodes * per_node, nodes=nodes, **H100_LOGGED)
        for protocol, (lat_us, bw_gb_s) in zip(nccl.PROTOCOLS, logged, strict=True):
            assert nccl.latency_s(collective, "ring", protocol, g) * 1e6 == pytest.approx(lat_us, abs=0.051)
            bw = nccl.bandwidth_bytes_per_s(collective, "ring", protocol, g) / 1e9
            if protocol != "ll128" or per_node == 8:
                assert bw == pytest.approx(bw_gb_s, rel=0.005), (nodes, per_node, protocol)


def test_hand_arithmetic_one_a100_node() -> None:
    """All-gather of 1 GiB over 8 A100s: ring Simple, 8.4 µs + 7 hops of 3.4 µs + (7/8)·S / 230 GB/s."""
    g = nccl.NcclGroup(ranks=8, nodes=1, **A100)
    size = 2**30
    pick = nccl.choose("all_gather", size, g)
    assert (pick.algorithm, pick.protocol) == ("ring", "simple")
    assert pick.seconds(size) == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + 7 / 8 * size / 230e9)


def test_hand_arithmetic_two_a100_nodes_all_reduce() -> None:
    """16 ranks on 2 nodes, 1 GiB: the ring's bus is min(NVLink 230, 8 NICs × 25) = 200 GB/s,
    latency 8.4 + 28 hops × max(3.4, 3 × 1.0) + 2 network hops × 14 = 131.6 µs, × 1.4 (the
    multi-node Simple plateau); the tree (bus min(200·0.92, 12 × 23.6)·½ = 92 GB/s) is slower."""
    g = nccl.NcclGroup(ranks=16, nodes=2, **A100)
    size = 2**30
    pick = nccl.choose("all_reduce", size, g)
    assert (pick.algorithm, pick.protocol) == ("ring", "simple")
    assert pick.seconds(size) == pytest.approx(131.6e-6 * 1.4 + size * 30 / 16 / 200e9)
    tree = nccl.time_s("all_reduce", size, "tree", "simple", g)
    assert tree == pytest.approx((8.4 + 2 * (7 * 4.0 + 1 * 14.0)) * 1e-6 + size / 92e9)


def test_choice_moves_with_size_and_scale() -> None:
    """Small messages take LL, mid-size LL128, large Simple; across many nodes the all-reduce
    takes the tree (log₂ latency) until bandwidth rules; one rank per node gathers by PAT when
    small; NVLS only where Hopper GPUs of a node share an NVSwitch."""
    one = nccl.NcclGroup(ranks=8, nodes=1, **A100)
    assert nccl.choose("all_reduce", 2**16, one).protocol == "ll"
    assert nccl.choose("all_reduce", 2**24, one).protocol == "ll128"
    assert nccl.choose("all_reduce", 2**30, one).protocol == "simple"
    many = nccl.NcclGroup(ranks=512, nodes=64, **A100)
    assert nccl.choose("all_reduce", 2**24, many).algorithm == "tree"
    rails = nccl.NcclGroup(ranks=64, nodes=64, **A100)
    assert nccl.choose("all_gather", 2**20, rails).algorithm == "pat"
    assert nccl.choose("all_gather", 2**30, rails).algorithm == "ring"
    h100 = dict(A100, arch="hopper")
    assert nccl.choose("all_reduce", 2**30, nccl.NcclGroup(ranks=8, nodes=1, **h100)).algorithm == "nvls"
    assert (
        nccl.choose("all_reduce", 2**30, nccl.NcclGroup(ranks=16, nodes=2, **h100)).algorithm == "nvls_tree"
    )
    lone = nccl.NcclGroup(ranks=16, nodes=16, **h100)  # one GPU per node: no NVLS (ncclNvlsInit)
    assert nccl.bandwidth_bytes_per_s("all_reduce", "nvls_tree", "simple", lone) == 0.0
    pcie = nccl.NcclGroup(ranks=8, nodes=1, **dict(A100, nvlink=False, nvswitch=False))
    assert nccl.bandwidth_bytes_per_s("all_reduce", "ring", "ll128", pcie) == 0.0
    assert nccl.time_s("all_gather", 2**20, "tree", "simple", one) == math.inf


def test_tree_size_correction() -> None:
    """A 1 MiB tree all-reduce runs at treeCorrectionFactor[Simple][log₂(2²⁰/64) = 14] = 0.5 of
    its bandwidth."""
    g = nccl.NcclGroup(ranks=512, nodes=64, **A100)
    lat, spb = nccl.terms("all_reduce", 2**20, "tree", "simple", g) or (0.0, 0.0)
    assert spb == pytest.approx(1 / (0.5 * nccl.bandwidth_bytes_per_s("all_reduce", "tree", "simple", g)))
    assert lat == pytest.approx(nccl.latency_s("all_reduce", "tree", "simple", g))


def test_point_to_point_and_all_to_all() -> None:
    """Send/recv: 8.4 + 3.4 µs and NVLink's bus in a node; 8.4 + 14 µs and one NIC across nodes.
    All-to-all over 16 ranks on 2 nodes: 15 hops of 14 µs, then the slower of 7/16·S over NVLink
    and 8/16·S over the NIC."""
    node, two = nccl.NcclGroup(ranks=2, nodes=1, **A100), nccl.NcclGroup(ranks=16, nodes=2, **A100)
    assert nccl.p2p_terms(node) == pytest.approx((11.8e-6, 1 / 230e9))
    assert nccl.p2p_terms(nccl.NcclGroup(ranks=2, nodes=2, **A100)) == pytest.approx((22.4e-6, 1 / 25e9))
    assert nccl.all_to_all_terms(two) == pytest.approx(((8.4 + 15 * 14) * 1e-6, 8 / 16 / 25e9))


def test_group_shapes_from_the_mesh() -> None:
    """A DP group of stride 8 puts one rank on each node (one NIC); stride 1 puts 8 (the node's
    eight NICs); the cpu preset has no NCCL model (α-β rings)."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=16)
    rails = comm.nccl_group(cluster, Axis("dp", 16, 8))
    full = comm.nccl_group(cluster, Axis("dp", 128, 1))
    assert rails is not None and (rails.ranks, rails.nodes, rails.per_node) == (16, 16, 1)
    assert full is not None and (full.nodes, full.per_node) == (16, 8)
    assert rails.bus_bytes_per_s == pytest.approx(25e9) and full.bus_bytes_per_s == pytest.approx(200e9)
    odd = comm.nccl_group(cluster, Axis("dp", 124, 1))  # not aligned to nodes: touches 16 of them
    assert odd is not None and (odd.ranks, odd.nodes, odd.per_node) == (124, 16, 7)
    assert comm.nccl_group(Cluster.preset("cpu"), Axis("dp", 2, 1)) is None
    assert arch_of("H100-SXM5-80GB") == "hopper" and arch_of("cpu-rank") is None


def test_a_pipeline_hop_across_nodes_rides_one_nic() -> None:
    """TP4 × PP4 on two H100 nodes: a pp group keeps two stages per node, but its hop between
    nodes (the slowest) is priced over one NIC (8.4 + 14 µs, 50 GB/s), not NVLink."""
    cluster = Cluster.preset("dgx-h100", nodes=2)
    axis = Axis("pp", 4, 4)
    link = comm.group_link(cluster, axis)
    assert link.crosses_nodes and axis.per_node(8) == 2
    assert comm.coefficients("send_recv", 2, link, 2**25) == pytest.approx((22.4e-6, 1 / 50e9))
