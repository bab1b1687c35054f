"""Hybrid sharding (``Strategy.dp_replicate``): validation, the collectives' coefficients by
hand (shard group inside a node, all-reduce across replicas), states ÷ the shard group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import Cluster
from autopar.cost_models import nccl
from autopar.cost_models.estimate import estimate
from autopar.cost_models.terms import build_terms
from autopar.strategy import Strategy, StrategyError

SEQ = 128  # the seq of the conftest small_gpt_profile


@pytest.mark.parametrize(
    ("knobs", "why"),
    [
        ({"dp": 4, "zero": 1, "dp_replicate": 2}, "ZeRO-2 or 3"),
        ({"dp": 6, "zero": 3, "dp_replicate": 4}, "dividing dp = 6"),
        ({"dp": 4, "zero": 3, "dp_replicate": 4}, "at least 2 ranks"),
        ({"dp": 4, "zero": 3, "dp_replicate": 0}, "positive integer"),
    ],
)
def test_validation(knobs: dict, why: str) -> None:
    with pytest.raises(StrategyError, match=why):
        Strategy(global_batch=24, **knobs)


def test_json_and_shard_degree() -> None:
    st = Strategy(dp=8, zero=3, dp_replicate=4, global_batch=8)
    assert st.dp_shard == 2 and Strategy.from_dict(st.to_dict()) == st
    old = {k: v for k, v in st.to_dict().items() if k != "dp_replicate"}  # a plan from before HSDP
    assert Strategy.from_dict(old).dp_replicate == 1


def test_coefficients_by_hand(small_gpt_profile) -> None:
    """4 nodes of 2 GPUs on 25 GbE, dp 8 as 4 replicas of 2-rank shard groups (one node each).
    Gather within the node: one block's all-gather over k = 2 ranks on PCIe, as NCCL runs it;
    reduce: the node's reduce-scatter, then the S/k shard all-reduced across r = 4 nodes, one
    rank per node on its NIC's share (25 GbE·0.9/2): α = α_rs + α_ar, σ = σ_rs + σ_ar/k.
    States ÷ k, the optimizer ÷ k."""
    cluster = Cluster.preset("a100-pcie-25gbe", nodes=4, gpus_per_node=2)
    st = Strategy(dp=8, zero=3, dp_replicate=4, global_batch=8, micro_batch=1, seq=SEQ)
    terms = build_terms(small_gpt_profile, cluster, st)
    k, r = 2, 4
    unit = small_gpt_profile.layer_types[small_gpt_profile.layers[1]].params * 2  # bf16 block
    pci = dict(arch="ampere", nvlink=False, nvswitch=False, intra_bus_bytes_per_s=20e9)
    pci["nic_bytes_per_s"] = 25e9 / 8 * 0.9 / 2  # 25 GbE at 90%, two GPUs per node
    node, across = nccl.NcclGroup(ranks=k, nodes=1, **pci), nccl.NcclGroup(ranks=r, nodes=r, **pci)
    gather = nccl.choose("all_gather", unit, node)
    rs, ar = nccl.choose("reduce_scatter", unit, node), nccl.choose("all_reduce", unit / k, across)
    assert (terms.lat_s, terms.s_per_byte) == pytest.approx((gather.latency_s, gather.seconds_per_byte))
    assert terms.rs_lat_s == pytest.approx(rs.latency_s + ar.latency_s)
    assert terms.rs_s_per_byte == pytest.approx(rs.seconds_per_byte + ar.seconds_per_byte / k)
    assert terms.state_bytes_per_param == pytest.approx(16 / k)
    flat = build_terms(small_gpt_profile, cluster, replace(st, dp_replicate=1))
    assert flat.state_bytes_per_param == pytest.approx(16 / 8)
    assert terms.opt_s_per_param == pytest.approx(flat.opt_s_per_param * 8 / k)


def test_hsdp_trades_memory_for_ethernet_traffic(small_gpt_profile) -> None:
    """On 25 GbE the flat ZeRO-3 gathers and reduces over the NIC; HSDP only all-reduces the
    shard across it: less exposed DP time, more state bytes per GPU."""
    cluster = Cluster.preset("a100-pcie-25gbe", nodes=4, gpus_per_node=2)
    st = Strategy(dp=8, zero=3, global_batch=8, micro_batch=1, seq=SEQ)
    flat, hsdp = (
        estimate(small_gpt_profile, cluster, st),
        estimate(small_gpt_profile, cluster, replace(st, dp_replicate=4)),
    )
    assert hsdp.breakdown_s["dp_comm"] < flat.breakdown_s["dp_comm"]
    assert hsdp.memory[0].peak_bytes > flat.memory[0].peak_bytes
    assert any("HSDP: 4 replicas of 2-rank shard groups" in n for n in hsdp.notes)
