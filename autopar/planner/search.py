"""The search: the fastest predicted plan that fits, found by enumeration + one small ILP each.

Outer knobs (tp, pp, dp, micro-batch, schedule/v, sequence parallelism, ZeRO)
are few and discrete, so they are enumerated; the inner problem — how many
blocks each pipeline rank holds and which of them recompute (none, selective,
full, or a per-operator policy of ``recompute_ilp``) — is an integer program over
counts (identical blocks are interchangeable, so a layout is p × c integers, not
L × p binaries), solved
with PuLP + HiGHS (CBC if HiGHS is missing). Its objective and constraints are
``cost_models.terms`` verbatim, so a layout's ILP value equals its estimate.

Outer candidates whose memory can hold no layout at all are dropped (an exact
per-rank check); the rest are visited best lower bound first — perfect stage
balance, only the recompute memory forces, the DP exposure of an average rank
(a max of convex hinges is at least the hinge of the average), tightened per rank
for the choices the search reaches (``bounds``) — and the search stops once no
bound can beat the best plan found: branch and bound over the enumeration. An outer
choice whose even split attains its bound needs no ILP.
With tp > 1 the per-operator TP choice (``tp_layouts``) prices each width
with and without sequence parallelism, and, where they differ, with its
fastest and its leanest layout: the per-operator ILP trades time for memory,
the outer search knows which side of that trade a plan needs. GPipe is never
faster than 1F1B under the cost model but holds more activations, so it is
tried only on request.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models.estimate import Estimate
from autopar.errors import AutoparError
from autopar.planner.bounds import lower_bound_s, tight_bound_s
from autopar.planner.comm_knobs import comm_knobs
from autopar.planner.layout_ilp import LayoutProblem, fits_somehow, solve_layout
from autopar.planner.pricing import Pricer
from autopar.planner.recompute_ilp import recompute_choices
from autopar.recompute_policy import RECOMPUTE, RecomputePolicy
from autopar.request import Constraints, PlanRequest
from autopar.strategy import V_SHAPE, Strategy, fewest_blocks, remat, runs_with_policies, runs_with_zero


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """An evaluated outer choice with its best layout."""

    strategy: Strategy
    estimate: Estimate
    gap: float
    node_groups: tuple[str, ...] = ()
    """On a mixed cluster, the group of each node rank (``Plan.node_groups``)."""

    def to_dict(self, best_s: float, band: float = 0.0) -> dict[str, Any]:
        """JSON-ready: the strategy (``Strategy.to_dict``, as in a Plan) and its predicted step
        against ``best_s``, the chosen plan's; ``tied`` when it is slower by no more than
        ``band``, the chosen plan's held-out error band (``cost_models.bands``): the cost model
        cannot tell the two apart."""
        est = self.estimate
        return {
            "strategy": self.strategy.to_dict(),
            "step_time_s": est.step_time_s,
            "tflops_per_gpu": est.tflops_per_gpu,
            "fits": est.fits,
            "slower_by": est.step_time_s / best_s,
            "tied": est.step_time_s <= best_s * (1 + band),
            **({"node_groups": list(self.node_groups)} if self.node_groups else {}),
        }


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What the branch and bound found."""

    found: list[Candidate]
    ilps: int
    outer: int
    gap: float
    leanest: list[tuple[float, Strategy]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CP_MIN_POSITIONS = 8192
"""The fewest positions per rank a free search splits a sequence into (cp > 1 only where
s / cp ≥ this): context parallelism pays a K/V all-gather per block to cut activations and
attention, which matter at long sequences; at the 8,192 positions most models train at, the
search does not try it: with a floor of 4,096 the memory-tight Llama 3 8B FSDP plan at 8K
(``test_recompute_ilp``) moved to cp 2, and no corpus row measures cp at 8K in bf16 to say
whether it should. ``--cp`` fixes any degree."""


def _context_degrees(c: Constraints, *, seq: int, rest: int) -> list[int]:
    """cp choices for ``rest`` GPUs left by tp·pp: the constraint's, else 1 and every cp dividing
    them that cuts the sequence into 2·cp equal chunks of at least ``CP_MIN_POSITIONS`` / 2."""
    if c.cp is not None:
        return [c.cp] if rest % c.cp == 0 else []
    return [k for k in _divisors(rest) if k == 1 or (seq % (2 * k) == 0 and seq // k >= CP_MIN_POSITIONS)]


def _degrees(request: PlanRequest, blocks: int, heads: int | None) -> list[tuple[int, int, int, int]]:
    """(tp, pp, cp, dp) choices: TP inside a node dividing the heads, every PP that fits the
    blocks, CP where the sequence is long (``_context_degrees``), DP for the rest dividing the
    batch, as the constraints allow."""
    c, world, gpn = request.constraints, request.cluster.world_size, request.cluster.gpus_per_node
    tps = (
        [c.tp]
        if c.tp
        else [t for t in _divisors(gpn) if world % t == 0 and (heads is None or heads % t == 0)]
    )
    out = []
    for tp in tps:
        for pp in [c.pp] if c.pp else _divisors(world // tp):
            if pp > blocks or world % (tp * pp):
                continue
            for cp in _context_degrees(c, seq=request.seq, rest=world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if (c.dp and dp != c.dp) or request.global_batch % dp:
                    continue
                out.append((tp, pp, cp, dp))
    return out


VIRTUAL_STAGES = {"interleaved": (2, 3, 4, 6, 8), "interleaved-zb": (1, 2, 4, 8)}
"""The v a free search tries per looped schedule. Zero bubble skips 3 and 6: with them the
Llama-3 405B search on 16,384 GPUs solved 74 layout ILPs in 5.4 s, without 54 in 4.3 s, the
same plan (v 6 was 1% behind v 8)."""


FREE_V_PP = 8
"""The deepest pipeline a free search tries ZBV and DualPipeV on: their bubble is simulated on
torch's action lists (``cost_models.pipeline``), about 2 ms at pp 8 but 15 ms at pp 16 and
0.2 s at pp 64 per outer choice — with them at every depth GPT-3 175B on 1024 GPUs took 17 s to
plan. ``--schedule zbv`` or ``dualpipev`` prices them at any depth."""


def _schedules(c: Constraints, *, pp: int, micro_batches: int, blocks: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages): 1F1B, GPipe on request; interleaved 1F1B and interleaved zero
    bubble where the blocks fill pp·v chunks (one block each, but the embedding's and the
    head's: ``Strategy.min_rank_blocks``) and the micro-batches split into rounds of pp; ZBV and
    DualPipeV (v = 2) where there are at least 2·pp micro-batches (up to ``FREE_V_PP`` unless
    the constraints name them)."""
    out: list[tuple[str, int]] = []
    if c.schedule in (None, "1f1b"):
        out.append(("1f1b", 1))
    if c.schedule == "gpipe":
        out.append(("gpipe", 1))
    if pp == 1:
        return out
    for name, first in (("interleaved", 2), ("interleaved-zb", 1)):
        if c.schedule in (None, name) and micro_batches % pp == 0:
            for v in [c.virtual_stages] if c.virtual_stages else VIRTUAL_STAGES[name]:
                if v >= first and fewest_blocks(pp=pp, virtual_stages=v, schedule=name) <= blocks:
                    out.append((name, v))
    for name in V_SHAPE:
        named = c.schedule == name or (c.schedule is None and pp <= FREE_V_PP)
        wanted = named and c.virtual_stages in (None, 2)
        if (
            wanted
            and micro_batches >= 2 * pp
            and fewest_blocks(pp=pp, virtual_stages=2, schedule=name) <= blocks
        ):
            out.append((name, 2))
    return out


def _expert_degrees(c: Constraints, *, tp: int, dp: int, experts: int) -> list[int]:
    """ep choices: the constraint's where it fits; else 1 and, for a model with routed experts,
    every ep > 1 dividing both dp and the experts (``Strategy.ep``)."""
    fits = [e for e in _divisors(dp) if e == 1 or (experts and experts % e == 0)]
    return [e for e in fits if e == c.ep] if c.ep is not None else fits


def outer_strategies(
    request: PlanRequest,
    *,
    blocks: int,
    heads: int | None,
    policies: tuple[RecomputePolicy, ...] = (),
    experts: int = 0,
) -> list[Strategy]:
    """Every outer choice allowed by the model, the cluster and the constraints (each carrying
    the per-operator recompute ``policies`` its layout may use; ``experts``: routed experts per
    MoE layer, 0 for a dense model)."""
    knobs = outer_knobs(request, blocks=blocks, heads=heads, policies=policies, experts=experts)
    return [Strategy(**k) for k in knobs]


def outer_knobs(
    request: PlanRequest,
    *,
    blocks: int,
    heads: int | None,
    policies: tuple[RecomputePolicy, ...] = (),
    experts: int = 0,
) -> list[dict[str, Any]]:
    """``outer_strategies`` as the keyword arguments of each (the search builds a ``Strategy``
    only for the choices it prices), all with the same keys in the same order."""
    c = request.constraints
    out: list[dict[str, Any]] = []
    for tp, pp, cp, dp in _degrees(request, blocks, heads):
        per_replica = request.global_batch // dp
        # both where tp > 1: the per-operator layouts with and without SP issue different collectives
        sps = (
            [c.sequence_parallel] if c.sequence_parallel is not None else [False, True] if tp > 1 else [False]
        )
        compiles = [c.compile] if c.compile is not None else ["off", "block"]
        zeros = [c.zero] if c.zero is not None else ([0, 1, 2, 3] if dp > 1 else [0])
        eps = _expert_degrees(c, tp=tp, dp=dp, experts=experts) if cp == 1 else [1]
        # micro-batch sizes up to the largest tried (not every divisor of a huge batch)
        sizes = [c.micro_batch] if c.micro_batch else range(1, min(per_replica, c.max_micro_batch) + 1)
        for b in sizes:
            if b > c.max_micro_batch or per_replica % b:
                continue
            schedules = _schedules(c, pp=pp, micro_batches=per_replica // b, blocks=blocks)
            for (schedule, v), sp, zero, compiled, ep in itertools.product(
                schedules, sps, zeros, compiles, eps
            ):
                if (sp and tp == 1) or not runs_with_zero(schedule, zero):
                    continue
                fixed: dict[str, Any] = {
                    "tp": tp,
                    "pp": pp,
                    "dp": dp,
                    "cp": cp,
                    "ep": ep,
                    "expert_skew": c.expert_skew,
                    "zero": zero,
                }
                fixed |= {"micro_batch": b, "global_batch": request.global_batch, "seq": request.seq}
                fixed |= {"schedule": schedule, "virtual_stages": v, "sequence_parallel": sp}
                fixed |= {"dtype": request.dtype, "tp_objective": c.tp_objective or "time"}
                out.extend(
                    fixed
                    | {"grad_reduce": reduce, "dp_replicate": replicas, "powersgd_rank": rank}
                    | {"bucket_mb": bucket, "compile": compiled}
                    | {"policies": policies if runs_with_policies(schedule, pp) and cp == 1 else ()}
                    for reduce, replicas, rank, bucket in comm_knobs(
                        request, tp=tp, pp=pp, dp=dp, zero=zero, ep=ep, cp=cp
                    )
                )
    return measured_first(request.one_type, out)


def measured_first(cluster: Cluster, knobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With a measured compute profile, only the micro-batch sizes and TP widths it measured:
    the roofline that prices the others is optimistic or pessimistic by an unknown factor, and
    the search would favour whichever it flatters. All of them when none was measured (a
    constraint fixed an unmeasured knob: the estimate then says the roofline was used)."""
    measured = cluster.compute_profile
    if measured is None:
        return knobs
    kept = [
        k
        for k in knobs
        if measured.covers(
            micro_batch=k["micro_batch"],
            seq=k["seq"],
            tp=k["tp"],
            sp=k["sequence_parallel"],
            dtype=k["dtype"],
            compiled=k["compile"] == "block",
        )
    ]
    return kept or knobs


Progress = Callable[[int, int, str], None]
"""Told (done, total, what) as the search goes: pricing each outer choice, then solving each
one visited in bound order (done = total when the rest are bounded out); the convention of
``autopar profile``'s progress too."""
PRICING, SOLVING = "pricing outer choices", "solving layouts in bound order"


def _quiet(done: int, total: int, what: str) -> None:
    """The default ``Progress``: nobody is told."""


def search(request: PlanRequest, pricer: Pricer, progress: Progress | None = None) -> SearchResult:
    """Branch and bound over outer strategies: the optimum first, then the best ``top_k``
    runners-up met on the way (the search stops once no bound can beat the optimum, or the
    ``proven_runners_up``-th runner-up when the request asks for them proven).

    Also returns how many ILPs ran, the number of outer candidates, the proven relative gap
    of the best plan (nonzero only when an ILP ran out of time), and for infeasibility
    reports the (peak memory, strategy) of the leanest layouts tried.
    """
    start = time.perf_counter()
    progress = progress or _quiet
    allowed, knobs = _candidates(request, pricer)
    lean = request.constraints.tp_objective is None  # fastest and leanest TP layouts
    bounded, infeasible, outer = _priced(pricer, knobs, request.capacity_bytes, allowed, progress, lean=lean)
    found: list[Candidate] = []
    proven: list[float] = []
    ilps = visited = 0
    # Best bound first; a choice's cheap bound is tightened (``tight_bound_s``) when it comes up
    # and the choice goes back in line: only the few the search reaches pay for the tight one.
    heap = [(bound, i, False) for i, (bound, _) in enumerate(bounded)]
    heapq.heapify(heap)
    while heap:
        bound, i, tight = heapq.heappop(heap)
        k = request.proven_runners_up
        if len(found) > k and bound >= found[k].estimate.step_time_s:
            break  # no remaining outer choice can beat the best plan (or its k-th runner-up)
        problem = bounded[i][1]
        if not tight:
            heapq.heappush(heap, (tight_bound_s(problem), i, True))
            continue
        visited += 1
        progress(visited, len(bounded), SOLVING)
        cand = _even_split(pricer, problem, bound)
        if cand is None:
            # Each ILP gets a slice of the budget; one that runs out reports its proven gap.
            remaining = request.time_limit_s - (time.perf_counter() - start)
            ilps += 1
            cand = _best_layout(pricer, problem, min(remaining, request.time_limit_s / 20)) or _uniform(
                pricer, problem, bound
            )
            if cand is None:  # out of time before any layout, none uniform fits: only its bound
                proven.append(bound)
                continue
            proven.append(cand.estimate.step_time_s * (1 - cand.gap))  # no layout of it is faster
        found.append(cand)
        found.sort(key=lambda x: x.estimate.step_time_s)
    progress(len(bounded), len(bounded), SOLVING)
    best = found[0].estimate.step_time_s if found else math.inf
    gap = max([0.0, *((best - lb) / best for lb in proven if lb < best)]) if found else 0.0
    return SearchResult(
        found=found[: request.top_k + 1],
        ilps=ilps,
        outer=outer,
        gap=gap,
        leanest=[] if found else _leanest(pricer, infeasible, allowed),
    )


def _priced(
    pricer: Pricer,
    knobs: list[dict[str, Any]],
    capacity: float,
    allowed: tuple[str, ...],
    progress: Progress,
    *,
    lean: bool,
) -> tuple[list[tuple[float, LayoutProblem]], list[Strategy], int]:
    """Each outer choice's terms and cheap lower bound, those no layout fits (apart), and how
    many there were: each of ``knobs`` (``outer_knobs``) in its fastest TP layout and, with
    ``lean``, also its leanest where that differs (``TPLayouts.variants``).

    Widest ep first: a rank's memory never grows with ep (its routed experts' weights are
    1/ep of them, their gradients and optimizer states 1/dp under ZeRO, as at ep 1;
    ``rank_load.rank_memory_terms``), so where no layout fits at ep, none fits at a smaller
    ep with every other knob the same, and those are neither built nor priced (DeepSeek-V3 on
    2,048 GPUs: 35,791 of its 54,904 outer choices).
    """
    blocks = pricer.profiles.base.blocks
    infeasible: list[Strategy] = []
    bounded: dict[tuple[int, int], tuple[float, LayoutProblem]] = {}
    crowded: set[tuple[Any, ...]] = set()  # knobs but ep of a choice no layout fits
    total = 0
    for done, i in enumerate(sorted(range(len(knobs)), key=lambda i: -knobs[i]["ep"])):
        progress(done, len(knobs), PRICING)
        twins = [knobs[i]]
        if (
            lean
            and twins[0]["tp"] > 1
            and twins[0]["tp_objective"] == "time"
            and _lean_pays(pricer, twins[0])
        ):
            twins.append(twins[0] | {"tp_objective": "memory"})
        total += len(twins)
        for j, variant in enumerate(twins):
            but_ep = tuple(v for name, v in variant.items() if name != "ep")
            if but_ep in crowded:
                continue  # a wider ep of it fits nothing: neither does this one
            st = Strategy(**variant)
            mine = tuple(r for r in allowed if r in st.choices)  # no policies under a zero-bubble pipeline
            problem = LayoutProblem(pricer.terms(st), blocks, capacity, mine)
            if not mine or not fits_somehow(problem):
                infeasible.append(st)
                crowded.add(but_ep)
                continue
            bounded[i, j] = (lower_bound_s(problem), problem)
    progress(len(knobs), len(knobs), PRICING)
    return [bounded[k] for k in sorted(bounded)], infeasible, total


def _lean_pays(pricer: Pricer, knobs: dict[str, Any]) -> bool:
    """``TPLayouts.lean_pays_for`` (a strategy built only the first time per TP width and SP)."""
    known = pricer.layouts.lean_pays.get((knobs["tp"], knobs["sequence_parallel"]))
    return known if known is not None else pricer.layouts.lean_pays_for(Strategy(**knobs))


def _candidates(request: PlanRequest, pricer: Pricer) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """The recompute choices allowed (``sac``: the model's per-operator policies, which every
    strategy then carries) and the outer choices' knobs (``_priced`` adds their leanest TP
    layout where the constraints leave it open)."""
    c, base = request.constraints, pricer.profiles.base
    wants = any(r not in RECOMPUTE for r in c.recompute)  # per-operator policies allowed
    allowed, policies = recompute_choices(c.recompute, pricer.policies if wants else ())
    pipelined = c.schedule is not None and not runs_with_policies(c.schedule, c.pp or 2)  # any pp > 1
    if pipelined and not set(allowed) & set(RECOMPUTE):
        raise AutoparError(
            f"--schedule {c.schedule} cannot run per-operator recompute policies (it runs backward twice "
            "over each block; torch's selective checkpointing replays once): allow none, selective or full"
        )
    knobs = outer_knobs(
        request, blocks=base.blocks, heads=base.heads, policies=policies, experts=base.experts
    )
    return allowed, knobs


def _even_split(pricer: Pricer, problem: LayoutProblem, bound: float) -> Candidate | None:
    """The even split without recompute, when it attains the outer choice's bound and fits (no
    ILP needed); else None."""
    st = problem.strategy
    even = pricer.estimate(st)  # no recompute
    attains_bound = even.step_time_s <= bound * (1 + 1e-12) and "none" in problem.allowed
    if attains_bound and max(mm.peak_bytes for mm in even.memory) <= problem.capacity:
        layout = tuple(st.blocks_per_rank(problem.blocks))
        return Candidate(strategy=replace(st, layout=layout), estimate=even, gap=0.0)
    return None


def _best_layout(pricer: Pricer, problem: LayoutProblem, time_limit_s: float) -> Candidate | None:
    """The layout ILP's optimum for the outer choice of ``problem`` (within ``time_limit_s``;
    None when the time ran out before a layout was found)."""
    solved = solve_layout(problem, time_limit=max(0.1, time_limit_s))
    if solved is None:
        return None
    layout, gap = solved
    chosen = replace(problem.strategy, layout=layout, recompute="none")
    return Candidate(strategy=chosen, estimate=pricer.estimate(chosen), gap=gap)


def _uniform(pricer: Pricer, problem: LayoutProblem, bound: float) -> Candidate | None:
    """When the layout ILP ran out of time with nothing found: the fastest even split with one
    recompute choice for every block that fits (its gap against the bound), else None."""
    for choice in sorted(problem.allowed, key=lambda r: problem.terms.block[r].time_s):
        st = replace(problem.strategy, recompute=choice)
        est = pricer.estimate(st)
        if max(mm.peak_bytes for mm in est.memory) <= problem.capacity:
            chosen = replace(st, layout=tuple(st.blocks_per_rank(problem.blocks)), recompute="none")
            gap = max(0.0, (est.step_time_s - bound) / est.step_time_s)
            return Candidate(strategy=chosen, estimate=est, gap=gap)
    return None


def _leanest(
    pricer: Pricer, infeasible: list[Strategy], allowed: tuple[str, ...]
) -> list[tuple[float, Strategy]]:
    """For the error message: (peak memory, strategy) of the leanest even split of each outer
    choice, leanest first."""
    leanest = []
    for st in infeasible:
        # full, else the leanest policy allowed (policies are listed leanest first) that st runs
        mine = [r for r in ("full", *allowed) if r in allowed and r in st.choices and remat(r)]
        lean = replace(st, recompute=mine[0] if mine else st.recompute)
        est = pricer.estimate(lean)
        leanest.append((max(mm.peak_bytes for mm in est.memory), lean))
    return sorted(leanest, key=lambda x: x[0])


__all__ = [
    "Candidate",
    "Progress",
    "SearchResult",
    "lower_bound_s",
    "outer_knobs",
    "outer_strategies",
    "search",
]
