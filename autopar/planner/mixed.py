"""Planning on a mixed cluster (``groups.MixedCluster``): the outer choices of one type of node,
each tried in the placements its degrees allow, each placement's layout solved by the layout ILP
with every rank on its own device (``LayoutProblem.classes``).

Two placements per outer choice (Metis, Um et al. ATC'24, searches the same two axes):

- *stages on groups*: the pipeline ranks in order over the groups (every ordering), a group
  holding N_g / (dp·cp·tp) whole pipeline ranks; the ILP gives a faster group's ranks more
  blocks and a group with more memory fewer recomputed ones;
- *replicas on groups*: whole data-parallel replicas in each group, N_g / (pp·cp·tp) of them,
  a faster group's replicas running more of the global batch's micro-batches
  (``Strategy.dp_shares``, where ``runs.shares_problem`` allows: ZeRO 0–1), sized so that every
  replica's pipeline takes about as long.

The search orders outer choices by their bounds on ``MixedCluster.ideal`` (the best of every
group's numbers: no placement runs faster) and stops, as the single-type search does, when no
bound can beat the best plan found.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import replace

from autopar.cost_models.mixed import mixed_estimate, replica_classes
from autopar.errors import StrategyError
from autopar.groups import MixedCluster
from autopar.planner.bounds import tight_bound_s
from autopar.planner.layout_ilp import LayoutProblem, solve_layout
from autopar.planner.pricing import Pricer
from autopar.planner.search import SOLVING, Candidate, Progress, SearchResult, _candidates, _priced, _quiet
from autopar.request import PlanRequest
from autopar.strategy import Strategy, check_strategy

MAX_ORDERS = 6
"""Group orderings tried for stages on groups (all of them up to 3 groups)."""


def stage_placements(mixed: MixedCluster, st: Strategy) -> Iterator[tuple[str, ...]]:
    """Node groups by node rank that put whole pipeline ranks on each group, one per ordering."""
    block = st.world_size // st.pp  # ranks of one pipeline rank: dp·cp·tp
    if st.pp < 2 or block % mixed.gpus_per_node or any(g.world_size % block for g in mixed.groups):
        return
    for order in itertools.islice(itertools.permutations(mixed.groups), MAX_ORDERS):
        yield tuple(g.name for g in order for _ in range(g.num_nodes))


def replica_placements(mixed: MixedCluster, st: Strategy) -> Iterator[tuple[str, ...]]:
    """Node groups by node rank that put whole replicas on each group (replicas of one group
    next to each other in every pipeline rank's block of nodes)."""
    replica = st.world_size // st.dp  # ranks of one replica: pp·cp·tp
    cell = replica // st.pp  # of one replica at one pipeline rank: cp·tp
    if st.dp < 2 or any(g.world_size % replica for g in mixed.groups):
        return
    per_block = [g.world_size // replica * cell for g in mixed.groups]  # a group's ranks per block
    if any(n % mixed.gpus_per_node for n in per_block):
        return  # a node would hold two groups' ranks
    yield tuple(
        g.name
        for _ in range(st.pp)
        for g, n in zip(mixed.groups, per_block, strict=True)
        for _ in range(n // mixed.gpus_per_node)
    )


def balanced_shares(times_s: list[float], replicas: list[int], total: int) -> list[list[int]]:
    """Micro-batches per replica of each group (``replicas[g]`` replicas whose pipelines take
    ``times_s[g]`` per micro-batch), Σ replicas·shares = ``total``: the integer solutions
    nearest the shares that make every pipeline equally long (m_g ∝ 1 / t_g), at most two."""
    speed = [1 / t for t in times_s]
    scale = total / sum(r * s for r, s in zip(replicas, speed, strict=True))
    ideal = [s * scale for s in speed]
    found = []
    for base in itertools.product(*({max(1, int(x)), int(x) + 1} for x in ideal[:-1])):
        rest = total - sum(r * m for r, m in zip(replicas[:-1], base, strict=True))
        if rest >= replicas[-1] and rest % replicas[-1] == 0:
            found.append([*base, rest // replicas[-1]])
    found.sort(key=lambda m: max(x * t for x, t in zip(m, times_s, strict=True)))
    return found[:2]


def _placements(
    pricer: Pricer, mixed: MixedCluster, st: Strategy
) -> Iterator[tuple[Strategy, tuple[str, ...]]]:
    """Every (strategy, node groups) to try for the outer choice ``st``."""
    for nodes in stage_placements(mixed, st):
        yield st, nodes
    for nodes in replica_placements(mixed, st):
        yield st, nodes  # even shares (ZeRO-2/3 run only these)
        per_replica = st.world_size // st.dp
        counts = [g.world_size // per_replica for g in mixed.groups]
        prof = pricer.profiles.at(st.rank_sequences)
        times = [
            c.terms[0].block["none"].time_s
            for c in replica_classes(prof, mixed, st, nodes, tp_layout=pricer.layouts(st), units=pricer.units)
        ]
        if len(times) != len(mixed.groups):
            continue
        for shares in balanced_shares(times, counts, st.global_batch // st.micro_batch):
            per = tuple(m for m, n in zip(shares, counts, strict=True) for _ in range(n))
            if len(set(per)) > 1:
                try:
                    yield replace(st, dp_shares=per), nodes
                except StrategyError:
                    continue


def slower_blocks_s(pricer: Pricer, mixed: MixedCluster, problem: LayoutProblem) -> float:
    """What the groups' slower devices add at least to a bound on ``mixed.ideal()``: the blocks'
    m micro-batches of work W = m·L·u (u a block's time on the ideal device) are done by N GPUs
    of which group g's N_g take r_g = u_g / u times as long per block, so the slowest pipeline
    (stages on groups, or replicas on groups with any shares) takes at least W/N · F,
    F = N / Σ_g (N_g / r_g); the ideal bound counted W/N. The embedding and head stay at the
    ideal's speed, so the sum remains a bound."""
    st, terms = problem.strategy, problem.terms
    u = terms.block["none"].time_s
    slow = [pricer.units(st, mixed.view(g))[0]["none"].time_s / u for g in range(len(mixed.groups))]
    factor = mixed.world_size / sum(
        g.world_size / max(1.0, r) for g, r in zip(mixed.groups, slow, strict=True)
    )
    return (factor - 1) * st.micro_batches * problem.blocks * u / st.pp


def mixed_search(
    request: PlanRequest, mixed: MixedCluster, pricer: Pricer, progress: Progress | None = None
) -> SearchResult:
    """Branch and bound over outer choices (bounds on ``mixed.ideal()``, which ``pricer``
    prices), each placed every way ``_placements`` allows and laid out by the layout ILP."""
    start, progress = time.perf_counter(), progress or _quiet
    allowed, knobs = _candidates(request, pricer)
    lean = request.constraints.tp_objective is None
    cap = request.constraints.memory_cap_bytes or float("inf")
    bounded, _, outer = _priced(pricer, knobs, request.capacity_bytes, allowed, progress, lean=lean)
    found: list[Candidate] = []
    ilps = visited = 0
    heap = [(bound, i, False) for i, (bound, _) in enumerate(bounded)]
    heapq.heapify(heap)
    unproven = float("inf")  # the lowest bound left when the time ran out
    while heap:
        bound, i, tight = heapq.heappop(heap)
        k = request.proven_runners_up
        if len(found) > k and bound >= found[k].estimate.step_time_s:
            break  # no remaining outer choice can beat the best plan (or its k-th runner-up)
        if found and time.perf_counter() - start > request.time_limit_s:
            unproven = bound  # out of time: the best so far, its gap against what is left
            break
        problem = bounded[i][1]
        if not tight:
            heapq.heappush(heap, (tight_bound_s(problem) + slower_blocks_s(pricer, mixed, problem), i, True))
            continue
        visited += 1
        progress(visited, len(bounded), SOLVING)
        remaining = request.time_limit_s - (time.perf_counter() - start)
        for st, nodes in _placements(pricer, mixed, problem.strategy):
            ilps += 1
            cand = _solve(
                pricer, mixed, problem, st, nodes, cap, max(0.1, min(remaining, request.time_limit_s / 20))
            )
            if cand is not None:
                found.append(cand)
        found.sort(key=lambda x: x.estimate.step_time_s)
    progress(len(bounded), len(bounded), SOLVING)
    best = found[0].estimate.step_time_s if found else unproven
    gap = max(0.0, (best - unproven) / best, *(c.gap for c in found[:1]))
    return SearchResult(found=found[: request.top_k + 1], ilps=ilps, outer=outer, gap=gap, leanest=[])


def _solve(
    pricer: Pricer,
    mixed: MixedCluster,
    problem: LayoutProblem,
    st: Strategy,
    nodes: tuple[str, ...],
    cap: float,
    time_limit_s: float,
) -> Candidate | None:
    """The layout ILP of ``st`` placed by ``nodes``, and its estimate (None: nothing fits)."""
    prof, layout = pricer.profiles.at(st.rank_sequences), pricer.layouts(st)
    reserve = pricer.reserve_bytes
    classes = replica_classes(
        prof, mixed, st, nodes, reserve_bytes=reserve, tp_layout=layout, units=pricer.units
    )
    terms = replace(classes[0].terms[0], strategy=st)
    placed = LayoutProblem(terms, problem.blocks, cap, problem.allowed, classes)
    solved = solve_layout(placed, time_limit=time_limit_s)
    if solved is None:
        return None
    counts, gap = solved
    chosen = replace(st, layout=counts, recompute="none")
    try:
        check_strategy(
            chosen, world_size=mixed.world_size, blocks=prof.blocks, heads=prof.heads, experts=prof.experts
        )
    except StrategyError:
        return None  # a share count the schedule refuses (e.g. interleaving's multiple of pp)
    est = mixed_estimate(
        prof, mixed, chosen, nodes, reserve_bytes=reserve, tp_layout=layout, units=pricer.units
    )
    return Candidate(strategy=chosen, estimate=est, gap=gap, node_groups=nodes) if est.fits else None


__all__ = ["balanced_shares", "mixed_search", "replica_placements", "stage_placements"]
