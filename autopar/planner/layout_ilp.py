"""The inner problem of the planner: an ILP over how many blocks each pipeline rank holds
and which of them recompute, for one choice of the outer knobs.

Blocks are identical, so a layout is p × c integer counts (blocks per rank and
recompute choice: none, selective, full and the per-operator policies), not L × p
binaries: the problem size does not grow with the number of layers. The objective
and every constraint are ``cost_models.terms`` verbatim (labels name the cost-model
term), so the ILP's optimum is the best layout's estimate. Solved with PuLP + HiGHS (CBC if HiGHS is missing);
``sol_status`` is checked, not ``LpStatus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pulp

from autopar.cost_models.buckets import overlap_share
from autopar.cost_models.dp_overlap import slowed, zero3_unhidden_s
from autopar.cost_models.mixed import ReplicaClass
from autopar.cost_models.rank_load import edge_units
from autopar.cost_models.terms import Terms
from autopar.planner.solver import mip_solver, solve
from autopar.strategy import MULTI_CHUNK, Strategy, even_split, remat

MIP_GAP = 1e-6
"""Relative optimality gap each layout ILP must prove (unless its time limit runs out first)."""


@dataclass(frozen=True)
class LayoutProblem:
    """One outer choice's inner problem, what the bounds, the feasibility check and the layout
    ILP all take: its priced terms, the model's blocks, the memory a rank may use, and the
    recompute choices allowed (none, selective, full and policy names)."""

    terms: Terms
    """``cost_models.terms.build_terms`` of the outer choice (``terms.strategy``)."""
    blocks: int
    """Identical blocks to place (the model's, embedding and head apart)."""
    capacity: float = math.inf
    """Bytes a rank may use."""
    allowed: tuple[str, ...] = ("none",)
    """Recompute choices a block may take."""
    classes: tuple[ReplicaClass, ...] = ()
    """On a mixed cluster, the replicas' classes (``cost_models.mixed``): each pipeline rank of each
    priced on its own device and memory, the step their slowest pipeline; empty: every rank of
    every replica priced by ``terms`` within ``capacity``."""

    @property
    def strategy(self) -> Strategy:
        """The outer choice."""
        return self.terms.strategy


def rank_budgets_bytes(terms: Terms, capacity: float) -> list[float]:
    """Memory left on each rank for its blocks: the capacity less its buffers, reserve, the
    embedding's and the head's states and in-flight activations, and the loss (the ILP's
    ``memory_k`` constraint without its blocks and without a rematerialised block)."""
    st = terms.strategy
    budgets = [capacity - b - terms.reserve_bytes for b in terms.buffers]
    for edge, k in ((terms.embed, 0), (terms.head, st.head_rank)):
        budgets[k] -= edge.params * terms.state_bytes_per_param + terms.held_bytes(
            k, edge.act_bytes, edge.deferred_bytes
        )
    budgets[st.head_rank] -= terms.loss_bytes
    return budgets


def block_bytes(terms: Terms, rank: int, recompute: str) -> float:
    """One block's memory on rank ``rank`` with ``recompute``: its model states and its
    activations times the micro-batches in flight there."""
    u = terms.block[recompute]
    states = terms.weighted(u.params, u.expert_params, "state") * terms.state_bytes_per_param
    return states + terms.held_bytes(rank, u.act_bytes, u.deferred_bytes)


def rank_max_blocks(
    terms: Terms, capacity: float, recompute: str, budgets: list[float] | None = None
) -> list[int]:
    """Most blocks each rank can hold if all of them use ``recompute`` (memory constraint of
    the ILP solved for one rank; ``budgets``: ``rank_budgets_bytes`` if already known). Mixing
    choices never holds more than the leanest one."""
    u = terms.block[recompute]
    states = terms.weighted(u.params, u.expert_params, "state") * terms.state_bytes_per_param
    rebuilt = u.act_full_bytes if remat(recompute) else 0.0  # its backward rebuilds one block
    out = []
    for k, budget in enumerate(budgets or rank_budgets_bytes(terms, capacity)):
        per_block = states + terms.held_bytes(k, u.act_bytes, u.deferred_bytes)
        room = (budget - rebuilt) / per_block if per_block > 0 else math.inf
        out.append(max(0, math.floor(room)) if room < 10**9 else 10**9)
    return out


FREE_INTERLEAVED_PP = 4
"""Up to this pipeline depth the layout ILP decides how many blocks each interleaved rank holds,
as it does for 1F1B stages; deeper, each holds the even split's count (``even_split`` over the
ranks: extra blocks to the middle ranks, so the embedding's and the head's are the lighter).
Measured here: with free counts a pp-32 interleaved layout ILP of GPT-3 175B took 1.4–5 s to
prove optimal (0.03 s with the counts fixed), and planning Llama-3 405B on 16,384 GPUs 11 s
instead of 3."""


def fixed_rank_blocks(st: Strategy, blocks: int) -> list[int] | None:
    """Blocks each pipeline rank must hold where ``FREE_INTERLEAVED_PP`` fixes them (a
    multi-chunk schedule, zero bubble at one chunk per rank too: its bound is low, so the search
    visits deep ones, whose free-count ILPs took 0.2–0.6 s each at pp 32–64), else None."""
    if st.schedule not in MULTI_CHUNK or st.pp <= FREE_INTERLEAVED_PP:
        return None
    return even_split(blocks, st.pp, [st.min_rank_blocks(k) for k in range(st.pp)])


def fits_somehow(problem: LayoutProblem) -> bool:
    """Exact feasibility of the layout ILP: ranks are independent but for Σ blocks = L."""
    terms, blocks, capacity, allowed = problem.terms, problem.blocks, problem.capacity, problem.allowed
    st = terms.strategy
    # the most blocks come from the leanest choice with and without rematerialisation (within
    # each, the fixed memory is the same and blocks differ only in their activations)
    leanest = {remat(r): r for r in sorted(allowed, key=lambda r: -terms.block[r].act_bytes)}.values()
    budgets = rank_budgets_bytes(terms, capacity)
    caps = [
        max(c) for c in zip(*(rank_max_blocks(terms, capacity, r, budgets) for r in leanest), strict=True)
    ]
    need = fixed_rank_blocks(st, blocks) or [st.min_rank_blocks(k) for k in range(st.pp)]
    return (
        sum(need) <= blocks
        and all(c >= n for c, n in zip(caps, need, strict=True))
        and sum(min(c, blocks) for c in caps) >= blocks
    )


class LayoutILP:
    """The layout ILP of one outer choice: ``n[k, r]`` blocks on rank k with recompute r.

    On a mixed cluster (``LayoutProblem.classes``) the counts are the same on every replica, and
    each class of replicas has its own slowest stage, pipeline time and each rank its own memory
    limit: the step is the slowest class's pipeline plus the worst rank's DP and optimizer time
    (``cost_models.mixed``'s module doc)."""

    def __init__(self, problem: LayoutProblem) -> None:
        terms, blocks, capacity, allowed = problem.terms, problem.blocks, problem.capacity, problem.allowed
        st = self.strategy = terms.strategy
        self.terms, self.blocks, self.capacity = terms, blocks, capacity
        self.fixed = fixed_rank_blocks(st, blocks)
        # Selective recompute of a model whose attention keeps nothing quadratic (flash) is the
        # same as none: drop the duplicate when none is allowed too.
        same = terms.block["selective"] == terms.block["none"]
        self.choices = [r for r in allowed if not (r == "selective" and same and "none" in allowed)]
        self.prob = pulp.LpProblem("layout", pulp.LpMinimize)
        # each rank's terms and memory: one pair per rank, or each class's at that rank
        self.cells = _cells(problem)
        # Tight bounds from each rank's memory alone (rank_max_blocks) make the relaxation much stronger.
        caps = {
            (k, r): min(rank_max_blocks(t, cap, r)[k] for t, cap in self.cells[k])
            for k in range(st.pp)
            for r in self.choices
        }
        self.upper = {(k, r): min(blocks, caps[k, r]) for k in range(st.pp) for r in self.choices}
        self.n = {
            (k, r): pulp.LpVariable(f"n_{k}_{r}", lowBound=0, upBound=self.upper[k, r], cat="Integer")
            for (k, r) in self.upper
        }
        self.remat = [r for r in self.choices if remat(r)]  # full and the per-operator policies
        self.has_remat = (
            {k: pulp.LpVariable(f"rematerialises_{k}", cat="Binary") for k in range(st.pp)}
            if self.remat
            else {}
        )
        # each class of replicas' slowest stage and its terms by rank (one class: every replica)
        classes = problem.classes or (None,)
        self.slowest = {
            i: pulp.LpVariable("T_slowest_stage_s" if c is None else f"T_slowest_stage_{i}_s", lowBound=0)
            for i, c in enumerate(classes)
        }
        self.stage_terms = {i: [terms] * st.pp if c is None else list(c.terms) for i, c in enumerate(classes)}
        self.dp_time = pulp.LpVariable("dp_exposed_s", lowBound=0)
        self.opt_time = pulp.LpVariable("optimizer_s", lowBound=0)
        # Units: time in one block's micro-batch time, memory as a fraction of capacity, so that
        # HiGHS's absolute tolerances (1e-7) are small against every quantity.
        self.ts = 1.0 / terms.block["none"].time_s
        self.prob += self._pipeline_time(problem) + self.dp_time + self.opt_time, "step_time_s"
        self.prob += pulp.lpSum(self.n.values()) == blocks, "every_block_placed"
        for k in range(st.pp):
            self.add_rank(k)

    def _pipeline_time(self, problem: LayoutProblem) -> pulp.LpAffineExpression:
        """The slowest pipeline's m micro-batches and bubble, in block units: one slowest stage
        (``stage_time_k``), or on a mixed cluster the slowest of the classes' pipelines."""
        ts = self.ts
        if not problem.classes:
            terms = self.terms
            rounds = (
                self.strategy.micro_batches + terms.bubble_rounds
            )  # the schedule's bubble (cost_models.pipeline)
            return rounds * self.slowest[0] + rounds * terms.p2p_s * ts
        pipeline = pulp.LpVariable("T_slowest_pipeline_s", lowBound=0)
        for i, c in enumerate(problem.classes):
            rounds = c.micro_batches + c.terms[0].bubble_rounds
            self.prob += (
                pipeline >= rounds * self.slowest[i] + rounds * c.p2p_s * ts,
                f"pipeline_time_class_{i}",
            )
        return pipeline + 0

    def lin(
        self, k: int, attr: str, scale: float = 1.0, terms: Terms | None = None
    ) -> pulp.LpAffineExpression:
        """Σ over rank k's blocks (and its embedding / head) of one ``Unit`` attribute (by
        ``terms``: the rank's on its device; default the problem's)."""
        t = terms or self.terms
        fixed = [u for u, here in ((t.embed, k == 0), (t.head, k == self.strategy.head_rank)) if here]
        return pulp.lpSum(scale * getattr(t.block[r], attr) * self.n[k, r] for r in self.choices) + sum(
            scale * getattr(u, attr) for u in fixed
        )

    def add_rank(self, k: int) -> None:
        """Rank k's block count, then per device it runs on its memory, optimizer and DP exposure."""
        st = self.strategy
        count = pulp.lpSum(self.n[k, r] for r in self.choices)
        if self.fixed is not None:  # a deep interleaved pipeline: the even split's count
            self.prob += count == self.fixed[k], f"interleaved_even_split_{k}"
        else:  # a block per chunk (interleaved: but the embedding's and the head's chunks)
            self.prob += count >= st.min_rank_blocks(k), f"chunks_non_empty_{k}"
        # compute + recompute + TP comm of one micro-batch on this rank (each class's device)
        for i, by_rank in self.stage_terms.items():
            tag = "" if len(self.stage_terms) == 1 else f"_class_{i}"
            self.prob += self.slowest[i] >= self.lin(k, "time_s", self.ts, by_rank[k]), f"stage_time_{k}{tag}"
        if self.has_remat:
            for r in self.remat:
                self.prob += (
                    self.n[k, r] <= self.upper[k, r] * self.has_remat[k],
                    f"rematerialise_flag_{k}_{r}",
                )
        for i, (terms, capacity) in enumerate(self.cells[k]):
            self.add_cell(k, count, terms, capacity, "" if len(self.cells[k]) == 1 else f"_device_{i}")

    def add_cell(
        self, k: int, count: pulp.LpAffineExpression, terms: Terms, capacity: float, tag: str
    ) -> None:
        """Rank k's memory and optimizer constraints and its DP exposure on one device."""
        st, ts, ms = self.strategy, self.ts, 1.0 / capacity
        params_k, experts_k = self.lin(k, "params", 1.0, terms), self.lin(k, "expert_params", 1.0, terms)
        # model states + in-flight activations + rematerialised layer + loss + buffers + reserve
        states_k = terms.weighted(params_k, experts_k, "state")  # experts: ZeRO over dp/ep ranks
        memory_k = states_k * terms.state_bytes_per_param * ms + terms.held_bytes(
            k, self.lin(k, "act_bytes", ms, terms), self.lin(k, "deferred_bytes", ms, terms)
        )
        if self.has_remat:  # one block's activations rebuilt in backward (full or a policy)
            memory_k += self.has_remat[k] * terms.block["none"].act_full_bytes * ms
        fixed_mem = terms.buffers[k] + terms.reserve_bytes + (terms.loss_bytes if k == st.head_rank else 0.0)
        self.prob += memory_k + fixed_mem * ms <= 1.0, f"memory_{k}{tag}"
        opt_k = terms.weighted(params_k, experts_k, "optimizer")
        self.prob += self.opt_time >= opt_k * terms.opt_s_per_param * ts, f"optimizer_{k}{tag}"
        if st.dp > 1:
            units_k = count + edge_units(st, k)  # FSDP2 units (``RankLoad.zero_units``)
            self.add_dp_exposure(k, terms.weighted(params_k, experts_k, "comm"), units_k, terms, tag)

    def add_dp_exposure(
        self,
        k: int,
        params_k: pulp.LpAffineExpression,
        units_k: pulp.LpAffineExpression,
        terms: Terms,
        tag: str = "",
    ) -> None:
        """The DP/ZeRO collectives of rank k that compute does not hide (``dp_overlap.dp_exposed_s``)."""
        st, ts = self.strategy, self.ts
        lat, spb, mb = terms.lat_s * ts, terms.s_per_byte * ts, terms.strategy.micro_batches  # all-gather
        rlat, rspb = terms.rs_lat_s * ts, terms.rs_s_per_byte * ts  # reduce-scatter
        grad, weights = params_k * terms.grad_bytes, params_k * terms.weight_bytes
        kappa = terms.overlap  # share of compute that hides DP collectives
        bwd_k = self.lin(k, "bwd_s", ts, terms)
        overlap = kappa * (bwd_k - terms.block["none"].bwd_s * ts)
        hinge = pulp.LpVariable(f"dp_hidden_excess_{k}{tag}", lowBound=0)
        s = terms.overlap_slowdown  # hidden seconds slow compute: ``dp_overlap.slowed``

        if st.zero in (0, 1):  # DDP's gradient all-reduce beyond what backward hides
            # an all-reduce per bucket, hidden by the backward after the first bucket fills
            # (``buckets.ddp_buckets``, ``buckets.overlap_share``)
            all_reduce = (terms.ddp_buckets * terms.ar_lat_s + terms.ar_s_per_byte * grad) * ts
            hidden = overlap_share(terms.ddp_buckets) * overlap
            self.prob += hinge >= all_reduce - hidden, f"dp_allreduce_{k}{tag}"
            self.prob += hinge >= terms.last_bucket_s * ts, f"ddp_last_bucket_{k}{tag}"
            # ZeRO-1: + the updated shards' broadcast (an all-gather of the weights)
            self.prob += (
                self.dp_time >= slowed(hinge, all_reduce, s) + (lat + spb * weights if st.zero == 1 else 0),
                f"dp_exposed_{k}{tag}",
            )
        elif st.zero == 2:  # reduce-scatter beyond the overlap, per micro-batch + weight all-gather
            # (under a pipeline once per step: torch's schedules reduce in the last backward only)
            rs = rspb * grad + units_k * rlat
            reductions = 1 if st.pp > 1 else mb
            self.prob += hinge >= rs - overlap, f"zero_reduce_scatter_{k}{tag}"
            self.prob += (
                self.dp_time >= reductions * slowed(hinge, rs, s) + lat + spb * weights,
                f"dp_exposed_{k}{tag}",
            )
        else:
            self.add_zero3_exposure(
                k, hinge, units_k * lat + spb * weights, units_k * rlat + rspb * grad, terms, tag
            )

    def add_zero3_exposure(
        self,
        k: int,
        hinge: pulp.LpVariable,
        gather: pulp.LpAffineExpression,
        reduce: pulp.LpAffineExpression,
        terms: Terms,
        tag: str = "",
    ) -> None:
        """ZeRO-3: weight gathers beyond forward / backward compute, every micro-batch (one
        gather before the backward serves a recomputed forward too: ``dp_exposed_s``)."""
        st, ts, mb = self.strategy, self.ts, terms.strategy.micro_batches
        kappa, s = terms.overlap, terms.overlap_slowdown
        bwd_k, fwd_k = self.lin(k, "bwd_s", ts, terms), self.lin(k, "fwd_s", ts, terms)
        gather_b = pulp.LpVariable(f"zero3_backward_excess_{k}{tag}", lowBound=0)
        first, last = (x * ts for x in zero3_unhidden_s(terms))
        self.prob += hinge >= gather - kappa * fwd_k, f"zero3_forward_gather_{k}{tag}"
        self.prob += hinge >= first, f"zero3_first_gather_{k}{tag}"
        if st.pp > 1:  # the reduce-scatters once per step, in the last backward
            reduce_x = pulp.LpVariable(f"zero3_reduce_excess_{k}{tag}", lowBound=0)
            self.prob += gather_b >= gather - kappa * bwd_k, f"zero3_backward_gather_{k}{tag}"
            self.prob += gather_b >= first, f"zero3_first_backward_gather_{k}{tag}"
            self.prob += reduce_x >= reduce - kappa * bwd_k, f"zero3_reduce_{k}{tag}"
            self.prob += reduce_x >= last, f"zero3_last_reduce_{k}{tag}"
            self.prob += (
                self.dp_time >= mb * slowed(hinge + gather_b, 2 * gather, s) + slowed(reduce_x, reduce, s),
                f"dp_exposed_{k}{tag}",
            )
            return
        self.prob += gather_b >= gather + reduce - kappa * bwd_k, f"zero3_backward_gather_reduce_{k}{tag}"
        self.prob += gather_b >= first + last, f"zero3_first_gather_last_reduce_{k}{tag}"
        self.prob += (
            self.dp_time >= mb * slowed(hinge + gather_b, 2 * gather + reduce, s),
            f"dp_exposed_{k}{tag}",
        )

    def layout(self) -> tuple[tuple[int, ...], ...]:
        """The solved counts per rank and recompute choice (``Strategy.choices``)."""

        def count(k: int, r: str) -> int:
            return round(self.n[k, r].value()) if r in self.choices else 0

        st = self.strategy
        return tuple(tuple(count(k, r) for r in st.choices) for k in range(st.pp))


def _cells(problem: LayoutProblem) -> list[list[tuple[Terms, float]]]:
    """Each pipeline rank's (terms, memory capacity) pairs: its own, or on a mixed cluster each
    distinct one among the classes of replicas."""
    pp = problem.strategy.pp
    if not problem.classes:
        return [[(problem.terms, problem.capacity)] for _ in range(pp)]
    out: list[list[tuple[Terms, float]]] = []
    for k in range(pp):
        seen: dict[int, tuple[Terms, float]] = {}
        for c in problem.classes:
            seen.setdefault(id(c.terms[k]), (c.terms[k], min(c.capacity[k], problem.capacity)))
        out.append(list(seen.values()))
    return out


def solve_layout(
    problem: LayoutProblem, *, time_limit: float
) -> tuple[tuple[tuple[int, ...], ...], float] | None:
    """The ILP over block counts per rank; returns (layout, proven gap) or None if nothing fits."""
    ilp = LayoutILP(problem)
    # Prove optimality to MIP_GAP relative (times are scaled to block units above).
    if not solve(ilp.prob, mip_solver(time_limit_s=time_limit, gap_rel=MIP_GAP)):
        return None
    gap = 0.0
    model = getattr(ilp.prob, "solverModel", None)
    if model is not None and ilp.prob.sol_status != pulp.LpSolutionOptimal:
        gap = float(model.getInfo().mip_gap)
    return ilp.layout(), gap
