"""Choose a tensor-parallel strategy for every operator of a layer (Alpa-style intra-op ILP).

For one representative layer of each layer type (repeated layers are solved once),
every operator picks one strategy from ``passes.tp_rules.strategies``; every edge
pays for turning the producer's output placement into what the consumer needs.
Minimise Σ compute + Σ collectives (forward and backward), the formulation of
Zheng et al., "Alpa", OSDI'22, §4.1, solved with PuLP + HiGHS. Every coefficient is a
``cost_models.tp`` price (its table of placement changes is the edge cost):

    min  Σ_v Σ_s x[v,s]·(compute(v)·frac(s) + own_comm(v,s))
       + Σ_(u, p→q) z[u,p,q]·reshard(p → q)
    s.t. Σ_s x[v,s] = 1                           (one strategy per operator)
         Σ_v Σ_s x[v,s]·mem(v,s) ≤ budget          (memory, when a budget is given: the
                                                  weights' states ÷ t where split, plus saved
                                                  activations; ``op_memory_bytes``)
         z[u,p,q] ≥ x[u,a] + x[v,b] − 1           for each consumer v of u with out(a) = p,
                                                  in_v(b) = q (one conversion per tensor and
                                                  placement, shared by its consumers, as the
                                                  pass inserts it)
         x[u,a] + x[v,b] ≤ 1  where reshard = ∞   (no all-to-all between different shard dims)
         Σ_(s: w(s)=p) x[u,s] = Σ_(s: w(s)=p) x[v,s]  (a weight read by u and v, e.g. tied
                                                  embedding and head, has one placement p)
         layer outputs leave as the residual stream: replicated, or split over the sequence
         under sequence parallelism (a conversion is priced where an output can't be)

The ``memory`` objective first minimises Σ mem (M*), then time under Σ mem ≤ 1.01·M*: the
leanest layout, which the planner prices next to the fastest (``tp_layouts.TPLayouts``).

Megatron's block layout (column QKV and first MLP linear, heads-split attention,
row output and second MLP linear: one all-reduce per sub-block each way) is not
written anywhere here: it is what these costs select.
"""

from __future__ import annotations

import itertools

import pulp
from torch import fx

from autopar.cluster import Cluster
from autopar.cost_models.memory import STATE_BYTES
from autopar.cost_models.tp import (
    INFEASIBLE,
    LayerContext,
    LayerTP,
    collectives_s,
    kept_for_backward,
    layer_context,
    leave,
    op_compute_s,
    op_memory_bytes,
    own_collectives,
    param_owners,
    param_placement,
    price_layer,
    reshard,
    tensor_bytes,
)
from autopar.errors import AutoparError
from autopar.passes.tp_graph import GraphIndex
from autopar.passes.tp_rules import OpStrategy, R, strategies, tensor_args
from autopar.planner.solver import solve
from autopar.strategy import TP_OBJECTIVES

LEAN_SLACK = 0.01
"""The leanest layout may hold 1% more than the least memory, for speed."""


class LayerILP:
    """The ILP above for the operators of one layer context: ``x[node, i]`` picks strategy i of
    ``options[node]``; ``cost`` collects the objective's terms, ``memory`` the bytes held."""

    def __init__(self, ctx: LayerContext, name: str, memory_budget_bytes: float | None) -> None:
        self.ctx = ctx
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.options = {n: strategies(n, ctx.t) for n in ctx.nodes}
        self.x = {
            (n, i): pulp.LpVariable(f"x_{n.name}_{i}", cat="Binary")
            for n in ctx.nodes
            for i in range(len(self.options[n]))
        }
        self.cost: list[pulp.LpAffineExpression] = []
        self.shared: dict[tuple[str, str, str], pulp.LpVariable] = {}
        self.per_param = sum(STATE_BYTES[ctx.dtype])
        self.owners = param_owners(list(ctx.nodes))
        self.memory = pulp.lpSum(self.op_memory(n, s) * self.x[n, i] for n, i, s in self.choices())
        if memory_budget_bytes is not None:
            self.prob += self.memory <= memory_budget_bytes, "memory_budget"
        self.add_strategy_terms()
        self.add_edge_terms()
        self.add_tied_weights()

    def choices(self) -> list[tuple[fx.Node, int, OpStrategy]]:
        return [(n, i, s) for n in self.ctx.nodes for i, s in enumerate(self.options[n])]

    def op_memory(self, n: fx.Node, s: OpStrategy) -> float:
        return op_memory_bytes(n, s, self.ctx.t, state_bytes_per_param=self.per_param, owners=self.owners)

    def add_strategy_terms(self) -> None:
        """One strategy per operator: its compute share and own collectives; a layer output
        that is not in the stream's placement pays for leaving as it (an operator that can only
        run replicated, e.g. MoE routing, pays for the conversion)."""
        ctx = self.ctx
        for n in ctx.nodes:
            self.prob += (
                pulp.lpSum(self.x[n, i] for i in range(len(self.options[n]))) == 1,
                f"one_strategy_{n.name}",
            )
            base = op_compute_s(n, ctx.cluster, ctx.dtype)
            for i, s in enumerate(self.options[n]):
                own = collectives_s(own_collectives(n, s), ctx.t, ctx.link, ctx.forward_passes)
                self.cost.append((base * s.compute_fraction + own) * self.x[n, i])
                to = R if n.name in ctx.final else ctx.stream
                if n.name in ctx.outputs and s.out != to:
                    grad, final = n.name in ctx.grads, n.name in ctx.final
                    c, _ = leave(
                        n,
                        s.out,
                        to,
                        ctx.t,
                        ctx.link,
                        grad=grad,
                        final=final,
                        forward_passes=ctx.forward_passes,
                    )
                    if c == INFEASIBLE:
                        self.prob += self.x[n, i] == 0, f"output_stream_{n.name}_{i}"
                    else:
                        self.cost.append(c * self.x[n, i])

    def convert_once(
        self, key: tuple[str, str, str], c: float, active: pulp.LpAffineExpression, name: str
    ) -> None:
        """One conversion per (tensor, from, to), shared by all its consumers, as the pass inserts
        it: for Megatron's f the consumers' partial gradients add up before the one all-reduce."""
        if key not in self.shared:
            self.shared[key] = pulp.LpVariable(f"conv_{len(self.shared)}", lowBound=0)
            self.cost.append(c * self.shared[key])
        self.prob.addConstraint(self.shared[key] >= active, name)

    def add_edge_terms(self) -> None:
        """Every tensor an operator reads pays ``reshard`` from its producer's placement (or the
        layer boundary's) to the one the consumer's strategy needs."""
        ctx, x = self.ctx, self.x
        inside = set(ctx.nodes)
        for v in ctx.nodes:
            for slot, u in enumerate(tensor_args(v)):
                size, kept = tensor_bytes(u), kept_for_backward(u)
                pairs = (
                    [(None, ctx.outside[u.name])]
                    if u not in inside
                    else [(a, su.out) for a, su in enumerate(self.options[u])]
                )
                for b, sv in enumerate(self.options[v]):
                    need = sv.inputs[slot] if slot < len(sv.inputs) else R
                    for a, have in pairs:
                        c, _ = reshard(
                            have,
                            need,
                            size,
                            ctx.t,
                            ctx.link,
                            grad=u.name in ctx.grads,
                            forward_passes=ctx.forward_passes,
                            kept=kept,
                        )
                        active = x[v, b] if a is None else x[u, a] + x[v, b] - 1
                        tag = f"{u.name}_{v.name}_{slot}_{a}_{b}"
                        if c == INFEASIBLE:
                            self.prob += active <= 0, f"no_reshard_{tag}"
                        elif c > 0:
                            self.convert_once((u.name, have, need), c, active, f"conv_{tag}")

    def add_tied_weights(self) -> None:
        """A parameter read by several operators (a weight tied between embedding and head) has one
        placement: the strategies chosen must agree on it."""
        readers: dict[str, list[tuple[fx.Node, int]]] = {}
        for n in self.ctx.nodes:
            for pos, arg in enumerate(n.args):
                if isinstance(arg, fx.Node) and arg.op == "get_attr":
                    readers.setdefault(str(arg.target), []).append((n, pos))
        tied = itertools.count()
        for users in readers.values():
            for (u, pu), (v, pv) in itertools.pairwise(users):
                places = {param_placement(s, u, pu) for s in self.options[u]} | {
                    param_placement(s, v, pv) for s in self.options[v]
                }
                for place in places:
                    self.prob += (
                        self.chosen_with(u, pu, place) == self.chosen_with(v, pv, place),
                        f"tied_{next(tied)}",
                    )

    def chosen_with(self, n: fx.Node, pos: int, place: str) -> pulp.LpAffineExpression:
        """1 when the strategy chosen for ``n`` puts its parameter at ``pos`` in ``place``."""
        return pulp.lpSum(
            self.x[n, i] for i, s in enumerate(self.options[n]) if param_placement(s, n, pos) == place
        )

    def solve(self, time_limit_s: float, failure: str) -> None:
        if not solve(self.prob, pulp.HiGHS(msg=False, timeLimit=time_limit_s)):
            raise AutoparError(f"{failure} (solver status {self.prob.status})")

    def solution(self) -> dict[str, OpStrategy]:
        """Node name → the strategy the solved ILP picked."""
        return {
            n.name: self.options[n][
                next(i for i in range(len(self.options[n])) if (self.x[n, i].value() or 0) > 0.5)
            ]
            for n in self.ctx.nodes
        }


def choose_layer(
    gm: fx.GraphModule,
    layer: int | tuple[int, ...],
    t: int,
    cluster: Cluster,
    *,
    dtype: str,
    sp: bool = False,
    objective: str = "time",
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 10.0,
    index: GraphIndex | None = None,
    fastest: LayerTP | None = None,
    forward_passes: int = 1,
) -> LayerTP:
    """Solve the ILP above for the operators of layer index ``layer`` (or of several layers solved
    together: embedding and head, which may share a weight) at TP degree ``t`` (``sp``: the
    residual stream enters and leaves split over the sequence).

    Memory (``op_memory_bytes`` summed over the chosen strategies: model states plus saved
    activations): at most ``memory_budget_bytes`` when given. ``objective`` ``time``: the
    fastest layout; ``memory``: the fastest of the leanest, i.e. first the least memory M*, then
    the least time with memory ≤ M*·(1 + LEAN_SLACK), so that a few bytes of replicated norm
    weights don't buy a slower layout; ``fastest`` (this layer's ``time`` choice, when the caller
    has it) is returned as it is when it is within that bound, which saves the second solve.
    ``index``: ``index_graph(gm)``, when the caller solves several layers of one graph;
    ``forward_passes``: 2 when every block recomputes in full (forward collectives count twice)."""
    if objective not in TP_OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(TP_OBJECTIVES)}, got {objective!r}")
    layers = (layer,) if isinstance(layer, int) else layer
    ctx = layer_context(
        gm, layers, t, cluster, dtype=dtype, sp=sp, index=index, forward_passes=forward_passes
    )
    ilp = LayerILP(ctx, "tp_layer_" + "_".join(map(str, layers)), memory_budget_bytes)
    within = "" if memory_budget_bytes is None else f" within {memory_budget_bytes / 2**20:,.1f} MiB"
    failure = f"no tensor-parallel layout of layer {layer} at tp {t}{within}"
    if objective == "memory":
        # bytes are ~1e6–1e10: in MiB the solver's tolerances neither swallow nor dominate them
        ilp.prob.setObjective(ilp.memory / 2**20)
        ilp.solve(time_limit_s, failure)
        least = pulp.value(ilp.memory)
        lean_enough = fastest is not None and fastest.memory_bytes <= least * (1 + LEAN_SLACK) + 1
        if lean_enough and memory_budget_bytes is None:
            assert fastest is not None
            return fastest  # the fastest layout is lean enough: it is also the answer
        ilp.prob += ilp.memory <= least * (1 + LEAN_SLACK) + 1, "leanest"
    # seconds are ~1e-6: scale the objective so the solver's tolerances don't swallow it
    ilp.prob.setObjective(1e6 * pulp.lpSum(ilp.cost))
    ilp.solve(time_limit_s, failure)
    solved = ilp.solution()
    held = sum(ilp.op_memory(n, solved[n.name]) for n in ctx.nodes)
    return price_layer(ctx, solved, held)


__all__ = ["LEAN_SLACK", "LayerILP", "choose_layer"]
