"""Lower bounds on an outer choice's step time, for the search's branch and bound.

Two bounds, both at or below the layout ILP's optimum (``layout_ilp``: the same terms):

- ``lower_bound_s``, cheap enough for every outer choice (thousands): perfect stage balance,
  only the recompute memory forces over all ranks together, no DP traffic beyond the average
  rank's exposure.
- ``stage_bound_s``, the slowest stage of the best layout of a relaxation in which each rank
  is priced on its own: rank k with n blocks and memory budget M_k (``rank_budgets_bytes``)
  takes at least n·G_k(M_k / n), G_k(μ) the fastest mix of recompute choices whose average
  block memory is at most μ — the LP  min Σ t_r·x_r  s.t.  Σ x_r = 1, Σ m_r·x_r ≤ μ, x ≥ 0,
  whose optimum uses at most two choices (two constraints), so G is the lower envelope of
  the points (m_r, t_r). Blocks then go one at a time to the rank whose stage grows least
  (exact for a min–max of non-decreasing costs). The search takes it only for the choices it
  visits: it weighs the memory each rank can hold (p stages in flight on the first rank of
  1F1B, on every rank of a zero-bubble one) where the cheap bound spreads forced recompute
  over the whole pipeline.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from itertools import combinations

from autopar.cost_models.dp_overlap import dp_exposed_s
from autopar.cost_models.rank_load import RankLoad, optimizer_s
from autopar.cost_models.terms import Terms
from autopar.planner.layout_ilp import (
    LayoutProblem,
    block_bytes,
    fixed_rank_blocks,
    rank_budgets_bytes,
    rank_max_blocks,
)


def _edge_s(terms: Terms, rank: int) -> float:
    """The embedding's and the head's compute on rank ``rank`` (a micro-batch)."""
    st = terms.strategy
    return terms.embed.time_s * (rank == 0) + terms.head.time_s * (rank == st.head_rank)


def _step_s(terms: Terms, blocks: int, allowed: tuple[str, ...], stage_s: float) -> float:
    """Step time for a slowest stage of ``stage_s`` (a micro-batch): the schedule's rounds,
    the optimizer of an average rank and the DP exposure of an average rank (a max of convex
    hinges is at least the hinge of the average), taken with every block's backward as long as
    allowed (most overlap) and no re-gathering."""
    st, u = terms.strategy, terms.block["none"]
    edges = (terms.embed, terms.head)
    params = blocks * u.params + sum(e.params for e in edges)
    experts = blocks * u.expert_params / st.pp
    longest = max((terms.block[r] for r in allowed), key=lambda x: x.bwd_s)
    average = RankLoad(
        fwd_s=(blocks * u.fwd_s + sum(e.fwd_s for e in edges)) / st.pp,
        bwd_compute_s=(blocks * u.bwd_compute_s + sum(e.bwd_compute_s for e in edges)) / st.pp,
        recompute_s=0.0,
        tp_s=0.0,
        bwd_s=(blocks * longest.bwd_s + sum(e.bwd_s for e in edges)) / st.pp,
        wgrad_s=0.0,
        params=params / st.pp,
        zero_units=(blocks + (1 if st.pp == 1 else 2)) // st.pp,  # the roots with the edges
        act_bytes=0.0,
        deferred_bytes=0.0,
        rematerialises=False,
        expert_params=experts,
    )
    rounds = st.micro_batches + terms.bubble_rounds
    return rounds * (stage_s + terms.p2p_s) + optimizer_s(terms, average) + dp_exposed_s(terms, average)


def lower_bound_s(problem: LayoutProblem) -> float:
    """A bound no layout beats: perfect balance (or, where a deep interleaved pipeline fixes each
    rank's count, ``fixed_rank_blocks``, the slowest rank's blocks and edges without recompute),
    no DP traffic, and only as much recompute as memory forces (blocks that no rank can hold
    without it pay the cheapest recompute)."""
    return _step_s(problem.terms, problem.blocks, problem.allowed, lower_stage_s(problem))


def lower_stage_s(problem: LayoutProblem) -> float:
    """``lower_bound_s``'s slowest stage (a micro-batch)."""
    terms, blocks, capacity, allowed = problem.terms, problem.blocks, problem.capacity, problem.allowed
    st = terms.strategy
    u = terms.block["none"]
    without = sum(min(n, blocks) for n in rank_max_blocks(terms, capacity, "none"))
    forced = max(0, blocks - without) if "none" in allowed else blocks
    extras = [terms.block[r].time_s - u.time_s for r in allowed if r != "none"]
    total = (
        blocks * u.time_s + forced * (min(extras) if extras else 0.0) + terms.embed.time_s + terms.head.time_s
    )
    stage_s = max(total / st.pp, terms.embed.time_s, terms.head.time_s, u.time_s)
    fixed = fixed_rank_blocks(st, blocks)
    if fixed:  # a deep interleaved pipeline: each rank's count is the even split's
        stage_s = max(stage_s, *(n * u.time_s + _edge_s(terms, k) for k, n in enumerate(fixed)))
    return stage_s


def fastest_mix_s(points: list[tuple[float, float]], budget_per_block: float) -> float:
    """G(μ): the least average block time of a mix of choices (bytes, seconds) whose average
    memory is at most μ = ``budget_per_block`` (inf when even the leanest does not fit)."""
    best = min((t for m, t in points if m <= budget_per_block), default=math.inf)
    for (m_i, t_i), (m_j, t_j) in combinations(sorted(points), 2):
        if m_i < budget_per_block < m_j:  # the mix that uses exactly μ
            best = min(best, t_i + (t_j - t_i) * (budget_per_block - m_i) / (m_j - m_i))
    return best


def stage_bound_s(problem: LayoutProblem, ranks: Sequence[tuple[Terms, float]] | None = None) -> float:
    """The slowest stage (a micro-batch) of the best layout when each rank's blocks are priced
    by the fastest recompute mix its own memory allows (module docstring); inf if none fits.
    ``ranks``: each pipeline rank's own terms and memory (a mixed cluster's devices), else the
    problem's for every rank."""
    blocks, allowed, st = problem.blocks, problem.allowed, problem.strategy
    ranks = ranks or [(problem.terms, problem.capacity)] * st.pp

    def rank_s(k: int, n: int) -> float:
        if n == 0:
            return _edge_s(ranks[k][0], k)
        return _edge_s(ranks[k][0], k) + n * fastest_mix_s(points[k], budgets[k] / n)

    points = [[(block_bytes(t, k, r), t.block[r].time_s) for r in allowed] for k, (t, _) in enumerate(ranks)]
    budgets = [rank_budgets_bytes(t, cap)[k] for k, (t, cap) in enumerate(ranks)]
    counts = fixed_rank_blocks(st, blocks) or [st.min_rank_blocks(k) for k in range(st.pp)]
    slowest = max(rank_s(k, n) for k, n in enumerate(counts))
    if fixed_rank_blocks(st, blocks) is None:
        # the remaining blocks one at a time to the rank whose stage grows least
        heap = [(rank_s(k, n + 1), k) for k, n in enumerate(counts)]
        heapq.heapify(heap)
        for _ in range(blocks - sum(counts)):
            grown, k = heapq.heappop(heap)
            counts[k] += 1
            slowest = max(slowest, grown)
            heapq.heappush(heap, (rank_s(k, counts[k] + 1), k))
    return slowest


def outside_pipeline_s(problem: LayoutProblem) -> float:
    """The part of ``tight_bound_s`` outside the pipeline's rounds: the average rank's optimizer
    step and exposed DP/ZeRO communication (``_step_s`` less its rounds)."""
    terms = problem.terms
    rounds = problem.strategy.micro_batches + terms.bubble_rounds
    return _step_s(terms, problem.blocks, problem.allowed, 0.0) - rounds * terms.p2p_s


def tight_stage_s(problem: LayoutProblem) -> float:
    """The slowest stage ``tight_bound_s`` takes: the higher of the two bounds'."""
    return max(lower_stage_s(problem), stage_bound_s(problem))


def tight_bound_s(problem: LayoutProblem) -> float:
    """``lower_bound_s`` with the slowest stage of ``stage_bound_s`` where that is higher (the
    step grows with the slowest stage: one ``_step_s`` of the higher one)."""
    return _step_s(problem.terms, problem.blocks, problem.allowed, tight_stage_s(problem))


__all__ = [
    "fastest_mix_s",
    "lower_bound_s",
    "lower_stage_s",
    "outside_pipeline_s",
    "stage_bound_s",
    "tight_bound_s",
    "tight_stage_s",
]
