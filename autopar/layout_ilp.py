"""The inner problem of the planner: an ILP over how many blocks each pipeline rank holds
and which of them recompute, for one choice of the outer knobs.

Blocks are identical, so a layout is p × 3 integer counts (none, selective,
full per rank), not L × p binaries: the problem size does not grow with the
number of layers. The objective and every constraint are ``cost_models.terms``
verbatim (labels name the cost-model term), so the ILP's optimum is the best
layout's estimate. Solved with PuLP + HiGHS (CBC if HiGHS is missing);
``sol_status`` is checked, not ``LpStatus``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator

import pulp

from autopar.cost_models.terms import Terms

MIP_GAP = 1e-6
"""Relative optimality gap each layout ILP must prove (unless its time limit runs out first)."""


def max_blocks(terms: Terms, rank: int, capacity: float, recompute: str) -> int:
    """Most blocks rank ``rank`` can hold if all of them use ``recompute`` (memory constraint
    of the ILP solved for one rank). Mixing choices never holds more than the leanest one."""
    st, u = terms.strategy, terms.block[recompute]
    fixed = terms.buffers[rank] + terms.reserve_bytes
    for edge, here in ((terms.embed, rank == 0), (terms.head, rank == st.pp - 1)):
        if here:
            fixed += edge.params * terms.state_bytes_per_param + terms.inflight[rank] * edge.act_bytes
    if rank == st.pp - 1:
        fixed += terms.loss_bytes
    if recompute == "full":
        fixed += u.act_full_bytes
    per_block = u.params * terms.state_bytes_per_param + terms.inflight[rank] * u.act_bytes
    return max(0, math.floor((capacity - fixed) / per_block)) if per_block > 0 else 10**9


def fits_somehow(terms: Terms, blocks: int, capacity: float, allowed: tuple[str, ...]) -> bool:
    """Exact feasibility of the layout ILP: ranks are independent but for Σ blocks = L."""
    st = terms.strategy
    caps = [max(max_blocks(terms, k, capacity, r) for r in allowed) for k in range(st.pp)]
    if st.virtual_stages > 1:
        return all(c >= blocks // st.pp for c in caps)
    return all(c >= 1 for c in caps) and sum(min(c, blocks) for c in caps) >= blocks


def solve_layout(
    terms: Terms, *, blocks: int, capacity: float, allowed: tuple[str, ...], time_limit: float
) -> tuple[tuple[tuple[int, int, int], ...], float] | None:
    """The ILP over block counts per rank; returns (layout, proven gap) or None if nothing fits."""
    st = terms.strategy
    p, m, v = st.pp, st.micro_batches, st.virtual_stages
    # Selective recompute of a model whose attention keeps nothing quadratic (flash) is the
    # same as none: drop the duplicate when none is allowed too.
    same = terms.block["selective"] == terms.block["none"]
    choices = [r for r in allowed if not (r == "selective" and same and "none" in allowed)]
    prob = pulp.LpProblem("layout", pulp.LpMinimize)
    per_rank_fixed = blocks // p if v > 1 else None
    # Tight bounds from each rank's memory alone (max_blocks) make the relaxation much stronger.
    upper = {(k, r): min(blocks, max_blocks(terms, k, capacity, r)) for k in range(p) for r in choices}
    n = {
        (k, r): pulp.LpVariable(f"n_{k}_{r}", lowBound=0, upBound=upper[k, r], cat="Integer")
        for (k, r) in upper
    }
    has_full = {k: pulp.LpVariable(f"full_{k}", cat="Binary") for k in range(p)} if "full" in choices else {}
    slowest = pulp.LpVariable("T_slowest_stage_s", lowBound=0)
    dp_time = pulp.LpVariable("dp_exposed_s", lowBound=0)
    opt_time = pulp.LpVariable("optimizer_s", lowBound=0)
    # Units: time in one block's micro-batch time, memory as a fraction of capacity, so that
    # HiGHS's absolute tolerances (1e-7) are small against every quantity.
    ts, ms = 1.0 / terms.block["none"].time_s, 1.0 / capacity
    rounds = m + (p - 1) / v
    prob += rounds * slowest + dp_time + opt_time + rounds * terms.p2p_s * ts, "step_time_s"
    prob += pulp.lpSum(n.values()) == blocks, "every_block_placed"
    lat, spb, mb = terms.lat_s * ts, terms.s_per_byte * ts, m  # all-gather
    rlat, rspb = terms.rs_lat_s * ts, terms.rs_s_per_byte * ts  # reduce-scatter
    for k in range(p):
        fixed = [u for u, here in ((terms.embed, k == 0), (terms.head, k == p - 1)) if here]
        count = pulp.lpSum(n[k, r] for r in choices)
        if per_rank_fixed is not None:
            prob += count == per_rank_fixed, f"interleaved_equal_chunks_{k}"
        else:
            prob += count >= 1, f"stage_non_empty_{k}"

        def lin(attr: str, scale: float = 1.0, k: int = k, fixed: list = fixed) -> pulp.LpAffineExpression:
            return pulp.lpSum(scale * getattr(terms.block[r], attr) * n[k, r] for r in choices) + sum(
                scale * getattr(u, attr) for u in fixed
            )

        time_k, params_k = lin("time_s", ts), lin("params")
        bwd_k, fwd_k = lin("bwd_s", ts), lin("fwd_s", ts)
        layers_k = count + len(fixed)
        # compute + recompute + TP comm of one micro-batch on this rank
        prob += slowest >= time_k, f"stage_time_{k}"
        # model states + in-flight activations + rematerialised layer + loss + buffers + reserve
        memory_k = params_k * terms.state_bytes_per_param * ms + terms.inflight[k] * lin("act_bytes", ms)
        if has_full:
            memory_k += has_full[k] * terms.block["full"].act_full_bytes * ms
            prob += n[k, "full"] <= upper[k, "full"] * has_full[k], f"full_recompute_flag_{k}"
        fixed_mem = terms.buffers[k] + terms.reserve_bytes + (terms.loss_bytes if k == p - 1 else 0.0)
        prob += memory_k + fixed_mem * ms <= 1.0, f"memory_{k}"
        prob += opt_time >= params_k * terms.opt_s_per_param * ts, f"optimizer_{k}"
        if st.dp == 1:
            continue
        grad, weights = params_k * terms.grad_bytes, params_k * terms.weight_bytes
        kappa = terms.overlap  # share of compute that hides DP collectives
        overlap = kappa * (bwd_k - terms.block["none"].bwd_s * ts)
        hinge = pulp.LpVariable(f"dp_hidden_excess_{k}", lowBound=0)
        if st.zero in (0, 1):  # DDP's gradient all-reduce beyond what backward hides
            all_reduce = (terms.ar_lat_s + terms.ar_s_per_byte * grad) * ts
            prob += hinge >= all_reduce - overlap, f"dp_allreduce_{k}"
            prob += hinge >= terms.last_bucket_s * ts, f"ddp_last_bucket_{k}"
            # ZeRO-1: + the updated shards' broadcast (an all-gather of the weights)
            prob += dp_time >= hinge + (lat + spb * weights if st.zero == 1 else 0), f"dp_exposed_{k}"
        elif st.zero == 2:  # reduce-scatter beyond the overlap, per micro-batch + weight all-gather
            rs = rspb * grad + layers_k * rlat
            prob += hinge >= rs - overlap, f"zero_reduce_scatter_{k}"
            prob += dp_time >= mb * hinge + lat + spb * weights, f"dp_exposed_{k}"
        else:  # ZeRO-3: weight gathers beyond forward / backward compute, every micro-batch
            full_w = (
                n[k, "full"] * terms.block["full"].params * terms.weight_bytes if "full" in choices else 0
            )
            full_layers = n[k, "full"] if "full" in choices else 0
            gather_b = pulp.LpVariable(f"zero3_backward_excess_{k}", lowBound=0)
            prob += hinge >= layers_k * lat + spb * weights - kappa * fwd_k, f"zero3_forward_gather_{k}"
            prob += (
                (
                    gather_b
                    >= (layers_k + full_layers) * lat
                    + spb * (weights + full_w)
                    + layers_k * rlat
                    + rspb * grad
                    - kappa * bwd_k
                ),
                f"zero3_backward_gather_reduce_{k}",
            )
            prob += dp_time >= mb * (hinge + gather_b), f"dp_exposed_{k}"
    solver = (
        # Prove optimality to MIP_GAP relative (times are scaled to block units above),
        # not to HiGHS's default absolute gap of 1e-6 in whatever units.
        pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=MIP_GAP, gapAbs=0.0)
        if pulp.HiGHS().available()
        else pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=MIP_GAP)
    )
    with stdout_silenced():  # HiGHS prints a banner once per process, even with msg=False
        prob.solve(solver)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    gap = 0.0
    model = getattr(prob, "solverModel", None)
    if model is not None and prob.sol_status != pulp.LpSolutionOptimal:
        gap = float(model.getInfo().mip_gap)
    layout = tuple(
        (
            round(n[k, "none"].value()) if "none" in choices else 0,
            round(n[k, "selective"].value()) if "selective" in choices else 0,
            round(n[k, "full"].value()) if "full" in choices else 0,
        )
        for k in range(p)
    )
    return layout, gap


@contextlib.contextmanager
def stdout_silenced() -> Iterator[None]:
    """Point file descriptor 1 at /dev/null (C libraries write there directly)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
