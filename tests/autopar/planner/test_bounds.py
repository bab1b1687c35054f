"""The search's lower bounds: hand-computed mixes, and never above the layout ILP's optimum."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar import Cluster
from autopar.cost_models.estimate import estimate
from autopar.planner import ModelProfiles, Pricer
from autopar.planner.bounds import fastest_mix_s, lower_bound_s, tight_bound_s
from autopar.planner.layout_ilp import LayoutProblem, fits_somehow, solve_layout
from autopar.strategy import Strategy
from autopar.zoo import GPT, GPTConfig

SEQ, BLOCKS = 128, 14


def test_fastest_mix_is_the_lower_envelope_of_the_choices() -> None:
    """Choices (bytes, s): none (10, 1.0), selective (6, 1.1), full (2, 1.4)."""
    points = [(10.0, 1.0), (6.0, 1.1), (2.0, 1.4)]
    assert fastest_mix_s(points, 12.0) == 1.0  # everything fits without recompute
    assert fastest_mix_s(points, 10.0) == 1.0
    # μ = 8: half none, half selective (8 = ½·10 + ½·6): 1.05 s
    assert fastest_mix_s(points, 8.0) == pytest.approx(1.05)
    # μ = 4: half selective, half full: 1.25 s (none with full would be ¼·1.0 + ¾·1.4 = 1.3 s)
    assert fastest_mix_s(points, 4.0) == pytest.approx(1.25)
    assert fastest_mix_s(points, 2.0) == 1.4
    assert fastest_mix_s(points, 1.9) == float("inf")  # not even full recompute fits


@pytest.fixture(scope="module")
def pricer() -> Pricer:
    cfg = GPTConfig(n_layer=BLOCKS, n_embd=256, n_head=4, vocab_size=4096, block_size=SEQ, attention="math")
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    profiles = ModelProfiles.of(model, dtype="bf16", seq=SEQ)
    return Pricer(profiles, Cluster.preset("dgx-a100-80g", gpus_per_node=4), dtype="bf16")


@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", 1), ("interleaved-zb", 2), ("zbv", 2), ("interleaved", 2)]
)
def test_the_tight_bound_is_below_the_optimum_and_above_the_cheap_one(pricer: Pricer, schedule, v) -> None:
    """PP4, 8 micro-batches, capacities from roomy down to where nothing fits: at each, the cheap
    bound ≤ the per-rank bound ≤ the layout ILP's optimum (its estimate); where memory forces
    recompute onto some ranks the per-rank bound is strictly the tighter one somewhere."""
    st = Strategy(pp=4, micro_batch=1, global_batch=8, seq=SEQ, schedule=schedule, virtual_stages=v)
    terms = pricer.terms(st)
    allowed = ("none", "selective", "full")
    roomy = max(m.peak_bytes for m in pricer.estimate(st).memory)  # the even split, no recompute
    lo, hi = 0.0, roomy  # bisect for the least capacity any layout fits in
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits_somehow(LayoutProblem(terms, BLOCKS, mid, allowed)) else (mid, hi)
    tighter, tried = 0, 0
    for i in range(21):  # from the least that fits to the even split's peak
        capacity = hi + (roomy - hi) * i / 20
        layout, gap = solve_layout(LayoutProblem(terms, BLOCKS, capacity, allowed), time_limit=10.0)
        assert gap == 0.0
        best = estimate(pricer.profiles.at(1), pricer.cluster, replace(st, layout=layout)).step_time_s
        cheap = lower_bound_s(LayoutProblem(terms, BLOCKS, capacity, allowed))
        tight = tight_bound_s(LayoutProblem(terms, BLOCKS, capacity, allowed))
        assert cheap <= tight <= best * (1 + 1e-9), (capacity, cheap, tight, best)
        tried += 1
        tighter += tight > cheap * (1 + 1e-6)
    assert tried >= 3 and tighter >= 1
