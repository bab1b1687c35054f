"""Expert parallelism's price against hand arithmetic: the all-to-all, a MoE layer's exchanges per
micro-batch, expert parameters ÷ ep, and their states ZeRO-sharded over the dp / ep ranks
holding the same experts."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from autopar.cluster import Cluster
from autopar.cost_models import comm
from autopar.cost_models.estimate import estimate
from autopar.cost_models.experts import COUNT_BYTES, expert_factors
from autopar.mesh import Axis
from autopar.planner import ModelProfiles
from autopar.strategy import Strategy, StrategyError, check_strategy
from autopar.zoo import hf

SEQ = 16


@functools.cache
def _profile():
    with torch.device("meta"):
        model = hf.family("mixtral")  # 2 blocks of 4 experts, top-2; hidden 64
    return ModelProfiles.of(model, dtype="fp32", seq=SEQ).at(2)


def _cluster(gpus: int = 4) -> Cluster:
    return Cluster.preset("cpu", gpus_per_node=gpus)


def test_all_to_all_is_the_pairwise_exchange() -> None:
    link = comm.group_link(_cluster(), Axis("group", 4, 1))
    a, beta = link.latency_s, link.bandwidth_bytes_per_s
    assert comm.all_to_all_time_s(1e6, 4, link) == pytest.approx(3 * a + 3 / 4 * 1e6 / beta)
    assert comm.all_to_all_time_s(1e6, 1, link) == 0.0


def test_a_moe_block_is_profiled_with_its_experts_and_exchanges() -> None:
    block = _profile().layer_types["MixtralDecoderLayer"]
    assert block.experts == 4
    # gate_up (4, 2·128, 64) and down (4, 64, 128): an FFN of 128 per expert
    assert block.expert_params == 4 * (2 * 128 * 64 + 64 * 128)
    # dispatch and combine: b·s·top-k rows of 64 fp32 each way
    assert block.a2a_bytes == 2 * (2 * SEQ * 2) * 64 * 4


def test_ep2_prices_the_all_to_alls_and_splits_the_experts() -> None:
    profile, cluster = _profile(), _cluster()
    st = Strategy(dp=4, ep=2, zero=1, micro_batch=2, global_batch=16, seq=SEQ, dtype="fp32")
    one, two = estimate(profile, cluster, replace(st, ep=1)), estimate(profile, cluster, st)
    block = profile.layer_types["MixtralDecoderLayer"]
    link = comm.group_link(cluster, Axis("group", 2, 1))
    a2a = functools.partial(comm.all_to_all_time_s, n=2, link=link)
    per_block = a2a(COUNT_BYTES * 4) + 2 * a2a(block.a2a_bytes / 2) + 2 * a2a(block.a2a_bytes / 2)
    m = st.micro_batches
    assert two.breakdown_s["ep_comm"] == pytest.approx(m * 2 * per_block)
    assert "ep_comm" not in one.breakdown_s
    # fp32 ZeRO-1: weights and gradients 4 B each per parameter held, optimizer 8 B over its shards;
    # the experts: half of them held, their optimizer states over the dp / ep = 2 ranks holding them
    e = block.expert_params * profile.blocks
    dense = profile.total_params - e
    mem = two.memory[0]
    # the gathered weights, and FSDP2's fp32 shards beside them (dense over dp, experts over dp / ep)
    assert mem.weights == pytest.approx(4 * (dense + e / 2) + 4 * dense / 4 + 4 * (e / 2) / 2)
    assert mem.gradients == pytest.approx(4 * (dense + e / 2))
    assert mem.optimizer == pytest.approx(8 * dense / 4 + 8 * (e / 2) / 2)
    assert one.memory[0].optimizer == pytest.approx(8 * (dense + e) / 4)  # the same sharded bytes


def test_expert_factors_follow_the_shard_groups() -> None:
    cluster = _cluster()
    st = Strategy(dp=4, ep=2, zero=1, global_batch=16, seq=SEQ, dtype="fp32")
    f = expert_factors(cluster, st)
    # ring all-reduce bytes term: (n − 1)/n over 2 ranks against 4 (one link inside the node)
    assert f["expert_comm"] == pytest.approx((1 / 2) / (3 / 4))
    assert f["expert_optimizer"] == 2.0  # a rank updates 1/2 of its experts, not 1/4
    # ZeRO-1 fp32 on FSDP2: 4 + 4/e (the gathered weights and their shards) + 4 + 8/e bytes per
    # parameter, e = 2 against 4
    assert f["expert_state"] == pytest.approx((4 + 4 / 2 + 4 + 8 / 2) / (4 + 4 / 4 + 4 + 8 / 4))
    assert expert_factors(cluster, replace(st, dp=2, global_batch=8))["expert_comm"] == 0.0  # e = 1


def test_ep_must_divide_dp_and_the_experts() -> None:
    with pytest.raises(StrategyError, match="must divide dp"):
        Strategy(dp=4, ep=3, global_batch=12)
    with pytest.raises(StrategyError, match="without HSDP"):
        Strategy(dp=4, ep=2, zero=2, dp_replicate=2, global_batch=8)
    assert Strategy(dp=2, tp=2, ep=2, global_batch=8).ep == 2  # experts replicated over tp
    st = Strategy(dp=8, ep=8, global_batch=8)
    with pytest.raises(StrategyError, match="has 4 routed experts"):
        check_strategy(st, world_size=8, blocks=2, heads=4, experts=4)
    with pytest.raises(StrategyError, match="no routed experts"):
        check_strategy(replace(st, ep=2), world_size=8, blocks=2, heads=4)


def test_the_planner_prices_each_ep_on_its_own_terms() -> None:
    """The pricer's per-layer units are cached per outer knobs: ep is one of them (a plan
    searched freely once reused ep 1's units for ep 4 and missed the faster plan)."""
    from autopar.planner.pricing import Pricer

    with torch.device("meta"):
        model = hf.family("mixtral")
    pricer = Pricer(ModelProfiles.of(model, dtype="fp32", seq=SEQ), _cluster(), dtype="fp32")
    st = Strategy(dp=4, zero=1, micro_batch=2, global_batch=16, seq=SEQ, dtype="fp32")
    one, two = pricer.terms(st), pricer.terms(replace(st, ep=2))
    assert one.block["none"].ep_s == 0.0 < two.block["none"].ep_s
    assert two.block["none"].params < one.block["none"].params
    assert (
        pricer.estimate(replace(st, ep=2)).step_time_s
        == estimate(_profile(), _cluster(), replace(st, ep=2)).step_time_s
    )


def test_an_expert_skew_slows_the_busiest_rank_by_its_extra_rows() -> None:
    """skew s: the experts' grouped matmuls at s × their even-share time (backward 2×), the row
    exchanges at s × the bytes; nothing changes without EP, and s < 1 is refused."""
    from autopar.cost_models.compute import expert_forward_s
    from autopar.cost_models.terms import layer_units
    from autopar.request import Constraints

    profile, cluster = _profile(), _cluster()
    lc = profile.layer_types["MixtralDecoderLayer"]
    assert sum(op.expert for op in lc.ops) == 2  # gate-up and down: the grouped matmuls
    even = expert_forward_s(lc, cluster.device, "fp32")
    assert even > 0
    base = Strategy(dp=4, ep=2, zero=1, micro_batch=2, global_batch=8, seq=SEQ, dtype="fp32")
    skewed = replace(base, expert_skew=1.5)
    (u1, _, _), (u2, _, _) = layer_units(profile, cluster, base), layer_units(profile, cluster, skewed)
    assert u2["none"].fwd_s - u1["none"].fwd_s == pytest.approx(0.5 * even)
    assert u2["none"].bwd_compute_s - u1["none"].bwd_compute_s == pytest.approx(2 * 0.5 * even)
    link = comm.group_link(cluster, Axis("group", 2, 1))
    rows = 2 * (
        comm.all_to_all_time_s(1.5 * lc.a2a_bytes / 2, 2, link)
        - comm.all_to_all_time_s(lc.a2a_bytes / 2, 2, link)
    )
    assert u2["none"].ep_s - u1["none"].ep_s == pytest.approx(2 * rows)  # forward and backward
    # skew past ep is capped at ep (every row on one rank)
    assert layer_units(profile, cluster, replace(base, expert_skew=9.0))[0]["none"].fwd_s == pytest.approx(
        layer_units(profile, cluster, replace(base, expert_skew=2.0))[0]["none"].fwd_s
    )
    no_ep = replace(base, ep=1)
    plain, skew3 = (
        estimate(profile, cluster, no_ep),
        estimate(profile, cluster, replace(no_ep, expert_skew=3.0)),
    )
    assert plain.step_time_s == skew3.step_time_s and plain.memory == skew3.memory
    with pytest.raises(StrategyError, match="expert_skew"):
        replace(base, expert_skew=0.5)
    with pytest.raises(Exception, match="expert_skew"):
        Constraints(expert_skew=0.9)


def test_tensor_parallelism_leaves_the_grouped_experts_whole() -> None:
    """No TP rule splits a grouped matmul: every TP rank runs and holds all of its experts."""
    from autopar.cost_models.compute import expert_forward_s, layer_forward_s
    from autopar.cost_models.terms import layer_units

    profile, cluster = _profile(), _cluster()
    lc = profile.layer_types["MixtralDecoderLayer"]
    dev = cluster.device
    experts = expert_forward_s(lc, dev, "fp32")
    rest = replace(lc, ops=tuple(op for op in lc.ops if not op.expert))
    for t in (1, 2, 4):
        split = layer_forward_s(rest, dev, "fp32", tp=t, sp=False)
        assert layer_forward_s(lc, dev, "fp32", tp=t, sp=False) == pytest.approx(experts + split)
    st = Strategy(tp=2, dp=2, micro_batch=2, global_batch=4, seq=SEQ, dtype="fp32")
    blocks, _, _ = layer_units(profile, cluster, st)
    assert blocks["none"].params == pytest.approx((lc.params - lc.expert_params) / 2 + lc.expert_params)


def test_the_experts_rows_activations_stay_whole_under_tp_and_grow_with_the_skew() -> None:
    """A MoE block's saved expert rows (``LayerCost.saved_expert_bytes``: the row region's, apart
    from the stream / sharded / quadratic split) are not divided by TP, and the busiest EP rank
    keeps skew × them; a dense block has none; the total at tp 1, skew 1 is every saved byte."""
    from autopar.cost_models.memory import layer_activation_bytes
    from autopar.cost_models.terms import layer_units

    profile, cluster = _profile(), _cluster()
    lc = profile.layer_types["MixtralDecoderLayer"]
    rows = 2 * SEQ * 2  # b·s·top-k rows through the experts
    assert lc.saved_expert_bytes >= rows * 64 * 4  # at least the rows entering them (fp32, h 64)
    whole = lc.saved_stream_bytes + lc.saved_sharded_bytes + lc.saved_quadratic_bytes
    act = functools.partial(layer_activation_bytes, lc, sp=False, recompute="none", input_bytes=0)
    assert act(tp=1) == whole + lc.saved_expert_bytes
    assert act(tp=2) == pytest.approx(
        lc.saved_stream_bytes
        + (lc.saved_sharded_bytes + lc.saved_quadratic_bytes) / 2
        + lc.saved_expert_bytes
    )
    assert act(tp=1, expert_skew=1.5) - act(tp=1) == pytest.approx(0.5 * lc.saved_expert_bytes)
    base = Strategy(dp=4, ep=2, zero=1, micro_batch=2, global_batch=8, seq=SEQ, dtype="fp32")
    (u1, _, _), (u2, _, _) = (
        layer_units(profile, cluster, s) for s in (base, replace(base, expert_skew=1.5))
    )
    assert u2["none"].act_bytes - u1["none"].act_bytes == pytest.approx(0.5 * lc.saved_expert_bytes)
    with torch.device("meta"):
        dense = ModelProfiles.of(hf.family("llama"), dtype="fp32", seq=SEQ).at(2)
    assert all(t.saved_expert_bytes == 0 for t in dense.layer_types.values())
