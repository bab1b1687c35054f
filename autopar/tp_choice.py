"""Choose a tensor-parallel strategy for every operator of a layer (Alpa-style intra-op ILP).

For one representative layer of each layer type (repeated layers are solved once),
every operator picks one strategy from ``passes.tp_rules.strategies``; every edge
pays for turning the producer's output placement into what the consumer needs.
Minimise Σ compute + Σ collectives (forward and backward), the formulation of
Zheng et al., "Alpa", OSDI'22, §4.1, solved with PuLP + HiGHS:

    min  Σ_v Σ_s x[v,s]·(compute(v)·frac(s) + own_comm(v,s))
       + Σ_(u→v) Σ_(a,b) y[u,v,a,b]·reshard(out(a) → in_v(b))
    s.t. Σ_s x[v,s] = 1                           (one strategy per operator)
         y[u,v,a,b] ≥ x[u,a] + x[v,b] − 1         (edge cost is paid when both are chosen)
         x[u,a] + x[v,b] ≤ 1  where reshard = ∞   (no all-to-all between different shard dims)
         layer inputs and outputs are replicated  (layers compose; no sequence parallelism here)

Resharding costs (bytes N of the full tensor, ring collectives of ``cost_models.comm``):

| producer → consumer | forward | backward |
|---|---|---|
| R → R, S(d) → S(d) | – | – |
| R → Rf (column-parallel input, Megatron ``f``) | – | all-reduce N, once per producer |
| S → R | all-gather N | – (slice) |
| S → Rf | all-gather N | reduce-scatter N |
| R → S | – (slice) | all-gather N |

A row-parallel linear all-reduces its own output (Megatron ``g``): all-reduce N forward.
Megatron's block layout (column QKV and first MLP linear, heads-split attention,
row output and second MLP linear: one all-reduce per sub-block each way) is not
written anywhere here: it is what these costs select.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulp
from torch import fx

from autopar.cluster import Cluster
from autopar.cost_models.comm import GroupLink, allgather_time_s, allreduce_time_s, group_link
from autopar.errors import AutoparError
from autopar.passes.tp_rules import (
    RF,
    OpStrategy,
    R,
    fused_chunks,
    is_deciding,
    out_shape,
    propagate,
    shard_dim,
    strategies,
    tensor_args,
)

INFEASIBLE = float("inf")


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
    """Owning module (relative to the layer) → strategy name, for the sharded operators."""
    collectives: tuple[Collective, ...]
    time_s: float
    """Predicted compute + communication seconds of the layer (forward + backward)."""


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
    src: str, dst: str, size_bytes: int, t: int, link: GroupLink
) -> tuple[float, list[tuple[str, str]]]:
    """Seconds and collectives (kind, phase) to turn placement ``src`` into ``dst`` (table above)."""
    if src == dst or (src == R and dst == R):
        return 0.0, []
    ar = allreduce_time_s(size_bytes, t, link)
    ag = allgather_time_s(size_bytes, t, link)
    if src == R and dst == RF:
        return ar, [("all_reduce", "backward")]
    if shard_dim(src) is not None and dst == R:
        return ag, [("all_gather", "forward")]
    if shard_dim(src) is not None and dst == RF:
        return 2 * ag, [("all_gather", "forward"), ("reduce_scatter", "backward")]
    if src == R and shard_dim(dst) is not None:
        return ag, [("all_gather", "backward")]
    return INFEASIBLE, []


def _compute_s(n: fx.Node, cluster: Cluster, dtype: str) -> float:
    """Forward + backward roofline seconds of one operator (backward FLOPs as annotated)."""
    dev = cluster.device
    flops = n.meta.get("autopar.fwd_flops", 0) + n.meta.get("autopar.bwd_flops", 0)
    mem = 3 * n.meta.get("autopar.mem_bytes", 0)  # forward reads/writes once, backward about twice
    return flops / dev.achievable_flops(dtype) + mem / dev.hbm_bandwidth_bytes_per_s


def layer_nodes(gm: fx.GraphModule, layer: int) -> list[fx.Node]:
    """The operators of layer index ``layer`` that produce tensors, in graph order."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.meta.get("autopar.layer") == layer and out_shape(n) is not None
    ]


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


def choose_layer(
    gm: fx.GraphModule, layer: int, t: int, cluster: Cluster, *, dtype: str, time_limit_s: float = 10.0
) -> LayerTP:
    """Solve the ILP above for the operators of layer index ``layer`` at TP degree ``t``."""
    nodes = layer_nodes(gm, layer)
    inside = set(nodes)
    link = group_link(cluster, size=t, stride=1)
    prob = pulp.LpProblem(f"tp_layer_{layer}", pulp.LpMinimize)
    options = {n: strategies(n, t) for n in nodes}
    x = {
        (n, i): pulp.LpVariable(f"x_{n.name}_{i}", cat="Binary")
        for n in nodes
        for i in range(len(options[n]))
    }
    cost: list[pulp.LpAffineExpression] = []
    f_var: dict[fx.Node, pulp.LpVariable] = {}
    for n in nodes:
        prob += pulp.lpSum(x[n, i] for i in range(len(options[n]))) == 1, f"one_strategy_{n.name}"
        base = _compute_s(n, cluster, dtype)
        for i, s in enumerate(options[n]):
            own = allreduce_time_s(_bytes(n), t, link) if s.reduce_output else 0.0
            cost.append((base * s.compute_fraction + own) * x[n, i])
            # layer outputs must leave replicated: the next layer expects the residual stream whole
            if s.out != R and any(u not in inside for u in n.users if u.op != "output") | any(
                u.op == "output" for u in n.users
            ):
                prob += x[n, i] == 0, f"output_replicated_{n.name}_{i}"
    for v in nodes:
        for slot, u in enumerate(tensor_args(v)):
            size = _bytes(u)
            for b, sv in enumerate(options[v]):
                need = sv.inputs[slot] if slot < len(sv.inputs) else R
                if u not in inside:  # from outside the layer: replicated
                    c, _ = reshard(R, need, size, t, link)
                    if need == RF:
                        if u not in f_var:
                            f_var[u] = pulp.LpVariable(f"f_{u.name}", lowBound=0)
                            cost.append(c * f_var[u])
                        prob += f_var[u] >= x[v, b], f"f_{u.name}_{v.name}_{slot}_{b}"
                        continue
                    if c == INFEASIBLE:
                        prob += x[v, b] == 0, f"outside_{v.name}_{slot}_{b}"
                    elif c:
                        cost.append(c * x[v, b])
                    continue
                for a, su in enumerate(options[u]):
                    c, _ = reshard(su.out, need, size, t, link)
                    if su.out == R and need == RF:
                        # Megatron f: the partial gradients of all column-parallel consumers
                        # add up locally first; one all-reduce per producer, however many consumers
                        if u not in f_var:
                            f_var[u] = pulp.LpVariable(f"f_{u.name}", lowBound=0)
                            cost.append(c * f_var[u])
                        prob += f_var[u] >= x[u, a] + x[v, b] - 1, f"f_{u.name}_{v.name}_{slot}_{a}_{b}"
                        continue
                    if c == INFEASIBLE:
                        prob += x[u, a] + x[v, b] <= 1, f"no_reshard_{u.name}_{v.name}_{slot}_{a}_{b}"
                    elif c > 0:
                        y = pulp.LpVariable(f"y_{u.name}_{v.name}_{slot}_{a}_{b}", lowBound=0)
                        prob += y >= x[u, a] + x[v, b] - 1, f"edge_{u.name}_{v.name}_{slot}_{a}_{b}"
                        cost.append(c * y)
    # seconds are ~1e-6: scale the objective so the solver's tolerances don't swallow it
    prob += 1e6 * pulp.lpSum(cost)
    prob.solve(pulp.HiGHS(msg=False, timeLimit=time_limit_s))
    if prob.sol_status not in (1, 2):
        raise AutoparError(f"no tensor-parallel layout of layer {layer} at tp {t} (status {prob.status})")
    solved = {
        n.name: options[n][next(i for i in range(len(options[n])) if (x[n, i].value() or 0) > 0.5)]
        for n in nodes
    }
    # what runs: the deciding operators as solved, the rest propagated (usually identical to the
    # solution; where not, the summary prices what will actually execute)
    chosen = propagate(nodes, {k: v for k, v in solved.items() if is_deciding(_by_name(nodes, k))}, t)
    return _summarise(gm, nodes, chosen, t, link, cluster, dtype)


def _by_name(nodes: list[fx.Node], name: str) -> fx.Node:
    return next(n for n in nodes if n.name == name)


def _summarise(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    chosen: dict[str, OpStrategy],
    t: int,
    link: GroupLink,
    cluster: Cluster,
    dtype: str,
) -> LayerTP:
    inside = {n.name for n in nodes}
    collectives: list[Collective] = []
    total = 0.0
    modules: dict[str, str] = {}
    copied: set[str] = set()
    for n in nodes:
        s = chosen[n.name]
        total += _compute_s(n, cluster, dtype) * s.compute_fraction
        if s.reduce_output:
            collectives.append(
                Collective(kind="all_reduce", phase="forward", size_bytes=_bytes(n), at=n.name)
            )
            total += allreduce_time_s(_bytes(n), t, link)
        if s.name in ("column", "row", "heads"):
            modules[str(n.meta.get("autopar.module", n.name))] = s.name
        bias = n.args[2] if len(n.args) > 2 else None
        if s.name == "column" and isinstance(bias, fx.Node) and fused_chunks(n) > 1:
            # a fused bias stays replicated; its slices' gradients are all-gathered (tp_chunks)
            size = _bytes(bias) if bias.meta.get("val") is not None else 0
            collectives.append(Collective(kind="all_gather", phase="backward", size_bytes=size, at=n.name))
            total += allgather_time_s(size, t, link)
        for slot, u in enumerate(tensor_args(n)):
            need = s.inputs[slot] if slot < len(s.inputs) else R
            src = chosen[u.name].out if u.name in inside else R
            if src == R and need == RF:
                if u.name in copied:
                    continue  # one f per producer: the consumers share it
                copied.add(u.name)
            c, kinds = reshard(src, need, _bytes(u), t, link)
            total += c
            collectives += [Collective(kind=k, phase=p, size_bytes=_bytes(u), at=n.name) for k, p in kinds]
    return LayerTP(strategies=chosen, modules=modules, collectives=tuple(collectives), time_s=total)


def plan_table(
    gm: fx.GraphModule, layer: int, prefix: str, choice: LayerTP
) -> tuple[tuple[str, str, str], ...]:
    """The deciding operators' non-replicated choices as (op key, strategy, output placement) for
    the Plan; the other operators' placements follow from these (``tp_rules.propagate``)."""
    nodes = layer_nodes(gm, layer)
    keys = op_keys(nodes, prefix)
    return tuple(
        (keys[n.name], choice.strategies[n.name].name, choice.strategies[n.name].out)
        for n in nodes
        if is_deciding(n) and choice.strategies[n.name].name != "replicate"
    )


__all__ = ["Collective", "LayerTP", "choose_layer", "layer_nodes", "op_keys", "plan_table", "reshard"]
