"""The planner: ILP optimum == brute force, invariants, JSON, baselines, infeasibility, CLI."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch

from autopar import AutoparError, Cluster, Constraints, InfeasibleError, Plan, PlanRequest
from autopar.cli import main
from autopar.cost_models.estimate import estimate
from autopar.planner import ModelProfiles, make_plan
from autopar.planner.layout_ilp import MIP_GAP
from autopar.planner.recompute_ilp import frontier, recompute_choices
from autopar.planner.search import outer_strategies
from autopar.planner.tp_layouts import TPLayouts
from autopar.recompute_policy import RECOMPUTE
from autopar.strategy import SCHEDULES, Strategy, runs_with_policies
from autopar.zoo import GPT, GPTConfig

LAYERS, SEQ = 4, 128


@pytest.fixture(scope="module")
def profile_at():
    cfg = GPTConfig(
        n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=256, block_size=SEQ, attention="math", dropout=0.1
    )
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    return ModelProfiles.of(model, dtype="bf16", seq=SEQ)


def plan_with(profiles, cluster, *, batch, seq=SEQ, c=None, model="tiny"):
    """``make_plan`` of a request for ``profiles`` (already captured) on ``cluster``."""
    request = PlanRequest(
        model=model, cluster=cluster, global_batch=batch, seq=seq, constraints=c or Constraints()
    )
    return make_plan(request, profiles)


def _layouts(blocks: int, st: Strategy, allowed: tuple[str, ...], choices: tuple[str, ...] = RECOMPUTE):
    # every rank holds a block per chunk, but the chunks of the embedding and the head (interleaved:
    # rank totals need not be equal, the chunks come out uneven; in a V both are on rank 0)
    pp = st.pp
    need = [st.min_rank_blocks(k) for k in range(pp)]
    sizes = [
        list(c)
        for c in itertools.product(range(blocks + 1), repeat=pp)
        if sum(c) == blocks and all(n >= lo for n, lo in zip(c, need, strict=True))
    ]
    idx = [choices.index(r) for r in allowed]
    for size in sizes:
        per_rank = []
        for n in size:
            options = []
            for split in itertools.product(range(n + 1), repeat=len(idx)):
                if sum(split) == n:
                    counts = [0] * len(choices)
                    for i, x in zip(idx, split, strict=True):
                        counts[i] = x
                    options.append(tuple(counts))
            per_rank.append(options)
        yield from itertools.product(*per_rank)


def brute_force(
    profile_at,
    cluster: Cluster,
    *,
    global_batch: int,
    c: Constraints,
    blocks: int = LAYERS,
    seq: int = SEQ,
    experts: int = 0,
) -> float:
    """The best step time over the whole space, by enumerating every strategy and layout,
    including GPipe (the planner prunes it by dominance: 1F1B's time with less memory)."""
    capacity = min(cluster.device.memory_bytes, c.memory_cap_bytes or math.inf)
    layouts = TPLayouts(profile_at, cluster, "bf16")  # TP priced by the per-operator choice
    best = math.inf
    space = set()
    for schedule, sp in itertools.product(SCHEDULES, (True, False)):
        cc = replace(c, schedule=schedule, sequence_parallel=sp)
        request = PlanRequest(
            model="tiny", cluster=cluster, global_batch=global_batch, seq=seq, constraints=cc
        )
        space |= set(outer_strategies(request, blocks=blocks, heads=4, experts=experts))
    # the per-operator policies the planner finds, each enumerated like none, selective and full
    allowed, policies = recompute_choices(c.recompute, frontier(profile_at.base, cluster, "bf16"))
    # (none under a zero-bubble pipeline: torch's selective checkpointing replays once)
    for v in (v for s in space for v in layouts.variants(s)):
        st = replace(v, policies=policies if runs_with_policies(v.schedule, v.pp) else ())
        prof = profile_at.at(st.micro_batch)
        for layout in _layouts(blocks, st, tuple(r for r in allowed if r in st.choices), st.choices):
            chosen = replace(st, layout=layout)
            est = estimate(prof, cluster, chosen, reserve_bytes=c.reserve_bytes, tp_layout=layouts(st))
            if all(m.peak_bytes <= capacity for m in est.memory):
                best = min(best, est.step_time_s)
    return best


def _instances():
    """20+ small instances: clusters of 2–8 GPUs in 1–2 nodes, batches, memory caps, recompute sets
    (those over 4+ GPUs with every recompute choice enumerate for 3–9 s each: ``slow``)."""
    out = []
    for gpn, nodes in ((2, 1), (4, 1), (2, 2), (4, 2)):
        for batch in (4, 8):
            for cap_mib in (None, 12, 6):
                marks = [pytest.mark.slow] if gpn * nodes >= 4 else []
                out.append(pytest.param(gpn, nodes, batch, cap_mib, RECOMPUTE, marks=marks))
    out.append((4, 1, 8, 12, ("none", "full")))
    out.append((2, 2, 8, 24, ("full",)))
    # per-operator policies with none and full where memory binds (the optimum mixes policies,
    # and full with policies), and policies alone
    out.append((2, 1, 8, 5, ("none", "sac", "full")))
    out.append((1, 2, 8, 6, ("none", "sac", "full")))
    out.append((2, 1, 4, None, ("sac",)))
    return out


@pytest.mark.parametrize(("gpn", "nodes", "batch", "cap_mib", "allowed"), _instances())
def test_planner_optimum_equals_brute_force(profile_at, gpn, nodes, batch, cap_mib, allowed) -> None:
    cluster = Cluster.preset("dgx-a100-80g", nodes=nodes, gpus_per_node=gpn)
    c = Constraints(
        memory_cap_bytes=cap_mib * 2**20 if cap_mib else None,
        reserve_bytes=0.0,
        recompute=allowed,
        max_micro_batch=4,
    )
    expected = brute_force(profile_at, cluster, global_batch=batch, c=c)
    if expected == math.inf:
        with pytest.raises(InfeasibleError):
            plan_with(profile_at, cluster, batch=batch, c=c)
        return
    result = plan_with(profile_at, cluster, batch=batch, c=c)
    assert result.plan.predicted["step_time_s"] == pytest.approx(expected, rel=MIP_GAP)


@pytest.fixture(scope="module")
def moe_at():
    from autopar.zoo import hf

    with torch.device("meta"):
        model = hf.family("mixtral").to(torch.bfloat16)  # 2 blocks, 4 experts top-2
    return ModelProfiles.of(model, dtype="bf16", seq=16)


@pytest.mark.parametrize(("gpn", "nodes", "cap_mib"), [(4, 1, None), (2, 2, None), (4, 2, None), (4, 1, 1.5)])
def test_planner_optimum_with_experts_equals_brute_force(moe_at, gpn, nodes, cap_mib) -> None:
    """ep searched with the other knobs (every ep dividing dp and the 4 experts, at any tp)."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=nodes, gpus_per_node=gpn)
    c = Constraints(
        memory_cap_bytes=cap_mib * 2**20 if cap_mib else None,
        reserve_bytes=0.0,
        recompute=("none", "full"),
        max_micro_batch=2,
    )
    expected = brute_force(moe_at, cluster, global_batch=8, c=c, blocks=2, seq=16, experts=4)
    result = plan_with(moe_at, cluster, batch=8, seq=16, c=c)
    assert result.plan.predicted["step_time_s"] == pytest.approx(expected, rel=MIP_GAP)
    eps = {
        st.ep
        for st in outer_strategies(
            PlanRequest(model="tiny", cluster=cluster, global_batch=8, seq=16, constraints=c),
            blocks=2,
            heads=4,
            experts=4,
        )
    }
    assert eps == {e for e in (1, 2, 4) if (gpn * nodes) % e == 0}


@pytest.mark.parametrize("cap_mib", [1.5])
def test_no_layout_fits_a_smaller_ep_where_none_fits_a_wider_one(moe_at, cap_mib) -> None:
    """What lets the search skip pricing smaller eps (``search._priced``): with every other knob
    the same, a rank's memory never grows with ep, so fitting is monotone in ep."""
    from dataclasses import fields

    from autopar.planner.layout_ilp import LayoutProblem, fits_somehow
    from autopar.planner.pricing import Pricer

    cluster = Cluster.preset("dgx-a100-80g", nodes=2, gpus_per_node=4)
    c = Constraints(memory_cap_bytes=cap_mib * 2**20, reserve_bytes=0.0, max_micro_batch=2)
    request = PlanRequest(model="tiny", cluster=cluster, global_batch=8, seq=16, constraints=c)
    pricer = Pricer(moe_at, cluster, dtype="bf16", reserve_bytes=0.0)
    siblings: dict[tuple, dict[int, bool]] = {}
    for st in outer_strategies(request, blocks=2, heads=4, experts=4):
        for v in pricer.layouts.variants(st):
            fits = fits_somehow(LayoutProblem(pricer.terms(v), 2, request.capacity_bytes, ("none", "full")))
            but_ep = tuple(getattr(v, f.name) for f in fields(v) if f.name != "ep")
            siblings.setdefault(but_ep, {})[v.ep] = fits
    both = [fit for fit in siblings.values() if len(fit) > 1]
    assert both and any(not all(f.values()) for f in both) and any(any(f.values()) for f in both)
    for fit in both:
        eps = sorted(fit)
        assert all(fit[wide] or not fit[narrow] for narrow, wide in itertools.pairwise(eps)), fit


def test_ep_on_a_dense_model_is_one_line_naming_it(profile_at) -> None:
    cluster = Cluster.preset("dgx-a100-80g", nodes=1, gpus_per_node=4)
    with pytest.raises(InfeasibleError, match="--ep 2 splits each MoE layer's routed experts"):
        plan_with(profile_at, cluster, batch=8, c=Constraints(ep=2))


def test_some_instances_bind_memory(profile_at) -> None:
    """The caps above are tight enough to change the answer (else the test proves little)."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=1, gpus_per_node=4)
    free = plan_with(profile_at, cluster, batch=8, c=Constraints(reserve_bytes=0.0, max_micro_batch=4)).plan
    tight = plan_with(
        profile_at,
        cluster,
        batch=8,
        c=Constraints(reserve_bytes=0.0, max_micro_batch=4, memory_cap_bytes=6 * 2**20),
    ).plan
    assert tight.predicted["step_time_s"] > free.predicted["step_time_s"]
    assert tight.strategy != free.strategy


def test_plan_round_trips_and_validates(profile_at, tmp_path) -> None:
    cluster = Cluster.preset("dgx-a100-80g", nodes=2, gpus_per_node=2)
    told: list[tuple[int, int, str]] = []
    request = PlanRequest(model="tiny", cluster=cluster, global_batch=8, seq=SEQ,
                          constraints=Constraints(pp=2, reserve_bytes=0.0))  # fmt: skip
    result = make_plan(request, profile_at, progress=lambda *a: told.append(a))
    plan = result.plan
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).hash == plan.hash
    assert Plan.from_json(plan.to_json()).why == plan.why and "baselines" in plan.why
    assert plan.hash == replace(plan, why={}).hash  # evidence, not a decision
    edited = plan.to_dict()
    edited["predicted"]["step_time_s"], edited["why"]["baselines"] = 0.0, {}
    assert plan.predicted["step_time_s"] > 0 and plan.why["baselines"]  # to_dict hands out copies
    for what in {w for _, _, w in told}:  # each phase counts up to its total
        done = [d for d, _, w in told if w == what]
        total = {t for _, t, w in told if w == what}
        assert done == sorted(done) and len(total) == 1 and done[-1] == total.pop() > 0, what
    assert len({w for _, _, w in told}) == 2
    st = plan.strategy
    assert st.tp * st.pp * st.dp == 4 and len(plan.stages) == 2
    names = [n for s in plan.stages for n in s.layers]
    assert names == ["embed", *(f"blocks.{i}" for i in range(LAYERS)), "head"]
    assert "stage 0:" in plan.text() and "stage 1:" in plan.text()
    assert plan.predicted["step_time_s"] == pytest.approx(
        estimate(
            profile_at.at(st.micro_batch),
            cluster,
            st,
            reserve_bytes=0.0,
            tp_layout=TPLayouts(profile_at, cluster, "bf16")(st),
        ).step_time_s
    )


def test_leanest_tp_layout_is_planned_when_the_fastest_does_not_fit() -> None:
    """h 1024 on two H100s without SP: the fastest per-operator layout keeps attention whole,
    the leanest splits it. With a memory cap between their peaks the planner takes the leanest
    (and says so); without a cap the fastest."""
    cfg = GPTConfig(n_layer=4, n_embd=1024, n_head=16, vocab_size=512, block_size=512)
    with torch.device("meta"):
        model = GPT(cfg)
    prof = ModelProfiles.of(model, dtype="bf16", seq=512)
    cluster = Cluster.preset("dgx-h100", gpus_per_node=2)
    c = Constraints(
        tp=2,
        pp=1,
        dp=1,
        zero=0,
        micro_batch=1,
        sequence_parallel=False,
        reserve_bytes=0.0,
        recompute=RECOMPUTE[:1],
    )
    layouts = TPLayouts(prof, cluster, "bf16")
    fast = Strategy(tp=2, global_batch=2, seq=512)
    peaks = {
        objective: estimate(prof.at(1), cluster, st, reserve_bytes=0.0, tp_layout=layouts(st))
        .memory[0]
        .peak_bytes
        for objective in ("time", "memory")
        for st in [replace(fast, tp_objective=objective)]
    }
    assert peaks["memory"] < peaks["time"]
    free = plan_with(prof, cluster, batch=2, seq=512, c=c).plan
    cap = (peaks["time"] + peaks["memory"]) / 2
    tight = plan_with(prof, cluster, batch=2, seq=512, c=replace(c, memory_cap_bytes=cap)).plan
    assert free.strategy.tp_objective == "time" and tight.strategy.tp_objective == "memory"
    assert "TP layout: leanest" in tight.text() and "leanest" not in free.text()
    blocks = {name: ops for name, ops in tight.tensor_parallel}
    assert any(key.startswith("attn:") and name == "heads" for key, name, _ in blocks["Block"])
    assert tight.predicted["step_time_s"] > free.predicted["step_time_s"]
    assert Plan.from_json(tight.to_json()) == tight


@pytest.mark.slow
def test_plan_beats_the_hand_heuristic_and_megatron_on_zoo_models() -> None:
    cases = [
        ("gpt3-175b", "dgx-a100-80g", 128, 1536, 2048),
        ("llama3-70b", "dgx-h100", 8, 512, 4096),
        ("llama3-8b", "dgx-h200", 1, 64, 8192),
    ]
    for model, preset, nodes, batch, seq in cases:
        cluster = Cluster.preset(preset, nodes=nodes)
        result = make_plan(PlanRequest(model=model, cluster=cluster, global_batch=batch, seq=seq))
        best = result.plan.predicted["step_time_s"]
        for name, cand in result.baselines.items():
            if cand is not None:
                assert best <= cand.estimate.step_time_s * (1 + 1e-9), (model, name)
        assert result.baselines["tp=gpus/node, pp across nodes"] is not None, model
    # the published 175B configuration (tp 8, pp 16, dp 8, micro-batch 1, full recompute)
    prof = ModelProfiles.of("gpt3-175b", dtype="bf16", seq=2048)
    cluster = Cluster.preset("dgx-a100-80g", nodes=128)
    megatron = estimate(
        prof.at(1), cluster, Strategy(tp=8, pp=16, dp=8, global_batch=1536, seq=2048, recompute="full")
    )
    chosen = plan_with(prof, cluster, batch=1536, seq=2048, model="gpt3-175b").plan
    assert megatron.fits and chosen.predicted["step_time_s"] <= megatron.step_time_s


def test_infeasible_names_the_leanest_plan_and_knobs(capsys) -> None:
    code = main(["plan", "gpt3-175b", "--cluster", "dgx-a100-40g", "--global-batch", "8", "--seq", "2048"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "no plan fits in" in err and "GiB" in err and "--nodes" in err


def test_plan_cli_json_and_out(capsys, tmp_path) -> None:
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "gpt2-medium",
            "--cluster",
            "dgx-h100",
            "--global-batch",
            "64",
            "--seq",
            "512",
            "--json",
            "--out",
            str(out),
            "--top",
            "3",
        ]
    )
    assert code == 0
    rep = json.loads(capsys.readouterr().out)
    plan = Plan.from_json(out.read_text())
    assert rep["plan"] == plan.to_dict()  # one plan schema: what --out writes
    assert Plan.from_dict(rep["plan"]) == plan and rep["hash"] == plan.hash
    for key in ("tp", "pp", "dp", "zero", "micro_batch", "schedule", "virtual_stages", "sequence_parallel"):
        assert key in rep["plan"]["strategy"], key
    assert [len(s["layers"]) for s in rep["plan"]["stages"]] == [len(s.layers) for s in plan.stages]
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "fits", "memory", "breakdown_s"):
        assert key in rep["predicted"], key
    assert set(rep) >= {"alternatives", "baselines", "solve_time_s", "optimality_gap"}
    assert len(rep["alternatives"]) <= 3
    rows = rep["alternatives"] + [b for b in rep["baselines"].values() if b is not None]
    assert rows and all(a["slower_by"] >= 1 - 1e-9 for a in rows)
    assert all(set(a["strategy"]) == set(rep["plan"]["strategy"]) for a in rows)  # Strategy.to_dict


def test_plan_cli_table_and_constraints(capsys) -> None:
    code = main(
        [
            "plan",
            "gpt2-medium",
            "--cluster",
            "dgx-h100",
            "--global-batch",
            "64",
            "--seq",
            "512",
            "--tp",
            "2",
            "--pp",
            "2",
            "--recompute",
            "none,full",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "mesh pp2 × dp2 × tp2" in out and "why this plan" in out
    assert main(["plan", "gpt2-medium", "--cluster", "dgx-h100", "--global-batch", "64", "--tp", "3"]) == 2
    assert "tp=3 does not divide 16 heads" in capsys.readouterr().err
    assert (
        main(["plan", "gpt2-medium", "--cluster", "dgx-h100", "--global-batch", "64", "--recompute", "x"])
        == 2
    )


def test_a_stage_names_its_chunks() -> None:
    from autopar.plan import StagePlan

    def stage(layers: list[str]) -> StagePlan:
        return StagePlan(
            index=0, layers=tuple(layers), recompute=(), peak_bytes=1.0, time_per_micro_batch_s=1.0
        )

    one = stage(["embed", "blocks.0", "blocks.1"])
    assert one.chunks == [("embed", "blocks.0", "blocks.1")] and one.layers_summary == "embed … blocks.1 (3)"
    two = stage(["blocks.2", "blocks.3", "blocks.6", "blocks.7", "head"])  # interleaved, v = 2
    assert two.chunks == [("blocks.2", "blocks.3"), ("blocks.6", "blocks.7", "head")]
    assert two.layers_summary == "blocks.2 … blocks.3 | blocks.6 … head (5)"
    # uneven interleaved chunks as the plan states them: the embedding alone, then one block
    alone = replace(stage(["embed", "blocks.1"]), chunk_sizes=(1, 1))
    assert alone.chunks == [("embed",), ("blocks.1",)] and alone.layers_summary == "embed | blocks.1 (2)"
    many = stage([f"blocks.{i}" for c in range(4) for i in (4 * c, 4 * c + 1)])
    assert many.layers_summary == "4 chunks: blocks.0 … blocks.1 | … | blocks.12 … blocks.13 (8)"


def test_a_deep_interleaved_pipeline_takes_the_even_split_and_its_bound_holds() -> None:
    """pp 6 × v 2 over 14 blocks (deeper than FREE_INTERLEAVED_PP): each rank holds the even
    split's count, the embedding's and the head's ranks the lighter ones, and the search's bound
    (which uses those counts) stays at or below the layout ILP's optimum."""
    from autopar.planner import Pricer
    from autopar.planner.bounds import lower_bound_s, tight_bound_s
    from autopar.planner.layout_ilp import FREE_INTERLEAVED_PP, LayoutProblem, fixed_rank_blocks, solve_layout

    cfg = GPTConfig(n_layer=14, n_embd=64, n_head=4, vocab_size=4096, block_size=SEQ)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    profiles = ModelProfiles.of(model, dtype="bf16", seq=SEQ)
    cluster = Cluster.preset("dgx-a100-80g", gpus_per_node=6)
    st = Strategy(pp=6, micro_batch=1, global_batch=12, seq=SEQ, schedule="interleaved", virtual_stages=2)
    assert st.pp > FREE_INTERLEAVED_PP
    assert fixed_rank_blocks(st, 14) == [2, 2, 3, 3, 2, 2]  # the middle ranks hold the extras
    terms = Pricer(profiles, cluster, dtype="bf16").terms(st)
    allowed = ("none", "full")
    layout, gap = solve_layout(LayoutProblem(terms, 14, 80e9, allowed), time_limit=10.0)
    assert [sum(c) for c in layout] == [2, 2, 3, 3, 2, 2] and gap == 0.0
    best = estimate(profiles.at(1), cluster, replace(st, layout=layout)).step_time_s
    problem = LayoutProblem(terms, 14, 80e9, allowed)
    cheap, tight = lower_bound_s(problem), tight_bound_s(problem)
    assert cheap <= tight <= best * (1 + 1e-9)


def test_proven_runners_up_are_the_fastest_after_the_plan(profile_at) -> None:
    """``proven_runners_up`` k: the search goes on until no bound beats its k-th runner-up, so its
    first k runners-up are at least as fast as those met on the way to proving the optimum alone
    (same plan either way), and k of them exist where the space holds them."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=2, gpus_per_node=2)
    times = {}
    for k in (0, 3):
        request = PlanRequest(
            model="tiny", cluster=cluster, global_batch=8, seq=SEQ, top_k=3, proven_runners_up=k
        )
        result = make_plan(request, profile_at)
        times[k] = [
            result.plan.predicted["step_time_s"],
            *(c.estimate.step_time_s for c in result.alternatives),
        ]
    assert times[3][0] == times[0][0] and len(times[3]) == 4
    assert all(p <= m * (1 + 1e-9) for p, m in zip(times[3], times[0], strict=False))
    assert times[3] == sorted(times[3])
    with pytest.raises(AutoparError, match=r"proven_runners_up must be within 0\.\.top_k"):
        PlanRequest(model="tiny", cluster=cluster, global_batch=8, seq=SEQ, top_k=1, proven_runners_up=2)
