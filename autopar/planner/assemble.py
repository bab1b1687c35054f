"""From a planning request to a ``Plan`` with its evidence: search, then wrap the best
candidate as a Plan keyed by layer names (with its per-operator TP table), and price the hand
baselines by the same cost model."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from autopar.cluster import Cluster
from autopar.cost_models.estimate import stage_chunks
from autopar.cost_models.mixed import replica_classes
from autopar.cost_models.rank_load import rank_load
from autopar.errors import InfeasibleError
from autopar.groups import MixedCluster
from autopar.mesh import ParallelDims
from autopar.plan import Plan, StagePlan, validate_plan
from autopar.planner.mixed import mixed_search
from autopar.planner.pricing import Pricer
from autopar.planner.profiles import ModelProfiles
from autopar.planner.search import Candidate, Progress, SearchResult, search
from autopar.planner.tp_layouts import plan_tables
from autopar.request import Constraints, PlanRequest
from autopar.strategy import Strategy, StrategyError


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


def make_plan(
    request: PlanRequest, profiles: ModelProfiles | None = None, *, progress: Progress | None = None
) -> PlanResult:
    """Search, then wrap the best candidate as a Plan with runners-up and baselines.
    ``profiles``: the model's (default: captured here from ``request.model``); ``progress``:
    told how the search goes (``search.Progress``: a CLI's progress bar).

    Raises ``InfeasibleError`` when no plan fits, naming the leanest plan tried,
    the memory it would need and the knobs that would help.
    """
    start = time.perf_counter()
    profiles = profiles or ModelProfiles.of(request.model, dtype=request.dtype, seq=request.seq)
    base = profiles.base
    if isinstance(request.cluster, MixedCluster):
        return make_mixed_plan(request, profiles, progress=progress)
    check_constraints(request.constraints, request.one_type, blocks=base.blocks, heads=base.heads)
    pricer = Pricer(
        profiles, request.one_type, dtype=request.dtype, reserve_bytes=request.constraints.reserve_bytes
    )
    res = search(request, pricer, progress)
    if not res.found:
        raise _infeasible(request, res.leanest, blocks=base.blocks, heads=base.heads, experts=base.experts)
    best = replace(res.found[0], gap=res.gap)
    plan = to_plan(request.model_name, pricer, best, time.perf_counter() - start)
    validate_plan(
        plan,
        world_size=request.cluster.world_size,
        layer_names=base.layer_names,
        capacity_bytes=request.capacity_bytes,
    )
    alternatives, hand = tuple(res.found[1:]), baselines(request, pricer)
    return _result(plan, best, alternatives, hand, res, start)


def _result(
    plan: Plan,
    best: Candidate,
    alternatives: tuple[Candidate, ...],
    hand: dict[str, Candidate | None],
    res: SearchResult,
    start: float,
) -> PlanResult:
    """The plan with its evidence (``Plan.why``: rows against the plan, tied within its band)."""
    best_s = plan.predicted["step_time_s"]
    rel = best.estimate.band.rel if best.estimate.band is not None else 0.0
    why = {
        "alternatives": [c.to_dict(best_s, rel) for c in alternatives],
        "baselines": {k: (c.to_dict(best_s, rel) if c else None) for k, c in hand.items()},
    }
    return PlanResult(
        plan=replace(plan, why=why),
        alternatives=alternatives,
        baselines=hand,
        solve_time_s=time.perf_counter() - start,
        ilps_solved=res.ilps,
        outer_candidates=res.outer,
    )


def baselines(request: PlanRequest, pricer: Pricer) -> dict[str, Candidate | None]:
    """Named hand strategies priced by the same cost model (None where nothing fits):

    - ``zero3 data parallel``: every GPU a data-parallel rank, ZeRO-3, full recompute;
    - ``tp=gpus/node, pp across nodes``: TP over a node's GPUs with sequence parallelism,
      the fewest pipeline stages that fit (even split, full recompute), DP for the rest.
    """
    prof = pricer.profiles.base
    world, gpn = request.cluster.world_size, request.cluster.gpus_per_node
    batch, seq, dtype = request.global_batch, request.seq, request.dtype

    def fitting(st: Strategy) -> Candidate | None:
        est = pricer.estimate(st)
        fits = all(mm.peak_bytes <= request.capacity_bytes for mm in est.memory)
        return Candidate(strategy=st, estimate=est, gap=0.0) if fits else None

    out: dict[str, Candidate | None] = {"zero3 data parallel": None, "tp=gpus/node, pp across nodes": None}
    if batch % world == 0:
        z3 = Strategy(dp=world, zero=3, global_batch=batch, seq=seq, recompute="full", dtype=dtype)
        out["zero3 data parallel"] = fitting(z3)
    tp = max(t for t in _divisors(gpn) if prof.heads is None or prof.heads % t == 0)
    for pp in _divisors(world // tp):
        dp = world // (tp * pp)
        if pp > prof.blocks or batch % dp:
            continue
        st = Strategy(
            tp=tp,
            pp=pp,
            dp=dp,
            global_batch=batch,
            seq=seq,
            recompute="full",
            sequence_parallel=tp > 1,
            dtype=dtype,
        )
        out["tp=gpus/node, pp across nodes"] = found = fitting(st)
        if found is not None:
            break
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def to_plan(
    model: str, pricer: Pricer, cand: Candidate, solve_time_s: float, *, mixed: MixedCluster | None = None
) -> Plan:
    """Wrap a candidate as a Plan keyed by layer names; its per-operator TP table is solved on
    the graph captured at exactly the plan's micro-batch. ``mixed``: the node groups the
    candidate is placed on (``Candidate.node_groups``); a stage's time is its slowest device's."""
    st, est = cand.strategy, cand.estimate
    profile, cluster = pricer.profiles.at(st.rank_sequences), pricer.cluster
    counts = st.blocks_per_rank(profile.blocks)
    if mixed is None:
        rank_terms = [[pricer.terms(st)]] * st.pp
    else:
        found = replica_classes(
            profile,
            mixed,
            st,
            cand.node_groups,
            reserve_bytes=pricer.reserve_bytes,
            tp_layout=pricer.layouts(st),
            units=pricer.units,
        )
        rank_terms = [[c.terms[k] for c in found] for k in range(st.pp)]
    edge = (profile.layer_names[0], profile.layer_names[-1])
    stages = []
    for k, chunks in enumerate(stage_chunks(profile, st)):
        layers = [name for chunk in chunks for name in chunk]
        load = max((rank_load(t, k, counts[k]) for t in rank_terms[k]), key=lambda x: x.time_s)
        blocks = [x for x in layers if x not in edge]
        # leanest first: full, the policies (fewest bytes kept first), selective, none
        by_name = dict(zip(st.choices, counts[k], strict=True))
        order = ["full", *(p.name for p in st.policies), "selective", "none"]
        choice = [r for r in order for _ in range(by_name[r])]
        stages.append(
            StagePlan(
                index=k,
                layers=tuple(layers),
                recompute=tuple(zip(blocks, choice, strict=True)),
                peak_bytes=est.memory[k].peak_bytes,
                time_per_micro_batch_s=load.time_s,
                comm_per_micro_batch_s=load.tp_s,
                chunk_sizes=tuple(len(c) for c in chunks) if st.virtual_stages > 1 else (),
            )
        )
    return Plan(
        model=model,
        cluster=(mixed or cluster).to_dict(),
        strategy=st,
        mesh=(("pp", st.pp), ("dp", st.dp), *((("cp", st.cp),) if st.cp > 1 else ()), ("tp", st.tp)),
        crosses_nodes=st.dims.crossing(cluster.gpus_per_node),
        stages=tuple(stages),
        predicted=est.to_dict(),
        solve_time_s=solve_time_s,
        optimality_gap=cand.gap,
        tensor_parallel=plan_tables(pricer.profiles, cluster, st),
        node_groups=cand.node_groups,
    )


def make_mixed_plan(
    request: PlanRequest, profiles: ModelProfiles, *, progress: Progress | None = None
) -> PlanResult:
    """``make_plan`` on node groups (``planner.mixed``): the plan, its runners-up, and as
    baselines the best plan on each group alone and on every GPU taken as the slowest group's."""
    start, mixed = time.perf_counter(), request.cluster
    if not isinstance(mixed, MixedCluster):
        raise TypeError("make_mixed_plan plans for a MixedCluster")
    base, ideal = profiles.base, replace(request, cluster=mixed.ideal())
    check_constraints(request.constraints, ideal.one_type, blocks=base.blocks, heads=base.heads)
    reserve = request.constraints.reserve_bytes
    pricer = Pricer(profiles, ideal.one_type, dtype=request.dtype, reserve_bytes=reserve)
    res = mixed_search(ideal, mixed, pricer, progress)
    if not res.found:
        raise InfeasibleError(
            f"no plan fits on {mixed.describe()}: no placement of stages or replicas on the groups fits "
            "their memory; add nodes, use a shorter --seq, or allow ZeRO-3 and full recompute"
        )
    best = replace(res.found[0], gap=res.gap)
    plan = to_plan(request.model_name, pricer, best, time.perf_counter() - start, mixed=mixed)
    validate_plan(
        plan,
        world_size=mixed.world_size,
        layer_names=base.layer_names,
        capacity_bytes=max(g.device.memory_bytes for g in mixed.groups),
    )
    alternatives = tuple(res.found[1:])
    slowest = min(mixed.groups, key=lambda g: g.device.achievable_flops(request.dtype))
    alone = {f"{g.name} nodes alone": g for g in mixed.groups}
    alone[f"every GPU as {slowest.name}'s"] = replace(slowest, num_nodes=mixed.num_nodes)
    hand: dict[str, Candidate | None] = {}
    for name, cluster in alone.items():
        try:
            one = replace(request, cluster=cluster, time_limit_s=request.time_limit_s / 4)
            found = search(one, Pricer(profiles, cluster, dtype=request.dtype, reserve_bytes=reserve)).found
        except (InfeasibleError, StrategyError):
            found = []
        hand[name] = found[0] if found else None
    return _result(plan, best, alternatives, hand, res, start)


def _no_strategy(request: PlanRequest, *, blocks: int, heads: int | None, experts: int) -> InfeasibleError:
    """Why no outer choice exists at all: the constraints the user fixed, or else the batch."""
    c, world, gpn = request.constraints, request.cluster.world_size, request.cluster.gpus_per_node
    if c.ep is not None and c.ep > 1 and not experts:
        return InfeasibleError(
            f"--ep {c.ep} splits each MoE layer's routed experts, but this model has none run as grouped "
            "matmuls (torch._grouped_mm, Hugging Face's grouped experts); drop --ep"
        )
    knobs = (
        "tp",
        "pp",
        "dp",
        "cp",
        "ep",
        "zero",
        "micro_batch",
        "schedule",
        "virtual_stages",
        "sequence_parallel",
    )
    fixed = [f"--{k.replace('_', '-')} {getattr(c, k)}" for k in knobs if getattr(c, k) is not None]
    tps = [t for t in _divisors(gpn) if world % t == 0 and (heads is None or heads % t == 0)]
    dps = sorted({world // (t * p) for t in tps for p in _divisors(world // t) if p <= blocks})
    rule = (
        f"on {world} GPUs ({gpn} per node) a global batch of {request.global_batch} must split over a "
        f"data-parallel degree dp = GPUs ÷ (tp·pp), with tp dividing the node"
        + (f" and the {heads} heads" if heads else "")
        + f" and pp at most {blocks} blocks"
        + (f", ep dividing dp and the {experts} experts" if c.ep else "")
    )
    if fixed:
        return InfeasibleError(f"no strategy fits the constraints {', '.join(fixed)}: {rule}; loosen them")
    return InfeasibleError(
        f"no strategy fits: {rule}; use a global batch divisible by {dps[0]}, or fewer GPUs"
        if dps
        else f"no strategy fits: {rule}, and no degrees do"
    )


def _infeasible(
    request: PlanRequest,
    leanest: list[tuple[float, Strategy]],
    *,
    blocks: int,
    heads: int | None,
    experts: int,
) -> InfeasibleError:
    if not leanest:
        return _no_strategy(request, blocks=blocks, heads=heads, experts=experts)
    need, st = leanest[0]
    return InfeasibleError(
        f"no plan fits in {request.capacity_bytes / 2**30:.1f} GiB per GPU: the leanest tried (tp {st.tp}, "
        f"pp {st.pp}, dp {st.dp}{f', cp {st.cp}' if st.cp > 1 else ''}, ZeRO-{st.zero}, "
        f"micro-batch {st.micro_batch}, recompute {st.recompute}) "
        f"needs {need / 2**30:.1f} GiB; add GPUs (--nodes), use a shorter --seq, or allow ZeRO-3, full "
        "recompute and micro-batch 1"
    )


def check_constraints(c: Constraints, cluster: Cluster, *, blocks: int, heads: int | None) -> None:
    """Reject fixed degrees that can never work, before searching."""
    if c.tp and heads is not None and heads % c.tp:
        raise StrategyError(f"tp={c.tp} does not divide {heads} heads")
    fixed = ParallelDims(tp=c.tp or 1, pp=c.pp or 1, dp=c.dp or 1, cp=c.cp or 1).world_size
    if cluster.world_size % fixed:
        raise StrategyError(
            f"the fixed degrees multiply to {fixed}, which does not divide {cluster.world_size} GPUs"
        )
    if c.pp and c.pp > blocks:
        raise StrategyError(f"pp={c.pp} exceeds the model's {blocks} layers")


__all__ = ["PlanResult", "baselines", "check_constraints", "make_plan", "to_plan"]
