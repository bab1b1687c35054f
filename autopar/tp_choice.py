"""Choose a tensor-parallel strategy for every operator of a layer (Alpa-style intra-op ILP).

For one representative layer of each layer type (repeated layers are solved once),
every operator picks one strategy from ``passes.tp_rules.strategies``; every edge
pays for turning the producer's output placement into what the consumer needs.
Minimise Σ compute + Σ collectives (forward and backward), the formulation of
Zheng et al., "Alpa", OSDI'22, §4.1, solved with PuLP + HiGHS:

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

Resharding costs (bytes N of the full tensor, ring collectives of ``cost_models.comm``):

| producer → consumer | forward | backward |
|---|---|---|
| R → R, S(d) → S(d) | – | – |
| R → Rf (column-parallel input, Megatron ``f``) | – | all-reduce N, once per producer |
| S → R | all-gather N | – (slice) |
| S → Rf | all-gather N | reduce-scatter N |
| R → S | – (slice) | all-gather N |

A row-parallel linear all-reduces its own output (Megatron ``g``): all-reduce N forward (or,
under sequence parallelism, reduce-scatters it: forward, with an all-gather backward).
The ``memory`` objective first minimises Σ mem (M*), then time under Σ mem ≤ 1.01·M*: the
leanest layout, which the planner prices next to the fastest (``tp_layouts.TPLayouts``).

Megatron's block layout (column QKV and first MLP linear, heads-split attention,
row output and second MLP linear: one all-reduce per sub-block each way) is not
written anywhere here: it is what these costs select.
"""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import pulp
from torch import fx

from autopar.cluster import Cluster
from autopar.cost_models.comm import (
    GroupLink,
    allgather_time_s,
    allreduce_time_s,
    group_link,
    reduce_scatter_time_s,
)
from autopar.cost_models.memory import STATE_BYTES
from autopar.cost_models.strategy import TP_OBJECTIVES
from autopar.errors import AutoparError
from autopar.layout_ilp import stdout_silenced
from autopar.passes.tp_rules import (
    LINEAR_ARGS,
    RF,
    SHARDING,
    OpStrategy,
    R,
    boundary,
    fused_chunks,
    linear_parts,
    out_shape,
    partial_grad_params,
    shard_dim,
    strategies,
    stream_placement,
    tensor_args,
    vocab_parallel_output,
)
from autopar.tp_memory import (
    op_memory_bytes,
    param_owners,
    param_placement,
)

INFEASIBLE = float("inf")

LEAN_SLACK = 0.01
"""The leanest layout may hold 1% more than the least memory, for speed."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective the chosen strategies issue per layer per micro-batch."""

    kind: str
    """``all_reduce``, ``all_gather`` or ``reduce_scatter``."""
    phase: str
    """``forward`` or ``backward``."""
    size_bytes: int
    """Bytes of the full (unsharded) tensor."""
    at: str
    """The graph node it belongs to."""


@dataclass(frozen=True, kw_only=True)
class LayerTP:
    """The chosen strategy of every operator of one layer, and what it costs."""

    strategies: dict[str, OpStrategy]
    """Graph node name → chosen strategy."""
    modules: dict[str, str]
    """Owning module (full name, e.g. ``blocks.0.attn.c_attn``) → strategy name, for the operators
    whose strategy is in ``tp_rules.SHARDING``."""
    collectives: tuple[Collective, ...]
    time_s: float
    """Predicted compute + communication seconds of the layer (forward + backward)."""
    partial_grads: bool
    """Some replicated parameter meets a token shard: its gradient is a partial sum, all-reduced
    once per step (``step_collectives``)."""
    memory_bytes: float
    """What the layer holds on one rank under this choice (``tp_memory.op_memory_bytes``): model states
    of its parameters plus what its operators save for backward at the captured micro-batch."""


def _bytes(n: fx.Node) -> int:
    shape = out_shape(n)
    val = n.meta.get("val")
    item = (
        val[0].element_size() if isinstance(val, (list, tuple)) else getattr(val, "element_size", lambda: 4)()
    )
    return (1 if shape is None else _prod(shape)) * item


def _prod(xs: tuple[int, ...]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def reshard(
    src: str, dst: str, size_bytes: int, t: int, link: GroupLink, *, grad: bool = True
) -> tuple[float, list[tuple[str, str]]]:
    """Seconds and collectives (kind, phase) to turn placement ``src`` into ``dst`` (table above);
    ``grad`` False: the tensor needs no gradient (rotary tables, masks), so no backward part."""
    if src == dst or (src == R and dst == R):
        return 0.0, []
    if src == R and dst == RF:
        steps = [("all_reduce", "backward")]
    elif shard_dim(src) is not None and dst == R:
        steps = [("all_gather", "forward")]
    elif shard_dim(src) is not None and dst == RF:
        steps = [("all_gather", "forward"), ("reduce_scatter", "backward")]
    elif src == R and shard_dim(dst) is not None:
        steps = [("all_gather", "backward")]
    else:
        return INFEASIBLE, []
    steps = [st for st in steps if grad or st[1] == "forward"]
    return sum(_ring_s(kind, size_bytes, t, link) for kind, _ in steps), steps


LOSS = "(loss)"
"""``Collective.at`` of the vocabulary-parallel cross-entropy's reductions."""


def leave(
    n: fx.Node, out: str, to: str, t: int, link: GroupLink, *, grad: bool, final: bool
) -> tuple[float, list[Collective]]:
    """Seconds and collectives for a layer output in placement ``out`` to leave as ``to`` (the
    stream; R for the model's output). Logits split over the vocabulary stay split: torch's
    ``loss_parallel`` cross-entropy all-reduces 3 values per row forward (max, sum of exp,
    target logit; Megatron's vocab-parallel CE) and runs its backward locally, instead of an
    all-gather of every logit."""
    if final and vocab_parallel_output(n, out):
        rows = _prod(tuple(n.meta["autopar.shape"][:-1])) * 4  # fp32 per row
        c = Collective(kind="all_reduce", phase="forward", size_bytes=rows, at=LOSS)
        return 3 * _ring_s("all_reduce", rows, t, link), [c, c, c]
    c_s, kinds = reshard(out, to, _bytes(n), t, link, grad=grad)
    return c_s, [Collective(kind=k, phase=p, size_bytes=_bytes(n), at=n.name) for k, p in kinds]


def step_collectives(choices: list[LayerTP]) -> list[tuple[str, str]]:
    """Once per step: where a replicated parameter meets a token shard (a norm under sequence
    parallelism, a row-parallel bias added to a sequence shard) its gradient is a partial sum;
    the runtime all-reduces all of them over the TP group in one bucket. Priced at nothing per
    micro-batch in the ILP (a few kB once a step)."""
    return [("all_reduce", "step")] if any(c.partial_grads for c in choices) else []


def needs_grad(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose values need a gradient: those computed from a parameter."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}  # tied: every name
    found: set[str] = set()
    for n in gm.graph.nodes:
        if (n.op == "get_attr" and str(n.target) in params) or any(
            a.name in found for a in n.all_input_nodes
        ):
            found.add(n.name)
    return found


def _compute_s(n: fx.Node, cluster: Cluster, dtype: str) -> float:
    """Forward + backward roofline seconds of one operator (backward FLOPs as annotated)."""
    dev = cluster.device
    flops = n.meta.get("autopar.fwd_flops", 0) + n.meta.get("autopar.bwd_flops", 0)
    mem = 3 * n.meta.get("autopar.mem_bytes", 0)  # forward reads/writes once, backward about twice
    return flops / dev.achievable_flops(dtype) + mem / dev.hbm_bandwidth_bytes_per_s


def layer_nodes(gm: fx.GraphModule, layer: int) -> list[fx.Node]:
    """The operators of layer index ``layer`` that produce tensors, in graph order (metadata
    asserts, which return nothing, are left out)."""
    return [n for n in gm.graph.nodes if n.meta.get("autopar.layer") == layer and _produces_tensor(n)]


def _produces_tensor(n: fx.Node) -> bool:
    return n.op == "call_function" and out_shape(n) is not None and n.meta.get("val") is not None


@dataclass(frozen=True, kw_only=True)
class GraphIndex:
    """What every per-layer ILP of one graph reads, found in one pass over it (GPT-3 175B's graph
    has 3,566 nodes: scanning it for every ILP took about half as long as the solves)."""

    grads: frozenset[str]
    """``needs_grad`` of the graph."""
    layers: dict[int, tuple[fx.Node, ...]]
    """Layer index → ``layer_nodes`` of it."""


def index_graph(gm: fx.GraphModule) -> GraphIndex:
    """The ``GraphIndex`` of ``gm``."""
    layers: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        i = n.meta.get("autopar.layer")
        if i is not None and _produces_tensor(n):
            layers.setdefault(i, []).append(n)
    return GraphIndex(
        grads=frozenset(needs_grad(gm)), layers={i: tuple(nodes) for i, nodes in layers.items()}
    )


def op_keys(nodes: list[fx.Node], prefix: str) -> dict[str, str]:
    """Node name → a name that is the same in every layer of a type: ``module:op#k``, where module
    is the owning module relative to the layer (``prefix``), op the ATen operator and k counts
    earlier uses of that operator in that module (e.g. ``attn.c_attn:linear#0``, ``attn:view#2``)."""
    seen: dict[tuple[str, str], int] = {}
    keys = {}
    for n in nodes:
        module = str(n.meta.get("autopar.module", ""))
        rel = module[len(prefix) :].lstrip(".") if module.startswith(prefix) else module
        op = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        k = seen.get((rel, op), 0)
        seen[rel, op] = k + 1
        keys[n.name] = f"{rel}:{op}#{k}"
    return keys


def own_collectives(n: fx.Node, s: OpStrategy) -> list[Collective]:
    """Collectives an operator's strategy issues itself (not on its edges)."""
    found = []
    if s.reduce_output:  # row-parallel: all-reduce to R, or reduce-scatter over the sequence
        kind = "all_reduce" if s.out == R else "reduce_scatter"
        found.append(Collective(kind=kind, phase="forward", size_bytes=_bytes(n), at=n.name))
        if s.out != R:  # the reduce-scatter's backward gathers the gradient back
            found.append(Collective(kind="all_gather", phase="backward", size_bytes=_bytes(n), at=n.name))
    if s.name in ("column", "row") and n.target in LINEAR_ARGS:
        _, _, bias, _ = linear_parts(n)
        if isinstance(bias, fx.Node) and s.name == "column" and fused_chunks(n) > 1:
            # a fused bias stays replicated; its slices' gradients are all-gathered (tp_chunks)
            found.append(Collective(kind="all_gather", phase="backward", size_bytes=_bytes(bias), at=n.name))
    return found


def _ring_s(kind: str, size_bytes: int, t: int, link: GroupLink) -> float:
    """Seconds of one collective (ring alpha-beta, or the cluster's measured fit)."""
    if kind == "all_reduce":
        return allreduce_time_s(size_bytes, t, link)
    if kind == "reduce_scatter":
        return reduce_scatter_time_s(size_bytes, t, link)
    return allgather_time_s(size_bytes, t, link)


def _collective_s(c: Collective, t: int, link: GroupLink) -> float:
    return _ring_s(c.kind, c.size_bytes, t, link)


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
    ``index``: ``index_graph(gm)``, when the caller solves several layers of one graph."""
    if objective not in TP_OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(TP_OBJECTIVES)}, got {objective!r}")
    layers = (layer,) if isinstance(layer, int) else layer
    nodes = [n for i in layers for n in (index.layers.get(i, ()) if index else layer_nodes(gm, i))]
    inside = set(nodes)
    grads = index.grads if index else needs_grad(gm)
    outside, outputs = boundary(nodes, sp)
    stream = stream_placement(sp)
    final = {n.name for n in nodes if any(u.op == "output" for u in n.users)}  # the model's output
    link = group_link(cluster, size=t, stride=1)
    prob = pulp.LpProblem("tp_layer_" + "_".join(map(str, layers)), pulp.LpMinimize)
    options = {n: strategies(n, t) for n in nodes}
    x = {
        (n, i): pulp.LpVariable(f"x_{n.name}_{i}", cat="Binary")
        for n in nodes
        for i in range(len(options[n]))
    }
    cost: list[pulp.LpAffineExpression] = []
    per_param = sum(STATE_BYTES[dtype])
    owners = param_owners(nodes)
    memory = pulp.lpSum(
        op_memory_bytes(n, s, t, state_bytes_per_param=per_param, owners=owners) * x[n, i]
        for n in nodes
        for i, s in enumerate(options[n])
    )
    if memory_budget_bytes is not None:
        prob += memory <= memory_budget_bytes, "memory_budget"
    shared: dict[tuple[str, str, str], pulp.LpVariable] = {}

    def convert_once(key: tuple[str, str, str], c: float, active: pulp.LpAffineExpression, name: str) -> None:
        """One conversion per (tensor, from, to), shared by all its consumers, as the pass inserts
        it: for Megatron's f the consumers' partial gradients add up before the one all-reduce."""
        if key not in shared:
            shared[key] = pulp.LpVariable(f"conv_{len(shared)}", lowBound=0)
            cost.append(c * shared[key])
        prob.addConstraint(shared[key] >= active, name)

    for n in nodes:
        prob += pulp.lpSum(x[n, i] for i in range(len(options[n]))) == 1, f"one_strategy_{n.name}"
        base = _compute_s(n, cluster, dtype)
        for i, s in enumerate(options[n]):
            own = sum(_collective_s(c, t, link) for c in own_collectives(n, s))
            cost.append((base * s.compute_fraction + own) * x[n, i])
            # layer outputs become the residual stream the next layer expects (an operator that
            # can only run replicated, e.g. MoE routing, pays for the conversion)
            to = R if n.name in final else stream
            if n.name in outputs and s.out != to:
                c, _ = leave(n, s.out, to, t, link, grad=n.name in grads, final=n.name in final)
                if c == INFEASIBLE:
                    prob += x[n, i] == 0, f"output_stream_{n.name}_{i}"
                else:
                    cost.append(c * x[n, i])
    for v in nodes:
        for slot, u in enumerate(tensor_args(v)):
            size = _bytes(u)
            for b, sv in enumerate(options[v]):
                need = sv.inputs[slot] if slot < len(sv.inputs) else R
                pairs = (
                    [(None, outside[u.name])]
                    if u not in inside
                    else [(a, su.out) for a, su in enumerate(options[u])]
                )
                for a, have in pairs:
                    c, _ = reshard(have, need, size, t, link, grad=u.name in grads)
                    active = x[v, b] if a is None else x[u, a] + x[v, b] - 1
                    tag = f"{u.name}_{v.name}_{slot}_{a}_{b}"
                    if c == INFEASIBLE:
                        prob += active <= 0, f"no_reshard_{tag}"
                    elif c > 0:
                        convert_once((u.name, have, need), c, active, f"conv_{tag}")
    # a parameter read by several operators (a weight tied between embedding and head) has one
    # placement: the strategies chosen must agree on it
    readers: dict[str, list[tuple[fx.Node, int]]] = {}
    for n in nodes:
        for pos, arg in enumerate(n.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                readers.setdefault(str(arg.target), []).append((n, pos))
    tied = itertools.count()
    for users in readers.values():
        for (u, pu), (v, pv) in itertools.pairwise(users):
            for place in {param_placement(s, u, pu) for s in options[u]} | {
                param_placement(s, v, pv) for s in options[v]
            }:
                prob += (
                    pulp.lpSum(
                        x[u, i] for i, s in enumerate(options[u]) if param_placement(s, u, pu) == place
                    )
                    == pulp.lpSum(
                        x[v, i] for i, s in enumerate(options[v]) if param_placement(s, v, pv) == place
                    ),
                    f"tied_{next(tied)}",
                )
    within = "" if memory_budget_bytes is None else f" within {memory_budget_bytes / 2**20:,.1f} MiB"
    if objective == "memory":
        # bytes are ~1e6–1e10: in MiB the solver's tolerances neither swallow nor dominate them
        prob.setObjective(memory / 2**20)
        _solve(prob, time_limit_s, f"no tensor-parallel layout of layer {layer} at tp {t}{within}")
        least = pulp.value(memory)
        if (
            fastest is not None
            and memory_budget_bytes is None
            and fastest.memory_bytes <= least * (1 + LEAN_SLACK) + 1
        ):
            return fastest  # the fastest layout is lean enough: it is also the answer
        prob += memory <= least * (1 + LEAN_SLACK) + 1, "leanest"
    # seconds are ~1e-6: scale the objective so the solver's tolerances don't swallow it
    prob.setObjective(1e6 * pulp.lpSum(cost))
    _solve(prob, time_limit_s, f"no tensor-parallel layout of layer {layer} at tp {t}{within}")
    solved = {
        n.name: options[n][next(i for i in range(len(options[n])) if (x[n, i].value() or 0) > 0.5)]
        for n in nodes
    }
    held = sum(
        op_memory_bytes(n, solved[n.name], t, state_bytes_per_param=per_param, owners=owners) for n in nodes
    )
    return _summarise(nodes, solved, t, link, cluster, dtype, outside, grads, outputs, stream, final, held)


def _solve(prob: pulp.LpProblem, time_limit_s: float, failure: str) -> None:
    with stdout_silenced():  # HiGHS's banner would corrupt --json output
        prob.solve(pulp.HiGHS(msg=False, timeLimit=time_limit_s))
    if prob.sol_status not in (1, 2):
        raise AutoparError(f"{failure} (solver status {prob.status})")


def _summarise(
    nodes: list[fx.Node],
    chosen: dict[str, OpStrategy],
    t: int,
    link: GroupLink,
    cluster: Cluster,
    dtype: str,
    outside: dict[str, str],
    grads: AbstractSet[str],
    outputs: set[str],
    stream: str,
    final: set[str],
    memory_bytes: float,
) -> LayerTP:
    inside = {n.name for n in nodes}
    collectives: list[Collective] = []
    total = 0.0
    modules: dict[str, str] = {}
    copied: set[tuple[str, str]] = set()
    partial = False
    for n in nodes:
        s = chosen[n.name]
        total += _compute_s(n, cluster, dtype) * s.compute_fraction
        own = own_collectives(n, s)
        collectives += own
        total += sum(_collective_s(c, t, link) for c in own)
        if s.name in SHARDING:
            modules[str(n.meta.get("autopar.module", n.name))] = s.name
        partial = partial or bool(partial_grad_params(n, s))
        for slot, u in enumerate(tensor_args(n)):
            need = s.inputs[slot] if slot < len(s.inputs) else R
            src = chosen[u.name].out if u.name in inside else outside[u.name]
            if (u.name, need) in copied:
                continue  # one conversion per (tensor, placement): its consumers share it
            copied.add((u.name, need))
            c, kinds = reshard(src, need, _bytes(u), t, link, grad=u.name in grads)
            total += c
            collectives += [Collective(kind=k, phase=p, size_bytes=_bytes(u), at=n.name) for k, p in kinds]
        to = R if n.name in final else stream
        if n.name in outputs and s.out != to:  # converted for the next layer (or the model's output)
            c, more = leave(n, s.out, to, t, link, grad=n.name in grads, final=n.name in final)
            total += c
            collectives += more
    return LayerTP(
        strategies=chosen,
        modules=modules,
        collectives=tuple(collectives),
        time_s=total,
        partial_grads=partial,
        memory_bytes=memory_bytes,
    )


__all__ = [
    "LOSS",
    "Collective",
    "GraphIndex",
    "LayerTP",
    "choose_layer",
    "index_graph",
    "layer_nodes",
    "needs_grad",
    "op_keys",
    "reshard",
    "step_collectives",
]
