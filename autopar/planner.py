"""The planner: the fastest predicted plan that fits, found by enumeration + one small ILP each.

Outer knobs (tp, pp, dp, micro-batch, schedule/v, sequence parallelism, ZeRO)
are few and discrete, so they are enumerated; the inner problem — how many
blocks each pipeline rank holds and which of them recompute (none, selective,
full) — is an integer program over counts (identical blocks are
interchangeable, so a layout is p × 3 integers, not L × p binaries), solved
with PuLP + HiGHS (CBC if HiGHS is missing). Its objective and constraints are
``cost_models.terms`` verbatim, so a layout's ILP value equals its estimate.

Outer candidates whose memory can hold no layout at all are dropped (an exact
per-rank check); the rest are visited best lower bound first — perfect stage
balance, only the recompute memory forces, the DP exposure of an average rank
(a max of convex hinges is at least the hinge of the average) — and the search
stops once no bound can beat the best plan found: branch and bound over the
enumeration. An outer choice whose even split attains its bound needs no ILP.
With tp > 1 the per-operator TP choice (``tp_layouts``) prices each width
with and without sequence parallelism, and, where they differ, with its
fastest and its leanest layout: the per-operator ILP trades time for memory,
the outer search knows which side of that trade a plan needs. GPipe is never
faster than 1F1B under the cost model but holds more activations, so it is
tried only on request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models.estimate import Estimate, estimate, stage_layer_names
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.strategy import RECOMPUTE, Strategy, StrategyError
from autopar.cost_models.terms import (
    RankLoad,
    Terms,
    Units,
    build_terms,
    dp_exposed_s,
    layer_units,
    rank_load,
)
from autopar.errors import AutoparError
from autopar.layout_ilp import fits_somehow, max_blocks, solve_layout
from autopar.plan import Plan, StagePlan, validate_plan
from autopar.tp_layouts import TPLayouts, lay, tp_tables


class InfeasibleError(AutoparError):
    """No plan fits in memory (the message says what would)."""


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """What the user fixed or forbade; None means free."""

    tp: int | None = None
    """Fix the tensor-parallel degree."""
    pp: int | None = None
    """Fix the pipeline-parallel degree."""
    dp: int | None = None
    """Fix the data-parallel degree."""
    zero: int | None = None
    """Fix the ZeRO stage."""
    micro_batch: int | None = None
    """Fix the micro-batch size."""
    schedule: str | None = None
    """Fix the schedule (gpipe, 1f1b, interleaved)."""
    virtual_stages: int | None = None
    """Fix v for the interleaved schedule."""
    sequence_parallel: bool | None = None
    """Force sequence parallelism on or off."""
    tp_objective: str | None = None
    """Fix what the per-operator TP choice minimises: ``time`` or ``memory`` (None: both are
    priced where their layouts differ)."""
    recompute: tuple[str, ...] = RECOMPUTE
    """Recompute choices allowed per block."""
    memory_cap_bytes: float | None = None
    """Plan for at most this much memory per GPU (below the device's)."""
    max_micro_batch: int = 16
    """Largest micro-batch tried."""
    reserve_bytes: float | None = None
    """Memory kept back per GPU (default: 1 GiB context + 5% for fragmentation)."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """An evaluated outer choice with its best layout."""

    strategy: Strategy
    estimate: Estimate
    gap: float


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What the branch and bound found."""

    found: list[Candidate]
    ilps: int
    outer: int
    gap: float
    leanest: list[tuple[float, Strategy]]


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """The plan and the evidence for it."""

    plan: Plan
    alternatives: tuple[Candidate, ...]
    """Runners-up with other outer knobs, best first."""
    baselines: dict[str, Candidate | None]
    """Named hand strategies under the same cost model (None where it does not fit)."""
    solve_time_s: float
    ilps_solved: int
    outer_candidates: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def outer_strategies(
    cluster: Cluster,
    *,
    blocks: int,
    heads: int | None,
    global_batch: int,
    seq: int,
    dtype: str,
    c: Constraints,
) -> list[Strategy]:
    """Every outer choice allowed by the model, the cluster and the constraints."""
    world, gpn = cluster.world_size, cluster.gpus_per_node
    out = []
    tps = (
        [c.tp]
        if c.tp
        else [t for t in _divisors(gpn) if world % t == 0 and (heads is None or heads % t == 0)]
    )
    for tp in tps:
        # both where tp > 1: the per-operator layouts with and without SP issue different collectives
        sp_options = [False, True] if tp > 1 else [False]
        for pp in [c.pp] if c.pp else _divisors(world // tp):
            if pp > blocks or world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if (c.dp and dp != c.dp) or global_batch % dp:
                continue
            per_replica = global_batch // dp
            micro = [c.micro_batch] if c.micro_batch else _divisors(per_replica)
            for b in micro:
                if b > c.max_micro_batch or per_replica % b:
                    continue
                m = per_replica // b
                schedules: list[tuple[str, int]] = []
                if c.schedule in (None, "1f1b"):
                    schedules.append(("1f1b", 1))
                if c.schedule == "gpipe":
                    schedules.append(("gpipe", 1))
                if c.schedule in (None, "interleaved") and pp > 1 and m % pp == 0:
                    for v in [c.virtual_stages] if c.virtual_stages else [2, 3, 4, 6, 8]:
                        if v and v > 1 and blocks % (pp * v) == 0:
                            schedules.append(("interleaved", v))
                sps = [c.sequence_parallel] if c.sequence_parallel is not None else sp_options
                zeros = [c.zero] if c.zero is not None else ([0, 1, 2, 3] if dp > 1 else [0])
                for (schedule, v), sp, zero in ((s, sp, z) for s in schedules for sp in sps for z in zeros):
                    if sp and tp == 1:
                        continue
                    out.append(
                        Strategy(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            zero=zero,
                            micro_batch=b,
                            global_batch=global_batch,
                            seq=seq,
                            schedule=schedule,
                            virtual_stages=v,
                            sequence_parallel=sp,
                            dtype=dtype,
                            tp_objective=c.tp_objective or "time",
                        )
                    )
    return measured_first(cluster, out)


def measured_first(cluster: Cluster, strategies: list[Strategy]) -> list[Strategy]:
    """With a measured compute profile, only the micro-batch sizes and TP widths it measured:
    the roofline that prices the others is optimistic or pessimistic by an unknown factor, and
    the search would favour whichever it flatters. All of them when none was measured (a
    constraint fixed an unmeasured knob: the estimate then says the roofline was used)."""
    measured = cluster.compute_profile
    if measured is None:
        return strategies
    kept = [
        s
        for s in strategies
        if measured.covers(
            micro_batch=s.micro_batch, seq=s.seq, tp=s.tp, sp=s.sequence_parallel, dtype=s.dtype
        )
    ]
    return kept or strategies


def lower_bound_s(
    terms: Terms, blocks: int, capacity: float = math.inf, allowed: tuple[str, ...] = ("none",)
) -> float:
    """A bound no layout beats: perfect balance, no DP traffic, and only as much recompute as
    memory forces (blocks that no rank can hold without it pay the cheapest recompute)."""
    st = terms.strategy
    u = terms.block["none"]
    without = sum(min(max_blocks(terms, k, capacity, "none"), blocks) for k in range(st.pp))
    forced = max(0, blocks - without) if "none" in allowed else blocks
    extras = [terms.block[r].time_s - u.time_s for r in allowed if r != "none"]
    total = (
        blocks * u.time_s + forced * (min(extras) if extras else 0.0) + terms.embed.time_s + terms.head.time_s
    )
    per_rank = max(total / st.pp, terms.embed.time_s, terms.head.time_s, u.time_s)
    params = blocks * u.params + terms.embed.params + terms.head.params
    # DP/ZeRO exposure is a max over ranks of convex hinges: at least that of the average rank,
    # taken with every block's backward as long as allowed (most overlap) and no re-gathering.
    longest = max((terms.block[r] for r in allowed), key=lambda x: x.bwd_s)
    edges = (terms.embed, terms.head)
    average = RankLoad(
        fwd_s=(blocks * u.fwd_s + sum(e.fwd_s for e in edges)) / st.pp,
        bwd_compute_s=(blocks * u.bwd_compute_s + sum(e.bwd_compute_s for e in edges)) / st.pp,
        recompute_s=0.0,
        tp_s=0.0,
        bwd_s=(blocks * longest.bwd_s + sum(e.bwd_s for e in edges)) / st.pp,
        params=params / st.pp,
        full_params=0.0,
        layers=(blocks + 2) // st.pp,
        full_layers=0,
        act_bytes=0.0,
        has_full=False,
    )
    rounds = st.micro_batches + (st.pp - 1) / st.virtual_stages
    return (
        rounds * (per_rank + terms.p2p_s)
        + params / st.pp * terms.opt_s_per_param
        + dp_exposed_s(terms, average)
    )


def _price(
    prof: ModelProfile, cluster: Cluster, st: Strategy, c: Constraints, layouts: TPLayouts | None
) -> Estimate:
    """The estimate the search compares: the constraints' reserve, TP priced by its layout."""
    return estimate(prof, cluster, st, reserve_bytes=c.reserve_bytes, tp_layout=lay(layouts, st))


def search(
    profile_at: Callable[[int], ModelProfile],
    cluster: Cluster,
    *,
    global_batch: int,
    seq: int,
    dtype: str = "bf16",
    constraints: Constraints = Constraints(),
    top_k: int = 5,
    time_limit_s: float = 10.0,
    layouts: TPLayouts | None = None,
) -> SearchResult:
    """Branch and bound over outer strategies: the optimum first, then the best ``top_k − 1``
    runners-up met on the way (the search stops once no bound can beat the optimum).

    Also returns how many ILPs ran, the number of outer candidates, the proven relative gap
    of the best plan (nonzero only when an ILP ran out of time), and for infeasibility
    reports the (peak memory, strategy) of the leanest layouts tried.
    """
    start = time.perf_counter()
    base = profile_at(1)
    capacity = min(cluster.device.memory_bytes, constraints.memory_cap_bytes or math.inf)
    strategies = outer_strategies(
        cluster,
        blocks=base.blocks,
        heads=base.heads,
        global_batch=global_batch,
        seq=seq,
        dtype=dtype,
        c=constraints,
    )
    if layouts is not None and constraints.tp_objective is None:  # fastest and leanest TP layouts
        strategies = [v for st in strategies for v in layouts.variants(st)]
    infeasible: list[tuple[Strategy, ModelProfile]] = []
    units_cache: dict[tuple[int, bool, str, int], Units] = {}
    profiles: dict[int, ModelProfile] = {}
    bounded = []
    for st in strategies:
        key = (st.tp, st.sequence_parallel, st.tp_objective, st.micro_batch)
        if st.micro_batch not in profiles:
            profiles[st.micro_batch] = profile_at(st.micro_batch)
        prof = profiles[st.micro_batch]
        if key not in units_cache:
            units_cache[key] = layer_units(prof, cluster, st, lay(layouts, st))
        terms = build_terms(
            prof, cluster, st, units=units_cache[key], reserve_bytes=constraints.reserve_bytes
        )
        if not fits_somehow(terms, base.blocks, capacity, constraints.recompute):
            infeasible.append((st, prof))
            continue
        bounded.append((lower_bound_s(terms, base.blocks, capacity, constraints.recompute), st, terms, prof))
    bounded.sort(key=lambda x: x[0])
    found: list[Candidate] = []
    proven: list[float] = []
    ilps = 0
    for bound, st, terms, prof in bounded:
        if found and bound >= found[0].estimate.step_time_s:
            break  # no remaining outer choice can beat the best plan
        even = _price(prof, cluster, st, constraints, layouts)  # no recompute
        attains_bound = even.step_time_s <= bound * (1 + 1e-12) and "none" in constraints.recompute
        if attains_bound and max(mm.peak_bytes for mm in even.memory) <= capacity:
            found.append(
                Candidate(
                    strategy=replace(st, layout=tuple(st.blocks_per_rank(base.blocks))),
                    estimate=even,
                    gap=0.0,
                )
            )  # the even split attains the bound
            found.sort(key=lambda c: c.estimate.step_time_s)
            continue
        # Each ILP gets a slice of the budget; one that runs out reports its proven gap.
        remaining = time_limit_s - (time.perf_counter() - start)
        ilps += 1
        solved = solve_layout(
            terms,
            blocks=base.blocks,
            capacity=capacity,
            allowed=constraints.recompute,
            time_limit=max(0.1, min(remaining, time_limit_s / 20)),
        )
        assert solved is not None, "fits_somehow said a layout exists"
        layout, gap = solved
        chosen = replace(st, layout=layout, recompute="none")
        est = _price(prof, cluster, chosen, constraints, layouts)
        found.append(Candidate(strategy=chosen, estimate=est, gap=gap))
        found.sort(key=lambda c: c.estimate.step_time_s)
        proven.append(est.step_time_s * (1 - gap))  # no layout of this outer choice is faster
    leanest: list[tuple[float, Strategy]] = []
    if not found:  # for the error message: the leanest even split of each outer choice
        for st, prof in infeasible:
            lean = replace(st, recompute="full" if "full" in constraints.recompute else st.recompute)
            est = _price(prof, cluster, lean, constraints, layouts)
            leanest.append((max(mm.peak_bytes for mm in est.memory), lean))
    best = found[0].estimate.step_time_s if found else math.inf
    gap = max([0.0, *((best - lb) / best for lb in proven if lb < best)]) if found else 0.0
    return SearchResult(
        found=found[:top_k],
        ilps=ilps,
        outer=len(strategies),
        gap=gap,
        leanest=sorted(leanest, key=lambda x: x[0]),
    )


def baselines(
    profile_at: Callable[[int], ModelProfile],
    cluster: Cluster,
    *,
    global_batch: int,
    seq: int,
    dtype: str,
    constraints: Constraints = Constraints(),
    layouts: TPLayouts | None = None,
) -> dict[str, Candidate | None]:
    """Named hand strategies priced by the same cost model (None where nothing fits):

    - ``zero3 data parallel``: every GPU a data-parallel rank, ZeRO-3, full recompute;
    - ``tp=gpus/node, pp across nodes``: TP over a node's GPUs with sequence parallelism,
      the fewest pipeline stages that fit (even split, full recompute), DP for the rest.
    """
    prof = profile_at(1)
    world, gpn = cluster.world_size, cluster.gpus_per_node
    capacity = min(cluster.device.memory_bytes, constraints.memory_cap_bytes or math.inf)

    def fits(est: Estimate) -> bool:
        return all(mm.peak_bytes <= capacity for mm in est.memory)

    out: dict[str, Candidate | None] = {"zero3 data parallel": None, "tp=gpus/node, pp across nodes": None}
    if global_batch % world == 0:
        z3 = Strategy(dp=world, zero=3, global_batch=global_batch, seq=seq, recompute="full", dtype=dtype)
        est = _price(prof, cluster, z3, constraints, layouts)
        out["zero3 data parallel"] = Candidate(strategy=z3, estimate=est, gap=0.0) if fits(est) else None
    tp = max(t for t in _divisors(gpn) if prof.heads is None or prof.heads % t == 0)
    for pp in _divisors(world // tp):
        dp = world // (tp * pp)
        if pp > prof.blocks or global_batch % dp:
            continue
        st = Strategy(
            tp=tp,
            pp=pp,
            dp=dp,
            global_batch=global_batch,
            seq=seq,
            recompute="full",
            sequence_parallel=tp > 1,
            dtype=dtype,
        )
        est = _price(prof, cluster, st, constraints, layouts)
        if fits(est):
            out["tp=gpus/node, pp across nodes"] = Candidate(strategy=st, estimate=est, gap=0.0)
            break
    return out


def to_plan(
    model: str,
    cluster: Cluster,
    cand: Candidate,
    profile: ModelProfile,
    solve_time_s: float,
    *,
    captured: Any = None,
    layouts: TPLayouts | None = None,
) -> Plan:
    """Wrap a candidate as a Plan keyed by layer names."""
    st, est = cand.strategy, cand.estimate
    terms = build_terms(profile, cluster, st, tp_layout=lay(layouts, st))
    counts = st.blocks_per_rank(profile.blocks)
    loads = [rank_load(terms, k, c) for k, c in enumerate(counts)]
    edge = (profile.layer_names[0], profile.layer_names[-1])
    stages = []
    for k, layers in enumerate(stage_layer_names(profile, st)):
        blocks = [x for x in layers if x not in edge]
        none, sel, full = counts[k]
        choice = ["full"] * full + ["selective"] * sel + ["none"] * none
        stages.append(
            StagePlan(
                index=k,
                layers=tuple(layers),
                recompute=tuple(zip(blocks, choice, strict=True)),
                peak_bytes=est.memory[k].peak_bytes,
                time_per_micro_batch_s=loads[k].time_s,
                comm_per_micro_batch_s=loads[k].tp_s,
            )
        )
    gpn = cluster.gpus_per_node
    crosses = tuple(
        name
        for name, size, stride in (("pp", st.pp, st.tp * st.dp), ("dp", st.dp, st.tp), ("tp", st.tp, 1))
        if size > 1 and size * stride > gpn
    )
    return Plan(
        model=model,
        cluster=cluster.to_dict(),
        strategy=st,
        mesh=(("pp", st.pp), ("dp", st.dp), ("tp", st.tp)),
        crosses_nodes=crosses,
        stages=tuple(stages),
        predicted=est.to_dict(),
        solve_time_s=solve_time_s,
        optimality_gap=cand.gap,
        tensor_parallel=tp_tables(
            profile,
            cluster,
            st.tp,
            st.dtype,
            sp=st.sequence_parallel,
            objective=st.tp_objective,
            captured=captured,
        ),
    )


def make_plan(
    model: str,
    profile_at: Callable[[int], ModelProfile],
    cluster: Cluster,
    *,
    global_batch: int,
    seq: int,
    dtype: str = "bf16",
    constraints: Constraints = Constraints(),
    top_k: int = 5,
    time_limit_s: float = 10.0,
) -> PlanResult:
    """Search, then wrap the best candidate as a Plan with runners-up and baselines.

    Raises ``InfeasibleError`` when no plan fits, naming the leanest plan tried,
    the memory it would need and the knobs that would help.
    """
    start = time.perf_counter()
    base = profile_at(1)
    check_constraints(constraints, cluster, blocks=base.blocks, heads=base.heads)
    layouts = TPLayouts(profile_at, cluster, dtype)
    res = search(
        profile_at,
        cluster,
        global_batch=global_batch,
        seq=seq,
        dtype=dtype,
        constraints=constraints,
        top_k=top_k + 1,
        time_limit_s=time_limit_s,
        layouts=layouts,
    )
    if not res.found:
        raise _infeasible(cluster, res.leanest, constraints)
    elapsed = time.perf_counter() - start
    best = replace(res.found[0], gap=res.gap)
    b = best.strategy.micro_batch
    graph = profile_at.captured(b) if hasattr(profile_at, "captured") else None  # exactly at b
    plan = to_plan(model, cluster, best, profile_at(b), elapsed, captured=graph, layouts=layouts)
    validate_plan(
        plan,
        world_size=cluster.world_size,
        blocks=base.blocks,
        capacity_bytes=min(cluster.device.memory_bytes, constraints.memory_cap_bytes or math.inf),
    )
    return PlanResult(
        plan=plan,
        alternatives=tuple(res.found[1:]),
        baselines=baselines(
            profile_at,
            cluster,
            global_batch=global_batch,
            seq=seq,
            dtype=dtype,
            constraints=constraints,
            layouts=layouts,
        ),
        solve_time_s=time.perf_counter() - start,
        ilps_solved=res.ilps,
        outer_candidates=res.outer,
    )


def _infeasible(cluster: Cluster, leanest: list[tuple[float, Strategy]], c: Constraints) -> InfeasibleError:
    capacity = min(cluster.device.memory_bytes, c.memory_cap_bytes or math.inf)
    if not leanest:
        return InfeasibleError("no strategy satisfies the constraints; loosen --tp/--pp/--dp/--micro-batch")
    need, st = leanest[0]
    return InfeasibleError(
        f"no plan fits in {capacity / 2**30:.1f} GiB per GPU: the leanest tried (tp {st.tp}, pp {st.pp}, "
        f"dp {st.dp}, ZeRO-{st.zero}, micro-batch {st.micro_batch}, recompute {st.recompute}) needs "
        f"{need / 2**30:.1f} GiB; add GPUs (--nodes), use a shorter --seq, or allow ZeRO-3, full "
        "recompute and micro-batch 1"
    )


def check_constraints(c: Constraints, cluster: Cluster, *, blocks: int, heads: int | None) -> None:
    """Reject fixed degrees that can never work, before searching."""
    if c.tp and heads is not None and heads % c.tp:
        raise StrategyError(f"tp={c.tp} does not divide {heads} heads")
    fixed = (c.tp or 1) * (c.pp or 1) * (c.dp or 1)
    if cluster.world_size % fixed:
        raise StrategyError(
            f"the fixed degrees multiply to {fixed}, which does not divide {cluster.world_size} GPUs"
        )
    if c.pp and c.pp > blocks:
        raise StrategyError(f"pp={c.pp} exceeds the model's {blocks} layers")
