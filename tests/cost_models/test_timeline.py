"""The step's timeline: each schedule runs every forward and backward once, in an order whose
dependencies hold, and with equal ranks and free sends it lasts exactly the closed form
(m + (p − 1)/v)·(t_f + t_b); the per-rank terms add up to what the estimate prices."""

from __future__ import annotations

import itertools

import pytest

from autopar.cost_models.timeline import StageTime, schedule_order, simulate, stage_times_from_dicts
from autopar.strategy import Strategy


def _times(p: int, f: float = 1.0, b: float = 2.0, slow: dict[int, float] | None = None) -> tuple:
    slow = slow or {}
    return tuple(
        StageTime(stage=k, forward_s=f * slow.get(k, 1.0), tp_forward_s=0.0, recompute_s=0.0,
                  backward_s=b * slow.get(k, 1.0), tp_backward_s=0.0, dp_comm_s=0.0, optimizer_s=0.0)
        for k in range(p)
    )  # fmt: skip


CASES = [
    ("gpipe", 1, 1, 4),
    ("gpipe", 1, 4, 8),
    ("1f1b", 1, 2, 6),
    ("1f1b", 1, 4, 3),  # fewer micro-batches than stages
    ("1f1b", 1, 4, 8),
    ("interleaved", 2, 2, 4),
    ("interleaved", 2, 4, 8),
    ("interleaved", 3, 4, 4),
]


@pytest.mark.parametrize(("schedule", "v", "p", "m"), CASES)
def test_equal_ranks_take_the_closed_form(schedule: str, v: int, p: int, m: int) -> None:
    st = Strategy(pp=p, dp=1, global_batch=m, micro_batch=1, seq=8, schedule=schedule, virtual_stages=v)
    events = simulate(st, _times(p), hop_s=0.0)
    assert max(e.end_s for e in events) == pytest.approx((m + (p - 1) / v) * 3.0)
    for k in range(p):  # every (micro-batch, chunk) of the rank once forward and once backward
        chunks = {c for c in range(p * v) if c % p == k}
        for kind in ("forward", "backward"):
            ran = sorted((e.micro_batch, e.chunk) for e in events if e.rank == k and e.kind == kind)
            assert ran == sorted((i, c) for i in range(m) for c in chunks), (k, kind)
        mine = sorted((e for e in events if e.rank == k), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in itertools.pairwise(mine))


ZB_CASES = [
    ("interleaved-zb", 1, 4, 8),
    ("interleaved-zb", 2, 4, 8),
    ("zbv", 2, 4, 8),
    ("dualpipev", 2, 2, 6),
]


@pytest.mark.parametrize(("schedule", "v", "p", "m"), ZB_CASES)
def test_zero_bubble_timelines_take_the_cost_models_bubble(schedule: str, v: int, p: int, m: int) -> None:
    """torch's order with B and W apart: the makespan is (m + bubble_rounds)·t, every chunk of a
    rank (in a V: chunks k and 2p − 1 − k) runs its forward, its input and its weight gradient."""
    from dataclasses import replace

    from autopar.cost_models.pipeline import bubble_rounds

    st = Strategy(pp=p, dp=1, global_batch=m, micro_batch=1, seq=8, schedule=schedule, virtual_stages=v)
    times = tuple(replace(t, weight_grad_s=0.75) for t in _times(p))  # F 1, B 1.25, W 0.75
    events = simulate(st, times, hop_s=0.0)
    rounds = m + bubble_rounds(st, fwd_s=1.0, bwd_input_s=1.25, wgrad_s=0.75)
    assert max(e.end_s for e in events) == pytest.approx(rounds * 3.0)
    for k in range(p):
        ran = sorted((e.micro_batch, e.chunk) for e in events if e.rank == k and e.kind == "forward")
        assert ran == sorted((i, c) for i in range(m) for c in st.rank_chunks(k)), k
        work = sum(e.end_s - e.start_s for e in events if e.rank == k and e.kind == "backward")
        assert work == pytest.approx(m * 2.0)


def test_a_backward_waits_for_its_forward_and_the_next_chunk() -> None:
    st = Strategy(pp=4, dp=1, global_batch=8, micro_batch=1, seq=8, schedule="interleaved", virtual_stages=2)
    events = simulate(st, _times(4), hop_s=0.25)
    end = {(e.kind, e.micro_batch, e.chunk): e.end_s for e in events if e.kind in ("forward", "backward")}
    start = {(e.kind, e.micro_batch, e.chunk): e.start_s for e in events if e.kind in ("forward", "backward")}
    for (kind, i, c), t in start.items():
        if kind == "forward" and c > 0:
            assert t >= end[("forward", i, c - 1)] + 0.25 - 1e-12
        if kind == "backward":
            after = end[("forward", i, c)] if c == 7 else end[("backward", i, c + 1)] + 0.25
            assert t >= after - 1e-12
    sends = [e for e in events if e.kind == "p2p"]
    assert sends and all(e.end_s - e.start_s == pytest.approx(0.25) for e in sends)


def test_one_slow_rank_is_shorter_than_the_closed_form_that_prices_every_rank_at_it() -> None:
    st = Strategy(pp=4, dp=1, global_batch=8, micro_batch=1, seq=8, schedule="1f1b")
    slow = simulate(st, _times(4, slow={2: 2.0}), hop_s=0.0)
    assert max(e.end_s for e in slow) < (8 + 3) * 6.0
    assert max(e.end_s for e in slow) > 8 * 6.0  # the slow rank's own work, at least


def test_warm_up_forwards_per_rank() -> None:
    st = Strategy(pp=4, dp=1, global_batch=8, micro_batch=1, seq=8, schedule="1f1b")
    kinds = ["".join(op.kind for op in schedule_order(st, k)) for k in range(4)]
    assert kinds[0].startswith("FFFFB") and kinds[3].startswith("FBFB")  # p − 1 − k warm-up forwards
    il = Strategy(pp=2, dp=1, global_batch=4, micro_batch=1, seq=8, schedule="interleaved", virtual_stages=2)
    first = schedule_order(il, 0)[:5]  # (p − 1)·2 + (v − 1)·p = 4 warm-up forwards on rank 0
    assert [(op.kind, op.micro_batch, op.chunk) for op in first] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2), ("F", 2, 0)
    ]  # fmt: skip


def test_the_estimate_carries_stage_times_that_add_up_to_its_stages() -> None:
    from autopar.cluster import Cluster
    from autopar.planner import ModelProfiles
    from autopar.planner.pricing import Pricer

    st = Strategy(tp=2, pp=2, dp=2, global_batch=8, micro_batch=1, seq=2048, recompute="full",
                  sequence_parallel=True)  # fmt: skip
    profiles = ModelProfiles.of("megatron-1.7b", dtype="bf16", seq=2048)
    est = Pricer(profiles, Cluster.preset("dgx-a100-80g"), dtype="bf16").estimate(st)
    times = stage_times_from_dicts(est.to_dict()["stage_times"])
    assert times == est.stage_times and len(times) == 2
    per_micro_batch = [
        t.forward_s + t.tp_forward_s + t.recompute_s + t.backward_s + t.tp_backward_s for t in times
    ]
    slowest = max(per_micro_batch)
    b = est.breakdown_s
    m = st.micro_batches
    assert m * slowest == pytest.approx(b["compute"] + b["recompute"] + b["tp_comm"])
    assert max(t.dp_comm_s for t in times) == pytest.approx(b["dp_comm"])
    assert max(t.optimizer_s for t in times) == pytest.approx(b["optimizer"])
    for t in times:  # full recompute: a block's backward repeats its forward's collectives
        assert 1.9 * t.tp_forward_s < t.tp_backward_s <= 2 * t.tp_forward_s  # embedding, head: 1×
    assert est.p2p_hop_s * 2 * m == pytest.approx(b["p2p"])
