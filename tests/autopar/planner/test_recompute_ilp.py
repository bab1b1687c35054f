"""The per-operator recompute policies: each knapsack ILP equals brute force, the frontier is
Pareto-ordered, and constraints name policies clearly."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from autopar import AutoparError, Cluster, Constraints, InfeasibleError, Plan, PlanRequest
from autopar.cost_models.memory import layer_activation_bytes
from autopar.cost_models.profile import CallCost, LayerCost, ModelProfile
from autopar.cost_models.recompute import call_time_s, kept_bytes, recompute_s
from autopar.planner import ModelProfiles, make_plan
from autopar.planner.recompute_ilp import BUDGETS, _knapsack, frontier, recompute_choices
from autopar.recompute_policy import RECOMPUTE, RecomputePolicy
from autopar.zoo import Llama, LlamaConfig

CLUSTER = Cluster.preset("dgx-h100")


def _profile(seed: int, n: int = 10) -> ModelProfile:
    """A block of ``n`` random calls (matmuls and memory-bound ops), one of them not keepable."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        flops = rng.choice([0, 0, rng.randrange(10**9, 10**12)])
        calls.append(
            CallCost(
                key=f"op{i % 3}#{i}",
                flops=flops,
                kernel_flops=flops,
                mem_bytes=rng.randrange(10**6, 10**9),
                out_bytes=rng.randrange(10**5, 10**8),
                keepable=i != 3,
                placement=rng.choice(["stream", "sharded", "whole"]),
            )
        )
    saved = sum(c.out_bytes for c in calls)  # what no recompute keeps: about every output
    zero = ("fwd_flops", "bwd_flops", "params", "saved_sharded_bytes", "saved_quadratic_bytes")
    zero += ("quadratic_flops", "tp_reduce_bytes", "tp_reduce_count")
    blank: dict[str, int] = dict.fromkeys(zero, 0)
    block = LayerCost(name="Block", ops=(), saved_stream_bytes=saved, calls=tuple(calls), **blank)
    edge = LayerCost(name="edge", ops=(), saved_stream_bytes=0, **blank)
    return ModelProfile(
        micro_batch=1,
        seq=8,
        hidden=8,
        heads=None,
        vocab=8,
        act_bytes=2,
        layer_types={"Block": block, "embed": edge, "head": edge},
        layers=("embed", "Block", "Block", "head"),
        layer_names=("embed", "b.0", "b.1", "head"),
        total_params=0,
    )


@pytest.mark.parametrize("seed", range(6))
def test_each_policy_is_the_brute_force_optimum(seed: int) -> None:
    prof = _profile(seed)
    block = prof.layer_types["Block"]
    keepable = [c for c in block.calls if c.keepable]
    seconds = {c.key: call_time_s(c, CLUSTER.device, "bf16", tp=1, stream_share=1.0) for c in keepable}
    none = layer_activation_bytes(block, tp=1, sp=False, recompute="none", input_bytes=prof.input_bytes)
    room = none - prof.input_bytes
    subsets = [
        (sum(c.out_bytes for c in s), sum(seconds[c.key] for c in s), frozenset(c.key for c in s))
        for r in range(len(keepable) + 1)
        for s in itertools.combinations(keepable, r)
    ]
    policies = frontier(prof, CLUSTER, "bf16")
    assert policies, "a block with keepable calls has policies"
    kept = [
        kept_bytes(block, frozenset(p.keep), tp=1, sp=False, input_bytes=prof.input_bytes) for p in policies
    ]
    redo = [
        recompute_s(block, frozenset(p.keep), CLUSTER.device, "bf16", tp=1, stream_share=1.0)
        for p in policies
    ]
    assert [p.name for p in policies] == [f"sac{i + 1}" for i in range(len(policies))]
    assert kept == sorted(kept) and all(prof.input_bytes < k < none for k in kept)
    assert all(a > b for a, b in itertools.pairwise(redo)), "more bytes kept, less redone"
    for share in BUDGETS:  # the knapsack ILP at each budget: no subset within it saves more
        keep = _knapsack(list(seconds), list(seconds.values()), [c.out_bytes for c in keepable], share * room)
        best = max(t for b, t, _ in subsets if b <= share * room)
        assert sum(seconds[k] for k in keep) == pytest.approx(best, rel=1e-6), share
    # convex: each policy lies below the chord of its neighbours (full and none at the ends)
    whole = recompute_s(block, frozenset(), CLUSTER.device, "bf16", tp=1, stream_share=1.0)
    points = [(prof.input_bytes, whole), *zip(kept, redo, strict=True), (none, 0.0)]
    for (b0, t0), (b1, t1), (b2, t2) in zip(points, points[1:], points[2:], strict=False):
        assert (t1 - t0) * (b2 - b0) < (t2 - t0) * (b1 - b0)
    for p, k in zip(policies, kept, strict=True):  # Pareto: nothing as lean saves more
        saved = sum(seconds[x] for x in p.keep)
        assert all(t <= saved * (1 + 1e-6) for b, t, _ in subsets if b <= k - prof.input_bytes)


def test_zoo_llama_frontier_keeps_matmuls_first() -> None:
    cfg = LlamaConfig(
        n_layer=2, dim=512, n_head=8, n_kv_head=4, ffn_dim=1536, vocab_size=256, max_seq_len=256
    )
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    policies = frontier(ModelProfiles.of(model, dtype="bf16", seq=256).base, CLUSTER, "bf16")
    assert policies
    leanest_ops = {k.rpartition("#")[0] for k in policies[0].keep}
    assert "mm" in leanest_ops, policies[0].summary  # most compute per byte kept
    assert "silu" not in leanest_ops, policies[0].summary  # memory-bound: cheap to redo


def test_recompute_choices() -> None:
    pols = tuple(RecomputePolicy(name=f"sac{i}", keep=("mm#0",), calls=3) for i in (1, 2))
    assert recompute_choices(("none", "sac", "full"), pols) == (("none", "full", "sac1", "sac2"), pols)
    assert recompute_choices(("sac2",), pols) == (("sac2",), pols[1:])
    assert recompute_choices(("none", "full"), pols) == (("none", "full"), ())
    with pytest.raises(AutoparError, match=r"'sac3' does not exist .* sac1, sac2"):
        recompute_choices(("sac3",), pols)
    with pytest.raises(AutoparError, match="no per-operator policy"):
        recompute_choices(("sac",), ())


def test_memory_tight_llama3_8b_plans_a_per_operator_policy() -> None:
    """Llama-3 8B, 8 H100, FSDP (ZeRO-3) micro-batch 2 at seq 8192: without recompute it does
    not fit; the plan keeps matmul outputs per block and is predicted faster than full recompute
    and than the best mix of none, selective and full."""
    fixed = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "micro_batch": 2}
    profiles = ModelProfiles.of("llama3-8b", dtype="bf16", seq=8192)

    def plan(allowed: tuple[str, ...]) -> Plan:
        request = PlanRequest(
            model="llama3-8b", cluster=Cluster.preset("dgx-h100"), global_batch=16, seq=8192,
            constraints=Constraints(recompute=allowed, **fixed),
        )  # fmt: skip
        return make_plan(request, profiles).plan

    with pytest.raises(InfeasibleError):
        plan(("none",))
    chosen, whole, mixed = plan(("none", "selective", "sac", "full")), plan(("full",)), plan(RECOMPUTE)
    used = set(chosen.recompute.values())
    assert any(r.startswith("sac") for r in used), used
    step = chosen.predicted["step_time_s"]
    assert step < mixed.predicted["step_time_s"] < whole.predicted["step_time_s"]
    assert chosen.stages[0].peak_bytes <= CLUSTER.device.memory_bytes
    text = chosen.text()
    assert "recompute sac" in text and "MiB kept" in text, text
