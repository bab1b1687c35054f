"""What a per-operator tensor-parallel strategy costs: compute, collectives and memory per rank.

The terms of the per-operator ILP (``planner/tp_ilp``) and the price of the layout it chooses
(``price_layer``), for an operator ``n`` under strategy ``s`` at TP degree t:

- compute: forward + backward roofline of ``n`` (``op_compute_s``) × ``s.compute_fraction``;
- its own collectives (``own_collectives``): a row-parallel linear all-reduces its output
  (Megatron ``g``), or, under sequence parallelism, reduce-scatters it forward and all-gathers
  the gradient backward; a fused column-parallel bias all-gathers its slices' gradients;
- placement changes on its inputs (``reshard``, bytes N of the full tensor, ring collectives
  of ``cost_models.comm``):

| producer → consumer | forward | backward |
|---|---|---|
| R → R, S(d) → S(d) | – | – |
| R → Rf (column-parallel input, Megatron ``f``) | – | all-reduce N, once per producer |
| S → R | all-gather N | all-gather N if kept, hidden (then slice) |
| S → Rf | all-gather N | all-gather N if kept, hidden; reduce-scatter N |
| R → S | – (slice) | all-gather N |

  (kept: a consumer saves the gathered tensor for backward, ``kept_for_backward``. It keeps this
  rank's shard instead and backward gathers it again, ``passes.tp_collectives.regather_saved``,
  Korthikanti et al. 2022 §4.2.2; a block recomputed in full gathers it again in its second
  forward instead. Hidden: behind the reader's input-gradient GEMM, as Megatron-LM schedules
  it (``terms.HIDDEN``): counted with the collectives, priced at no time.)

- memory (``op_memory_bytes``): model states of the parameters it owns (÷ t where split) plus
  the tensors it saves for backward.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from torch import fx

from autopar.cluster import Cluster
from autopar.cost_models.comm import (
    GroupLink,
    allgather_time_s,
    allreduce_time_s,
    group_link,
    reduce_scatter_time_s,
)
from autopar.cost_models.compute import FLASH_BACKWARD_RATIO
from autopar.cost_models.terms import HIDDEN
from autopar.graph.annotate import is_view
from autopar.graph.dispatch import fused_attention
from autopar.mesh import ParallelDims
from autopar.passes.tp_graph import GraphIndex, index_graph
from autopar.passes.tp_rules import (
    LINEAR_ARGS,
    RF,
    OpStrategy,
    R,
    boundary,
    fused_chunks,
    linear_parts,
    out_shape,
    partial_grad_params,
    shard_dim,
    stream_placement,
    tensor_args,
    vocab_parallel_output,
)
from autopar.strategy import SHARDING

INFEASIBLE = float("inf")
"""The price of a placement change no collective makes (between different shard dims)."""

LOSS = "(loss)"
"""``Collective.at`` of the vocabulary-parallel cross-entropy's reductions."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective the chosen strategies issue per layer per micro-batch."""

    kind: str
    """``all_reduce``, ``all_gather`` or ``reduce_scatter``."""
    phase: str
    """``forward``, ``backward``, or ``terms.HIDDEN`` (issued in backward behind compute: counted,
    priced at no time)."""
    size_bytes: int
    """Bytes of the full (unsharded) tensor."""
    at: str
    """The graph node it belongs to."""


def tensor_bytes(n: fx.Node) -> int:
    """Bytes of the node's (first) output tensor."""
    shape = out_shape(n)
    val = n.meta.get("val")
    item = (
        val[0].element_size() if isinstance(val, (list, tuple)) else getattr(val, "element_size", lambda: 4)()
    )
    return (1 if shape is None else math.prod(shape)) * item


def collective_time_s(kind: str, size_bytes: int, t: int, link: GroupLink) -> float:
    """Seconds of one collective over t ranks (ring alpha-beta, or the cluster's measured fit)."""
    if kind == "all_reduce":
        return allreduce_time_s(size_bytes, t, link)
    if kind == "reduce_scatter":
        return reduce_scatter_time_s(size_bytes, t, link)
    return allgather_time_s(size_bytes, t, link)


def _repeats(phase: str, forward_passes: int) -> int:
    """How many times a collective of ``phase`` is priced per micro-batch."""
    return {"forward": forward_passes, "backward": 1, HIDDEN: 0}[phase]


def collectives_s(collectives: list[Collective], t: int, link: GroupLink, forward_passes: int = 1) -> float:
    """Seconds of all of ``collectives`` one after the other, a forward one ``forward_passes``
    times (2 under full recompute: the recomputed forward issues its collectives again)."""
    return sum(
        collective_time_s(c.kind, c.size_bytes, t, link) * _repeats(c.phase, forward_passes)
        for c in collectives
    )


def kept_for_backward(u: fx.Node) -> bool:
    """Whether an operator reading ``u``, or a view of it, saves for backward a tensor of as many
    elements (its ``autopar.saved``; a linear saves its input viewed as (b·s, h)): gathered, it
    is gathered again there."""
    numel = math.prod(out_shape(u))
    readers, seen = list(u.users), set()
    while readers:  # through views (a no-op ``to``, a reshape): their readers save the same storage
        v = readers.pop()
        if v in seen:
            continue
        seen.add(v)
        if any(math.prod(sh) == numel for sh, _ in v.meta.get("autopar.saved", ())):
            return True
        if v.op == "call_function" and is_view(v):
            readers += v.users
    return False


def reshard(
    src: str,
    dst: str,
    size_bytes: int,
    t: int,
    link: GroupLink,
    *,
    grad: bool = True,
    forward_passes: int = 1,
    kept: bool = True,
) -> tuple[float, list[tuple[str, str]]]:
    """Seconds and collectives (kind, phase) to turn placement ``src`` into ``dst`` (table above);
    ``grad`` False: the tensor needs no gradient (rotary tables, masks), so no backward part;
    a forward collective counts ``forward_passes`` times (``collectives_s``); ``kept``: a consumer
    saves the tensor (``kept_for_backward``), so a gathered one is gathered again in backward."""
    if src == dst or (src == R and dst == R):
        return 0.0, []
    # a gathered tensor a consumer saves is gathered again in backward; the second forward of a
    # block recomputed in full has it instead
    again = [("all_gather", HIDDEN)] if kept and forward_passes == 1 else []
    if src == R and dst == RF:
        steps = [("all_reduce", "backward")]
    elif shard_dim(src) is not None and dst == R:
        steps = [("all_gather", "forward"), *again]
    elif shard_dim(src) is not None and dst == RF:
        steps = [("all_gather", "forward"), *again, ("reduce_scatter", "backward")]
    elif src == R and shard_dim(dst) is not None:
        steps = [("all_gather", "backward")]
    else:
        return INFEASIBLE, []
    steps = [st for st in steps if grad or st[1] == "forward"]
    return sum(
        collective_time_s(k, size_bytes, t, link) * _repeats(ph, forward_passes) for k, ph in steps
    ), steps


def leave(
    n: fx.Node,
    out: str,
    to: str,
    t: int,
    link: GroupLink,
    *,
    grad: bool,
    final: bool,
    forward_passes: int = 1,
) -> tuple[float, list[Collective]]:
    """Seconds and collectives for a layer output in placement ``out`` to leave as ``to`` (the
    stream; R for the model's output). Logits split over the vocabulary stay split: torch's
    ``loss_parallel`` cross-entropy all-reduces 3 values per row forward (max, sum of exp,
    target logit; Megatron's vocab-parallel CE) and runs its backward locally, instead of an
    all-gather of every logit."""
    if final and vocab_parallel_output(n, out):
        rows = math.prod(tuple(n.meta["autopar.shape"][:-1])) * 4  # fp32 per row
        c = Collective(kind="all_reduce", phase="forward", size_bytes=rows, at=LOSS)
        return 3 * collective_time_s("all_reduce", rows, t, link), [c, c, c]  # the loss: never recomputed
    c_s, kinds = reshard(
        out, to, tensor_bytes(n), t, link, grad=grad, forward_passes=forward_passes, kept=kept_for_backward(n)
    )
    return c_s, [Collective(kind=k, phase=p, size_bytes=tensor_bytes(n), at=n.name) for k, p in kinds]


def op_compute_s(n: fx.Node, cluster: Cluster, dtype: str) -> float:
    """Forward + backward roofline seconds of one operator (backward FLOPs as annotated)."""
    dev, attention = cluster.device, fused_attention(n)
    fwd = n.meta.get("autopar.fwd_flops", 0)
    executed = n.meta.get("autopar.kernel_flops", fwd) / fwd if fwd else 1.0  # causal attention: ~½
    bwd = fwd * FLASH_BACKWARD_RATIO if attention else n.meta.get("autopar.bwd_flops", 0)
    flops = (fwd + bwd) * executed
    mem = 3 * n.meta.get("autopar.mem_bytes", 0)  # forward reads/writes once, backward about twice
    return flops / dev.achievable_flops(dtype, attention=attention) + mem / dev.hbm_bandwidth_bytes_per_s


def own_collectives(n: fx.Node, s: OpStrategy) -> list[Collective]:
    """Collectives an operator's strategy issues itself (not on its edges)."""
    found = []
    if s.reduce_output:  # row-parallel: all-reduce to R, or reduce-scatter over the sequence
        kind = "all_reduce" if s.out == R else "reduce_scatter"
        found.append(Collective(kind=kind, phase="forward", size_bytes=tensor_bytes(n), at=n.name))
        if s.out != R:  # the reduce-scatter's backward gathers the gradient back
            found.append(
                Collective(kind="all_gather", phase="backward", size_bytes=tensor_bytes(n), at=n.name)
            )
    if s.name in ("column", "row") and n.target in LINEAR_ARGS:
        _, _, bias, _ = linear_parts(n)
        if isinstance(bias, fx.Node) and s.name == "column" and fused_chunks(n) > 1:
            # a fused bias stays replicated; its slices' gradients are all-gathered (tp_chunks)
            found.append(
                Collective(kind="all_gather", phase="backward", size_bytes=tensor_bytes(bias), at=n.name)
            )
    return found


def step_collectives(choices: list[LayerTP]) -> list[tuple[str, str]]:
    """Once per step: where a replicated parameter meets a token shard (a norm under sequence
    parallelism, a row-parallel bias added to a sequence shard) its gradient is a partial sum;
    the runtime all-reduces all of them over the TP group in one bucket. Priced at nothing per
    micro-batch in the ILP (a few kB once a step)."""
    return [("all_reduce", "step")] if any(c.partial_grads for c in choices) else []


# ---- memory --------------------------------------------------------------------------------


def param_placement(s: OpStrategy, n: fx.Node, pos: int) -> str:
    """Placement strategy ``s`` of node ``n`` gives the parameter at argument ``pos``."""
    if n.target in LINEAR_ARGS:
        _, wi, bi, _ = LINEAR_ARGS[n.target]
        role = "weight" if pos == wi else "bias" if pos == bi else ""
    else:
        role = "weight" if pos == 0 and s.name == "vocab" else ""
    return s.params.get(role, R)


def param_owners(nodes: list[fx.Node]) -> dict[tuple[str, int], fx.Node]:
    """(node, argument position) → the parameter's ``get_attr`` node, for the first reader of each
    parameter among ``nodes``: a weight read twice (tied embedding and head) is held, and
    counted, once."""
    found: dict[tuple[str, int], fx.Node] = {}
    seen: set[str] = set()
    for n in nodes:
        for pos, arg in enumerate(n.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) not in seen:
                seen.add(str(arg.target))
                found[n.name, pos] = arg
    return found


def param_numel(n: fx.Node) -> int:
    """Elements of the parameter ``get_attr`` node ``n`` reads."""
    return math.prod(tuple(n.meta.get("autopar.shape") or n.meta["val"].shape))


def param_split(s: OpStrategy, n: fx.Node, pos: int) -> bool:
    """Whether strategy ``s`` of node ``n`` splits the parameter at argument ``pos`` t ways."""
    return shard_dim(param_placement(s, n, pos)) is not None


def op_memory_bytes(
    n: fx.Node, s: OpStrategy, t: int, *, state_bytes_per_param: int, owners: dict[tuple[str, int], fx.Node]
) -> float:
    """Bytes one rank holds for operator ``n`` under strategy ``s``.

    Model states: each parameter ``n`` owns (``param_owners``) at ``state_bytes_per_param``
    (16: 16-bit weight and gradient, fp32 master, momentum and variance; ZeRO, SC'20 §3.1) ÷ t
    where ``s`` splits it. Saved activations (``autopar.saved``, at the captured micro-batch): a
    saved tensor shaped like an input or output the strategy splits counts ÷ t, one shaped like
    a replicated input or output counts whole (a column-parallel linear keeps its whole input),
    any other (softmax statistics) ÷ t where the operator's work is split."""
    state = 0.0
    for pos in range(len(n.args)):
        if (n.name, pos) in owners:
            split = param_split(s, n, pos)
            state += param_numel(owners[n.name, pos]) * state_bytes_per_param / (t if split else 1)
    placed = [(out_shape(n), s.out)] + [
        (out_shape(u), s.inputs[i] if i < len(s.inputs) else R) for i, u in enumerate(tensor_args(n))
    ]
    saved = 0.0
    for shape, nbytes in n.meta.get("autopar.saved", ()):
        places = [p for sh, p in placed if sh == tuple(shape)]
        split = any(shard_dim(p) is not None for p in places) if places else s.compute_fraction < 1
        saved += nbytes / (t if split else 1)
    return state + saved


# ---- a layer's price under one choice ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LayerContext:
    """What pricing one layer's operators needs besides their strategies."""

    nodes: tuple[fx.Node, ...]
    """The layer's operators (``tp_graph.layer_nodes``), in graph order."""
    t: int
    """TP degree."""
    link: GroupLink
    """The TP group's link (``comm.group_link`` of a TP axis of t ranks)."""
    cluster: Cluster
    dtype: str
    outside: dict[str, str]
    """Placement of each input from outside the layer (``tp_rules.boundary``)."""
    grads: AbstractSet[str]
    """Nodes whose values need a gradient (``tp_graph.needs_grad``)."""
    outputs: set[str]
    """The layer's outputs: they leave as the residual stream."""
    stream: str
    """Placement of the residual stream between layers."""
    final: set[str]
    """Outputs that are the model's output (they leave whole, or split over the vocabulary)."""
    forward_passes: int = 1
    """Forward passes per micro-batch: 2 when every block recomputes in full (its forward
    collectives are issued again in the backward, Korthikanti et al. 2022 §5), else 1."""


@dataclass(frozen=True, kw_only=True)
class LayerTP:
    """The chosen strategy of every operator of one layer, and what it costs."""

    strategies: dict[str, OpStrategy]
    """Graph node name → chosen strategy."""
    modules: dict[str, str]
    """Owning module (full name, e.g. ``blocks.0.attn.c_attn``) → strategy name, for the operators
    whose strategy is in ``SHARDING``."""
    collectives: tuple[Collective, ...]
    time_s: float
    """Predicted compute + communication seconds of the layer (forward + backward)."""
    partial_grads: bool
    """Some replicated parameter meets a token shard: its gradient is a partial sum, all-reduced
    once per step (``step_collectives``)."""
    memory_bytes: float
    """What the layer holds on one rank under this choice (``op_memory_bytes``): model states
    of its parameters plus what its operators save for backward at the captured micro-batch."""


def layer_context(
    gm: fx.GraphModule,
    layers: tuple[int, ...],
    t: int,
    cluster: Cluster,
    *,
    dtype: str,
    sp: bool,
    index: GraphIndex | None = None,
    forward_passes: int = 1,
) -> LayerContext:
    """The ``LayerContext`` of layer indices ``layers`` of ``gm`` (several: solved together) at
    TP degree t (``sp``: the residual stream enters and leaves split over the sequence;
    ``forward_passes``: 2 under full recompute)."""
    index = index or index_graph(gm)
    nodes = tuple(n for i in layers for n in index.layers.get(i, ()))
    outside, outputs = boundary(list(nodes), sp)
    return LayerContext(
        nodes=nodes,
        t=t,
        link=group_link(cluster, ParallelDims(tp=t).axis("tp")),
        cluster=cluster,
        dtype=dtype,
        outside=outside,
        grads=index.grads,
        outputs=outputs,
        stream=stream_placement(sp),
        final={n.name for n in nodes if any(u.op == "output" for u in n.users)},  # the model's output
        forward_passes=forward_passes,
    )


def price_layer(ctx: LayerContext, chosen: dict[str, OpStrategy], memory_bytes: float) -> LayerTP:
    """The compute and collectives of ``chosen`` (node name → strategy) on the layer of ``ctx``:
    the ILP's objective, term for term, at its solution (one conversion per tensor and
    placement, shared by its consumers, as the pass inserts it)."""
    inside = {n.name for n in ctx.nodes}
    collectives: list[Collective] = []
    total = 0.0
    modules: dict[str, str] = {}
    copied: set[tuple[str, str]] = set()
    for n in ctx.nodes:
        s = chosen[n.name]
        own = own_collectives(n, s)
        total += op_compute_s(n, ctx.cluster, ctx.dtype) * s.compute_fraction
        collectives += own
        total += collectives_s(own, ctx.t, ctx.link, ctx.forward_passes)
        if s.name in SHARDING:
            modules[str(n.meta.get("autopar.module", n.name))] = s.name
        for slot, u in enumerate(tensor_args(n)):
            need = s.inputs[slot] if slot < len(s.inputs) else R
            if (u.name, need) in copied:
                continue  # one conversion per (tensor, placement): its consumers share it
            copied.add((u.name, need))
            src = chosen[u.name].out if u.name in inside else ctx.outside[u.name]
            c, kinds = reshard(
                src,
                need,
                tensor_bytes(u),
                ctx.t,
                ctx.link,
                grad=u.name in ctx.grads,
                forward_passes=ctx.forward_passes,
                kept=kept_for_backward(u),
            )
            total += c
            collectives += [
                Collective(kind=k, phase=p, size_bytes=tensor_bytes(u), at=n.name) for k, p in kinds
            ]
        to = R if n.name in ctx.final else ctx.stream
        if n.name in ctx.outputs and s.out != to:  # converted for the next layer (or the model's output)
            c, more = leave(
                n,
                s.out,
                to,
                ctx.t,
                ctx.link,
                grad=n.name in ctx.grads,
                final=n.name in ctx.final,
                forward_passes=ctx.forward_passes,
            )
            total += c
            collectives += more
    return LayerTP(
        strategies=chosen,
        modules=modules,
        collectives=tuple(collectives),
        time_s=total,
        partial_grads=any(partial_grad_params(n, chosen[n.name]) for n in ctx.nodes),
        memory_bytes=memory_bytes,
    )


__all__ = [
    "INFEASIBLE",
    "LOSS",
    "Collective",
    "LayerContext",
    "LayerTP",
    "collective_time_s",
    "collectives_s",
    "kept_for_backward",
    "layer_context",
    "leave",
    "op_compute_s",
    "op_memory_bytes",
    "own_collectives",
    "param_numel",
    "param_owners",
    "param_placement",
    "param_split",
    "price_layer",
    "reshard",
    "step_collectives",
    "tensor_bytes",
]
