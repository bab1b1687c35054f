"""Pipeline bubbles and in-flight activations of every multi-chunk schedule against the orders
torch's own schedule classes build (``pipeline.torch_orders``), run with unequal F, B and W; the
weight-gradient term by hand; a zero-bubble plan priced end to end."""

from __future__ import annotations

import pytest

from autopar import Cluster
from autopar.cost_models.compute import weight_grad_s
from autopar.cost_models.estimate import estimate, stage_layer_names
from autopar.cost_models.memory import deferred_stage_copies, inflight_stage_copies
from autopar.cost_models.pipeline import bubble_rounds, simulate_orders, torch_orders
from autopar.planner import ModelProfiles
from autopar.strategy import Strategy, StrategyError, check_strategy

RATIOS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 1.0, 1.0), (1.0, 1.5, 1.5)]
"""(F, B, W) of a rank per micro-batch: equal (ZB's ideal), a heavy input gradient, a heavy
forward, and a weight gradient as large as the input gradient."""

CASES = [
    ("interleaved", 2, (1, 2, 4)),
    ("interleaved", 3, (1, 3)),
    ("interleaved-zb", 1, (1, 2, 4)),
    ("interleaved-zb", 2, (1, 2, 4)),
    ("interleaved-zb", 3, (1, 3)),
    ("zbv", 2, (2, 3, 5)),
    ("dualpipev", 2, (2, 3, 5)),
]
"""(schedule, v, micro-batches as multiples of p)."""


@pytest.mark.parametrize(("schedule", "v", "rounds"), CASES)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubble_and_peak_equal_torchs_orders(schedule: str, v: int, rounds: tuple[int, ...], p: int) -> None:
    for r in rounds:
        m = r * p
        st = Strategy(pp=p, schedule=schedule, virtual_stages=v, global_batch=m)
        orders = torch_orders(schedule, pp=p, virtual=v, micro_batches=m)
        for f, b, w in RATIOS:
            t = f + b + w
            makespan, peak = simulate_orders(
                orders, fwd_s=f / v, bwd_input_s=b / v, wgrad_s=w / v, chunks=p * v
            )
            got = bubble_rounds(st, fwd_s=f, bwd_input_s=b, wgrad_s=w) * t
            assert got == pytest.approx(makespan - m * t, abs=1e-9), (schedule, p, v, m, (f, b, w))
            held = [
                inflight_stage_copies(schedule, stage=k, pp=p, micro_batches=m, virtual=v) for k in range(p)
            ]
            assert held == pytest.approx([n / v for n in peak]), (schedule, p, v, m)


@pytest.mark.parametrize(("schedule", "v", "rounds"), [c for c in CASES if c[0] != "interleaved"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_deferred_weight_gradients_peak_as_torchs_orders(
    schedule: str, v: int, rounds: tuple[int, ...], p: int
) -> None:
    # a chunk past its I holds its weight-op gradients (ratio × its activations) until its W
    for r in rounds:
        m = r * p
        orders = torch_orders(schedule, pp=p, virtual=v, micro_batches=m)
        for ratio in (0.0, 0.3, 0.6, 1.0):
            _, peak = simulate_orders(
                orders, fwd_s=1, bwd_input_s=1, wgrad_s=1, chunks=p * v, deferred_ratio=ratio
            )
            got = []
            for k in range(p):
                held, deferred = deferred_stage_copies(
                    schedule, stage=k, pp=p, micro_batches=m, virtual=v, ratio=ratio
                )
                got.append(held + ratio * deferred)
            assert got == pytest.approx([x / v for x in peak]), (schedule, p, v, m, ratio)


def test_zero_bubble_closed_forms_by_hand() -> None:
    # ZB-H1 (Qi et al. 2024 §3): (p − 1)(F + B − W) against 1F1B's (p − 1)(F + B + W)
    one = Strategy(pp=4, schedule="1f1b", global_batch=8)
    zb1 = Strategy(pp=4, schedule="interleaved-zb", global_batch=8)
    assert bubble_rounds(one, fwd_s=1, bwd_input_s=1, wgrad_s=1) == 3.0
    assert bubble_rounds(zb1, fwd_s=1, bwd_input_s=1, wgrad_s=1) == pytest.approx(3 * 1 / 3)
    zb2 = Strategy(pp=4, schedule="interleaved-zb", virtual_stages=2, global_batch=8)
    assert bubble_rounds(zb2, fwd_s=1, bwd_input_s=2, wgrad_s=1) == pytest.approx(3 * 2 / (2 * 4))
    # a W longer than F cannot hide: the hop costs B
    assert bubble_rounds(zb1, fwd_s=1, bwd_input_s=2, wgrad_s=1.5) == pytest.approx(3 * 2 / 4.5)
    assert (
        bubble_rounds(
            Strategy(schedule="zbv", virtual_stages=2, global_batch=2), fwd_s=1, bwd_input_s=1, wgrad_s=1
        )
        == 0
    )


def test_weight_gradient_by_hand() -> None:
    h100 = Cluster.preset("dgx-h100").device
    rate = h100.achievable_flops("bf16")
    # a 4096×4096 linear on 8192 tokens: dW = dYᵀX, 2·8192·4096² FLOPs
    params, tokens = 4096 * 4096, 8192
    assert weight_grad_s(params, tokens=tokens, device=h100, dtype="bf16", backward_s=1.0) == pytest.approx(
        2 * tokens * params / rate
    )
    # never more than half the backward (the rest is the input gradient)
    assert weight_grad_s(params, tokens=tokens, device=h100, dtype="bf16", backward_s=1e-6) == 5e-7


def test_v_schedules_place_chunks_in_a_v_and_need_two_rounds() -> None:
    st = Strategy(pp=4, schedule="zbv", virtual_stages=2, global_batch=8)
    assert [st.chunk_rank(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert st.head_rank == 0 and st.rank_chunks(0) == [0, 7]
    assert Strategy(pp=4, schedule="interleaved", virtual_stages=2, global_batch=8).head_rank == 3
    with pytest.raises(StrategyError, match="exactly 2 chunks"):
        Strategy(pp=4, schedule="dualpipev", virtual_stages=3, global_batch=8)
    with pytest.raises(StrategyError, match="fewer than its 2·pp = 8 chunks"):
        check_strategy(
            Strategy(pp=4, schedule="zbv", virtual_stages=2, global_batch=4), world_size=4, blocks=8, heads=4
        )


def test_zero_bubble_plan_priced_end_to_end() -> None:
    """GPT-2 medium on 8 H100s at PP4 × DP2: the same layout under 1F1B, interleaved zero bubble and
    ZBV. The zero-bubble schedules shrink the bubble by the weight-gradient share; ZBV's first
    rank holds the embedding and the head, and every rank p stages' activations."""
    profile = ModelProfiles.of("gpt2-medium", dtype="bf16", seq=1024).at(1)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    est = {}
    for schedule, v in (("1f1b", 1), ("interleaved-zb", 1), ("zbv", 2)):
        st = Strategy(pp=4, dp=2, schedule=schedule, virtual_stages=v, global_batch=32, seq=1024)
        est[schedule] = estimate(profile, cluster, st)
    bubble = {k: e.breakdown_s["bubble"] for k, e in est.items()}
    assert bubble["zbv"] < bubble["interleaved-zb"] < bubble["1f1b"], bubble
    assert est["zbv"].step_time_s < est["1f1b"].step_time_s
    layers = stage_layer_names(profile, est["zbv"].strategy)
    assert layers[0][0] == profile.layer_names[0] and layers[0][-1] == profile.layer_names[-1]
    one, zbv = est["1f1b"].memory, est["zbv"].memory
    assert zbv[3].activations > one[3].activations  # 1F1B's last rank holds one micro-batch
