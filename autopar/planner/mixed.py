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
import math
import time
from collections.abc import Iterator
from dataclasses import replace

from autopar.cost_models.mixed import ReplicaClass, mixed_estimate, replica_classes
from autopar.errors import StrategyError
from autopar.groups import MixedCluster
from autopar.planner.bounds import outside_pipeline_s, stage_bound_s, tight_bound_s
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


Placed = tuple[float, Strategy, tuple[str, ...], tuple[ReplicaClass, ...]]
"""A placement of an outer choice: its bound, strategy (with its shares), node groups, classes."""


def _placements(pricer: Pricer, mixed: MixedCluster, problem: LayoutProblem, cap: float) -> list[Placed]:
    """Every placement to try for the outer choice of ``problem`` with its bound, best first:
    stages on groups in every order, replicas on groups with even and with balanced shares."""
    st, prof = problem.strategy, pricer.profiles.at(problem.strategy.rank_sequences)

    def classes(s: Strategy, nodes: tuple[str, ...]) -> tuple[ReplicaClass, ...]:
        return replica_classes(
            prof,
            mixed,
            s,
            nodes,
            reserve_bytes=pricer.reserve_bytes,
            tp_layout=pricer.layouts(s),
            units=pricer.units,
        )

    tries = [(st, nodes, classes(st, nodes)) for nodes in stage_placements(mixed, st)]
    for nodes in replica_placements(mixed, st):
        even = classes(st, nodes)
        tries.append((st, nodes, even))  # even shares (ZeRO-2/3 run only these)
        counts = [g.world_size // (st.world_size // st.dp) for g in mixed.groups]  # replicas per group
        times = [c.terms[0].block["none"].time_s for c in even]  # one class per group
        for shares in balanced_shares(times, counts, st.global_batch // st.micro_batch):
            per = tuple(m for m, n in zip(shares, counts, strict=True) for _ in range(n))
            if len(set(per)) == 1:
                continue  # the even shares, tried above
            try:
                uneven = replace(st, dp_shares=per)
            except StrategyError:
                continue  # shares this strategy can't run (ZeRO-2/3, cp, ep)
            tries.append((uneven, nodes, classes(uneven, nodes)))
    rest = outside_pipeline_s(problem)
    placed = [(_placed_bound_s(problem, found, cap) + rest, s, nodes, found) for s, nodes, found in tries]
    return sorted(placed, key=lambda x: x[0])


def _placed_bound_s(problem: LayoutProblem, classes: tuple[ReplicaClass, ...], cap: float) -> float:
    """A placement's slowest pipeline at best: per class of replicas, its rounds times the
    slowest stage of ``bounds.stage_bound_s`` with each rank on its own device and memory (each
    class laid out on its own: a relaxation of the one layout every replica shares)."""
    worst = 0.0
    for c in classes:
        ranks = [(t, min(m, cap)) for t, m in zip(c.terms, c.capacity, strict=True)]
        rounds = c.micro_batches + c.terms[0].bubble_rounds
        worst = max(worst, rounds * (stage_bound_s(problem, ranks) + c.p2p_s))
    return worst


def mixed_search(
    request: PlanRequest, mixed: MixedCluster, pricer: Pricer, progress: Progress | None = None
) -> SearchResult:
    """Branch and bound over outer choices: first by their bounds on ``mixed.ideal()`` (which
    ``pricer`` prices; no placement runs faster), then by their placements' own bounds
    (``_placements``), each placement that can still win laid out by the layout ILP.

    The part of a bound outside the pipeline (optimizer, exposed DP) is the ideal cluster's
    (``bounds.outside_pipeline_s``): a slower group's longer backward could hide a little more DP
    traffic than that assumes, so on node groups the proof holds up to that overlap."""
    start, progress = time.perf_counter(), progress or _quiet
    allowed, knobs = _candidates(request, pricer)
    lean = request.constraints.tp_objective is None
    cap = request.constraints.memory_cap_bytes or float("inf")
    bounded, _, outer = _priced(pricer, knobs, request.capacity_bytes, allowed, progress, lean=lean)
    found: list[Candidate] = []
    ilps = visited = 0
    heap: list[tuple[float, int, int]] = [(bound, i, 0) for i, (bound, _) in enumerate(bounded)]
    heapq.heapify(heap)
    placements: dict[int, list[Placed]] = {}
    unproven = float("inf")  # the lowest bound left when the time ran out
    while heap:
        bound, i, state = heapq.heappop(heap)  # state 0: cheap bound, 1: tight, 2: placed
        k = request.proven_runners_up
        if len(found) > k and bound >= found[k].estimate.step_time_s:
            break  # no remaining outer choice can beat the best plan (or its k-th runner-up)
        if found and time.perf_counter() - start > request.time_limit_s:
            unproven = bound  # out of time: the best so far, its gap against what is left
            break
        problem = bounded[i][1]
        if state < 2:
            if state == 0:
                later = tight_bound_s(problem)
            else:
                placements[i] = _placements(pricer, mixed, problem, cap)
                later = placements[i][0][0] if placements[i] else math.inf
            heapq.heappush(heap, (max(bound, later), i, state + 1))
            continue
        visited += 1
        progress(visited, len(bounded), SOLVING)
        for placed_bound, st, nodes, classes in placements.pop(i):
            if len(found) > k and placed_bound >= found[k].estimate.step_time_s:
                break
            ilps += 1
            remaining = request.time_limit_s - (time.perf_counter() - start)
            limit = max(0.1, min(remaining, request.time_limit_s / 20))
            if (cand := _solve(pricer, mixed, problem, st, nodes, classes, cap, limit)) is not None:
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
    classes: tuple[ReplicaClass, ...],
    cap: float,
    time_limit_s: float,
) -> Candidate | None:
    """The layout ILP of ``st`` placed by ``nodes`` (its ``classes``), and its estimate (None:
    nothing fits)."""
    prof = pricer.profiles.at(st.rank_sequences)
    terms = replace(classes[0].terms[0], strategy=st)
    solved = solve_layout(
        LayoutProblem(terms, problem.blocks, cap, problem.allowed, classes), time_limit=time_limit_s
    )
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
    est = mixed_estimate(prof, mixed, chosen, nodes, classes=classes)
    return Candidate(strategy=chosen, estimate=est, gap=gap, node_groups=nodes) if est.fits else None


__all__ = ["balanced_shares", "mixed_search", "replica_placements", "stage_placements"]
