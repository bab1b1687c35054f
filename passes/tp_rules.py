"""Tensor-parallel sharding rules: how each operator kind may be split over the TP axis.

A tensor on the TP axis is in one of three placements:

- ``R``   replicated: every rank holds the whole tensor;
- ``S(d)`` sharded on dim d: rank r holds the r-th of t equal slices;
- ``Rf``  (an *input* requirement only) replicated, consumed by an operator whose
  weights are sharded, so the gradient flowing back is a partial sum that must be
  all-reduced — Megatron's ``f`` operator (Shoeybi et al. 2019, §3, Fig. 3).

``RULES`` maps each ATen operator to a rule kind; ``strategies(node, t)`` lists, for
one graph node, every (output placement → input placements) choice its rule allows,
with the fraction of the compute each rank does and the collective the operator
itself issues. Which ops are sharded and how is the planner's choice
(``autopar.planner.tp_ilp``); the rewriting pass (``passes.tensor_parallel``) applies it.
Unknown operators get the safe ``replicate`` rule: they still run, unsharded.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

R, RF = "R", "Rf"


def S(dim: int) -> str:
    """The placement 'sharded on dim ``dim``' (dims counted from 0)."""
    return f"S{dim}"


def shard_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


@dataclass(frozen=True, kw_only=True)
class OpStrategy:
    """One way to run one operator on the TP axis."""

    name: str
    """``replicate``, ``column``, ``row``, ``heads``, ``follow`` …: shown in plans."""
    out: str
    """Placement of the output (for tuple outputs: of every element)."""
    inputs: tuple[str, ...]
    """Required placement of each tensor argument, in the order of ``tensor_args``."""
    compute_fraction: float
    """Share of the operator's FLOPs and bytes each rank does: 1 or 1/t."""
    reduce_output: bool = False
    """The operator reduces its partial output itself: all-reduce to ``R`` (row-parallel linear), or
    reduce-scatter to ``S(1)`` (row-parallel under sequence parallelism)."""
    reduce_param_grads: bool = False
    """The operator runs on a token shard with replicated parameters (a norm under sequence
    parallelism): their gradients are partial sums, all-reduced over the TP group once per step."""
    params: dict[str, str] = field(default_factory=dict)
    """Placement of each parameter argument (``weight``/``bias``) when sharded."""


RULES: dict[Any, str] = {
    aten.linear.default: "linear",
    aten.addmm.default: "linear",  # Conv1D (Hugging Face GPT-2): addmm(bias, x, W) with W (in, out)
    aten.embedding.default: "embedding",
    aten.scaled_dot_product_attention.default: "attention",
    aten.matmul.default: "batched_matmul",
    aten.bmm.default: "batched_matmul",
    aten.softmax.int: "reduce_last",
    aten._softmax.default: "reduce_last",
    aten.layer_norm.default: "reduce_last",
    aten.rms_norm.default: "reduce_last",
    aten.mean.dim: "reduce_last",
    # elementwise and shape operators follow their input's sharding
    **{
        op: "follow"
        for op in (
            aten.view.default,
            aten.reshape.default,
            aten._unsafe_view.default,
            aten.transpose.int,
            aten.permute.default,
            aten.contiguous.default,
            aten.clone.default,
            aten.split.Tensor,
            aten.split_with_sizes.default,
            aten.chunk.default,
            aten.unsqueeze.default,
            aten.expand.default,
            aten.slice.Tensor,
            aten.cat.default,
            aten.neg.default,
            aten.gelu.default,
            aten.silu.default,
            aten.relu.default,
            aten.tanh.default,
            aten.pow.Tensor_Scalar,
            aten.rsqrt.default,
            aten.dropout.default,
            aten.add.Tensor,
            aten.sub.Tensor,
            aten.mul.Tensor,
            aten.div.Tensor,
            aten.to.dtype,
            aten._to_copy.default,
            aten.type_as.default,
            operator.getitem,
        )
    },
}
"""ATen operator → rule kind. Anything missing runs replicated."""


RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs (graph nodes with a shape), in argument order, flattening lists."""
    out: list[fx.Node] = []
    for a in node.args:
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(x, fx.Node) and x.op != "get_attr" and _shape(x) is not None:
                out.append(x)
    return out


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    s = n.meta.get("autopar.shape")
    if isinstance(s, tuple) and all(isinstance(d, int) for d in s):
        return s
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def out_shape(n: fx.Node) -> tuple[int, ...] | None:
    """Shape of the node's (first) output."""
    val = n.meta.get("val")
    if isinstance(val, (list, tuple)) and val and isinstance(val[0], torch.Tensor):
        return tuple(val[0].shape)
    return _shape(n)


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Dims of ``src`` that land whole at the front of a dim group of ``dst`` under a reshape.

    Both shapes are cut into groups with equal element counts; the first dim of a src group
    maps to the first dim of the matching dst group (sharding the leading dim of a group
    shards the leading dim of its reshaped form, e.g. (B,T,C) → (B,T,heads,head_dim) maps
    C → heads). Size-1 dims are skipped."""
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    return mapping
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return mapping
                gj.append(j)
                b *= dst[j]
        first_i = next((k for k in gi if src[k] != 1), None)
        first_j = next((k for k in gj if dst[k] != 1), None)
        if first_i is not None and first_j is not None:
            mapping[first_i] = first_j
        i += 1
        j += 1
    return mapping


def _in_dim_for(node: fx.Node, src: fx.Node, out_dim: int) -> int | None:
    """The dim of input ``src`` that becomes output dim ``out_dim`` (None: no single dim does)."""
    target = node.target
    ins, outs = _shape(src), out_shape(node)
    if ins is None or outs is None:
        return None
    if target in RESHAPES:
        inverse = {v: k for k, v in view_dim_map(ins, outs).items()}
        return inverse.get(out_dim)
    if target == aten.transpose.int:
        d0, d1 = (int(x) % len(ins) for x in node.args[1:3])  # type: ignore[call-overload]
        return d1 if out_dim == d0 else d0 if out_dim == d1 else out_dim
    if target == aten.permute.default:
        return int(node.args[1][out_dim])  # type: ignore[index]
    if target == aten.unsqueeze.default:
        d = int(node.args[1]) % len(outs)  # type: ignore[call-overload]
        return None if out_dim == d else out_dim - (out_dim > d)
    if target == aten.expand.default:
        return None if ins[out_dim - (len(outs) - len(ins))] == 1 else out_dim - (len(outs) - len(ins))
    # elementwise with broadcasting: align from the right
    lead = len(outs) - len(ins)
    k = out_dim - lead
    if k < 0 or ins[k] == 1:
        return -1  # broadcast along the sharded dim: this input stays replicated
    return k


def cut_dim(node: fx.Node) -> int | None:
    """The dim an operator slices or concatenates along (split, slice, cat); else None."""
    if node.target in (
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.chunk.default,
        aten.slice.Tensor,
        aten.cat.default,
    ):
        if node.target == aten.cat.default or node.target == aten.slice.Tensor:
            dim = node.args[1] if len(node.args) > 1 else 0
        else:
            dim = node.args[2] if len(node.args) > 2 else 0
        shape = out_shape(node)
        return int(dim) % len(shape) if shape is not None else None  # type: ignore[call-overload]
    return None


LINEAR_ARGS = {aten.linear.default: (0, 1, 2, False), aten.addmm.default: (1, 2, 0, True)}
"""Operator → (input index, weight index, bias index, weight stored (in, out))."""


def linear_parts(node: fx.Node) -> tuple[Any, Any, Any, bool]:
    """(input, weight, bias or None, weight is (in, out)) of a linear-kind node."""
    xi, wi, bi, transposed = LINEAR_ARGS[node.target]
    args = list(node.args) + [None] * 3
    return args[xi], args[wi], args[bi], transposed


def _feature_source(node: fx.Node) -> fx.Node | None:
    """Walk back from ``node`` through reshapes that keep the last dim to a linear-kind node."""
    src = node
    while isinstance(src, fx.Node) and src.target in RESHAPES:
        prev = src.args[0]
        if not isinstance(prev, fx.Node) or (out_shape(prev) or (0,))[-1] != (out_shape(src) or (1,))[-1]:
            return None
        src = prev
    return src if isinstance(src, fx.Node) and src.target in LINEAR_ARGS else None


def _splits_fused_linear(node: fx.Node) -> bool:
    """``linear → split`` along the output features (fused QKV): each chunk can be column-sharded
    when the weight is sharded chunk-wise (``_StridedShard``), as Megatron lays out fused QKV."""
    src = node.args[0]
    return (
        node.target in (aten.split.Tensor, aten.split_with_sizes.default)
        and isinstance(src, fx.Node)
        and _feature_source(src) is not None
    )


def fused_chunks(node: fx.Node) -> int:
    """How many equal chunks a linear's output is split into along its features (1: not split),
    looking through reshapes that keep the feature dim (Conv1D's view back to (B, T, 3h))."""
    frontier = [node]
    while frontier:
        cur = frontier.pop()
        for u in cur.users:
            if u.target == aten.split.Tensor and u.args[0] is cur:
                dim = int(u.args[2]) if len(u.args) > 2 else 0  # type: ignore[call-overload]
                width = (out_shape(cur) or (0,))[-1]
                if dim in (-1, len(out_shape(cur) or ()) - 1):
                    return width // int(u.args[1])  # type: ignore[call-overload]
            elif u.target in RESHAPES and _feature_source(u) is node:
                frontier.append(u)
    return 1


def strategies(node: fx.Node, t: int) -> list[OpStrategy]:
    """Every way ``node`` may run on a TP axis of size ``t`` (always includes ``replicate``)."""
    ins = tensor_args(node)
    shape = out_shape(node)
    replicate = OpStrategy(name="replicate", out=R, inputs=tuple(R for _ in ins), compute_fraction=1.0)
    kind = RULES.get(node.target, "replicate")
    if shape is None or t == 1:
        return [replicate]
    sharded = [d for d, n in enumerate(shape) if n % t == 0 and n >= t]
    found = [replicate]
    if kind == "linear":
        found.extend(_linear_strategies(node, shape, t))
    elif kind == "embedding":
        found.extend(_vocab_strategies(node, ins, shape, t))
    elif kind == "attention":
        found.extend(_heads_strategies(ins, shape, t))
    elif kind == "batched_matmul":
        found.extend(_batched_matmul_strategies(ins, shape, sharded, t))
    elif kind in ("follow", "reduce_last"):
        found.extend(_follow_strategies(node, kind, ins, shape, sharded, t))
    return found


def _linear_strategies(node: fx.Node, shape: tuple[int, ...], t: int) -> list[OpStrategy]:
    """Column- and row-parallel ways to run a linear-kind node (Megatron's split of an MLP)."""
    found: list[OpStrategy] = []
    _, w, _, transposed = linear_parts(node)
    wshape = _shape(w) if isinstance(w, fx.Node) else None
    if wshape is None:
        return found
    out_dim, in_dim = (1, 0) if transposed else (0, 1)  # weight dims of output / input features
    if wshape[out_dim] % t == 0:  # column: output features split, input replicated (grad all-reduced)
        found.append(
            OpStrategy(
                name="column",
                out=S(len(shape) - 1),
                inputs=(RF,),
                compute_fraction=1 / t,
                params={"weight": S(out_dim), "bias": "S0"},
            )
        )
    if wshape[in_dim] % t == 0:  # row: input features split, partial outputs all-reduced …
        for out in (R, S(1)) if len(shape) == 3 and shape[1] % t == 0 else (R,):
            found.append(  # … or reduce-scattered over the sequence (sequence parallelism)
                OpStrategy(
                    name="row",
                    out=out,
                    inputs=(S(len(shape) - 1),),
                    compute_fraction=1 / t,
                    reduce_output=True,
                    params={"weight": S(in_dim), "bias": "R"},
                )
            )
    return found


def _vocab_strategies(node: fx.Node, ins: list[fx.Node], shape: tuple[int, ...], t: int) -> list[OpStrategy]:
    """Vocabulary-parallel embedding: each rank looks up its rows, the rest are 0."""
    found: list[OpStrategy] = []
    w = node.args[0]
    wshape = _shape(w) if isinstance(w, fx.Node) else None
    if wshape is not None and wshape[0] % t == 0:
        outs = (R, S(1)) if len(shape) == 3 and shape[1] % t == 0 else (R,)
        for out in outs:  # partial rows all-reduced, or reduce-scattered over the sequence
            found.append(
                OpStrategy(
                    name="vocab",
                    out=out,
                    inputs=tuple(R for _ in ins),
                    compute_fraction=1 / t,
                    reduce_output=True,
                    params={"weight": "S0"},
                )
            )
    return found


def _heads_strategies(ins: list[fx.Node], shape: tuple[int, ...], t: int) -> list[OpStrategy]:
    """Attention over (B, heads, T, head_dim) with the heads split; q, k and v all need it."""
    if all(_shape(a) is not None and _shape(a)[1] % t == 0 for a in ins[:3]) and shape[1] % t == 0:  # type: ignore[index]
        # an attention mask broadcast over heads (size 1 there) stays replicated
        mask = tuple(
            R if (_shape(a) or (1, 1))[1] == 1 or len(_shape(a) or ()) < 4 else S(1) for a in ins[3:]
        )
        return [OpStrategy(name="heads", out=S(1), inputs=(S(1),) * 3 + mask, compute_fraction=1 / t)]
    return []


def _batched_matmul_strategies(
    ins: list[fx.Node], shape: tuple[int, ...], sharded: list[int], t: int
) -> list[OpStrategy]:
    """A batched matmul with a batch dim split on both operands."""
    return [
        OpStrategy(name="follow", out=S(d), inputs=(S(d),) * len(ins), compute_fraction=1 / t)
        for d in sharded
        if d < len(shape) - 2
    ]


def _follow_strategies(
    node: fx.Node, kind: str, ins: list[fx.Node], shape: tuple[int, ...], sharded: list[int], t: int
) -> list[OpStrategy]:
    """An elementwise, shape or last-dim-reducing operator sharded on each dim it allows."""
    found: list[OpStrategy] = []
    for d in sharded:
        if kind == "reduce_last" and d == len(shape) - 1:
            continue  # a reduction over the sharded dim would need the whole dim
        if d == cut_dim(node) and not _splits_fused_linear(node):
            continue
        need = _follow_inputs(node, ins, d, t)
        if need is None:
            continue
        # replicated parameters must broadcast along the sharded dim (a norm's weight
        # does along the sequence, not along the features)
        params = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        if any(_in_dim_for(node, p, d) not in (-1, None) for p in params):
            continue
        if all(p != R for p in need[:1]):  # the main input carries the sharding
            found.append(
                OpStrategy(
                    name="follow",
                    out=S(d),
                    inputs=tuple(need),
                    compute_fraction=1 / t,
                    reduce_param_grads=bool(params),
                )
            )
    return found


def _follow_inputs(node: fx.Node, ins: list[fx.Node], d: int, t: int) -> list[str] | None:
    """Placement each input needs for ``node``'s output to be sharded on dim ``d`` (None: some
    input can't follow)."""
    need: list[str] = []
    for a in ins:
        k, in_shape = _in_dim_for(node, a, d), _shape(a)
        if k is None or (k >= 0 and in_shape is not None and in_shape[k] % t):
            return None  # no such input dim, or it does not split t ways (2 KV heads at tp 4)
        need.append(R if k == -1 else S(k))
    return need


def stream_placement(sp: bool) -> str:
    """Placement of the residual stream between layers: whole, or split over the sequence
    (Megatron sequence parallelism, Korthikanti et al. 2022, §4.2.2)."""
    return S(1) if sp else R


def boundary(nodes: list[fx.Node], sp: bool) -> tuple[dict[str, str], set[str]]:
    """(placement of each input from outside the layer, names of the layer's outputs).

    Inputs shaped like the layer's output are the residual stream (``stream_placement``);
    other outside inputs (rotary tables, masks) are replicated."""
    inside = {n.name for n in nodes}
    outputs = {n.name for n in nodes if any(u.name not in inside for u in n.users)}
    shapes = {out_shape(n) for n in nodes if n.name in outputs}
    placements = {}
    for n in nodes:
        for a in tensor_args(n):
            if a.name not in inside:
                placements[a.name] = stream_placement(sp) if out_shape(a) in shapes else R
    return placements, outputs


def propagate(
    nodes: list[fx.Node], decided: dict[str, OpStrategy], t: int, *, sp: bool = False
) -> dict[str, OpStrategy]:
    """Complete ``decided`` (the strategies a plan names) to every node of ``nodes``: any other
    operator takes the strategy whose input placements equal what its inputs already are (no
    collective), else runs replicated (its inputs are gathered)."""
    inside = {n.name for n in nodes}
    outside, _ = boundary(nodes, sp)
    out: dict[str, OpStrategy] = {}
    for n in nodes:
        if n.name in decided:
            out[n.name] = decided[n.name]
            continue
        have = tuple(out[a.name].out if a.name in inside else outside[a.name] for a in tensor_args(n))
        options = strategies(n, t)
        match = [s for s in options if s.inputs == have]
        out[n.name] = next((s for s in match if s.name != "replicate"), options[0] if not match else match[0])
    return out


def partial_grad_params(node: fx.Node, s: OpStrategy) -> list[fx.Node]:
    """The replicated parameters strategy ``s`` applies to a token shard, so that each rank's
    gradient of them is a partial sum (all-reduced over the TP group once per step): every
    parameter of an operator that runs on a shard with ``reduce_param_grads`` (a norm under
    sequence parallelism), and the bias of a row-parallel linear whose output is split over the
    sequence."""
    if s.reduce_param_grads:
        return [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    if s.name == "row" and node.target in LINEAR_ARGS and shard_dim(s.out) is not None:
        bias = linear_parts(node)[2]
        return [bias] if isinstance(bias, fx.Node) else []
    return []


def vocab_parallel_output(n: fx.Node, out: str) -> bool:
    """Whether the model output ``n`` (logits) leaves split over its last dim (the vocabulary):
    the loss is then computed vocab-parallel instead of gathering the logits."""
    shape = n.meta.get("autopar.shape", ())
    return len(shape) >= 2 and shard_dim(out) == len(shape) - 1


__all__ = [
    "LINEAR_ARGS",
    "RESHAPES",
    "RF",
    "RULES",
    "OpStrategy",
    "R",
    "S",
    "boundary",
    "cut_dim",
    "fused_chunks",
    "linear_parts",
    "partial_grad_params",
    "propagate",
    "shard_dim",
    "strategies",
    "stream_placement",
    "tensor_args",
    "view_dim_map",
    "vocab_parallel_output",
]
