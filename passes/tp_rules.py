"""Tensor-parallel sharding rules: how each operator kind may be split over the TP axis.

``RULES`` maps each ATen operator to a rule kind; ``strategies(node, t)`` lists, for
one graph node, every (output placement → input placements) choice its rule allows,
with the fraction of the compute each rank does and the collective the operator
itself issues (placements: ``tp_placements``; operators that follow their inputs:
``tp_follow``). Which ops are sharded and how is the planner's choice
(``autopar.planner.tp_ilp``); the rewriting pass (``passes.tensor_parallel``) applies it.
Unknown operators get the safe ``replicate`` rule: they still run, unsharded.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autopar.passes.tp_follow import (
    EXPANDS,
    RESHAPES,
    VIEWS,
    cut_dim,
    follow_strategies,
    fused_chunks,
    in_dim_for,
    view_dim_map,
)
from autopar.passes.tp_placements import (
    LINEAR_ARGS,
    RF,
    OpStrategy,
    R,
    S,
    linear_parts,
    out_shape,
    shape_of,
    shard_dim,
    tensor_args,
)

aten = torch.ops.aten


RULES: dict[Any, str] = {
    aten.linear.default: "linear",
    aten.addmm.default: "linear",  # Conv1D (Hugging Face GPT-2): addmm(bias, x, W) with W (in, out)
    aten.embedding.default: "embedding",
    aten.scaled_dot_product_attention.default: "attention",
    aten.matmul.default: "batched_matmul",
    aten.bmm.default: "batched_matmul",
    aten.baddbmm.default: "batched_matmul",  # BLOOM: ALiBi bias + q·kᵀ in one op
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
            aten.broadcast_to.default,
            aten.flatten.using_ints,
            aten.unflatten.int,
            aten.alias.default,
            aten.select.int,  # Falcon's fused_qkv[..., 0, :]
            aten.index.Tensor,  # Falcon's fused_qkv[..., [-2], :] (multi-query keys)
            aten.slice.Tensor,
            aten.cat.default,
            aten.neg.default,
            aten.gelu.default,
            aten.silu.default,
            aten.relu.default,
            aten.tanh.default,
            aten.pow.Tensor_Scalar,
            aten.rsqrt.default,
            aten.sigmoid.default,
            aten.exp.default,
            aten.erf.default,
            aten.sqrt.default,
            aten.reciprocal.default,
            aten.abs.default,
            aten.clamp.default,
            aten.dropout.default,
            aten.masked_fill.Scalar,  # scores.masked_fill(~causal, -inf): the mask broadcast over heads
            aten.masked_fill.Tensor,
            aten.where.self,  # torch.where(mask, scores, min): the same, as eager HF attention writes it
            aten.where.ScalarOther,
            aten.where.ScalarSelf,
            aten.bitwise_not.default,
            aten.logical_not.default,
            aten.eq.Scalar,
            aten.eq.Tensor,
            aten.ne.Scalar,
            aten.maximum.default,
            aten.minimum.default,
            aten.add.Tensor,
            aten.add_.Tensor,  # Falcon's residual: mlp_output += attention_output
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


def strategies(node: fx.Node, t: int) -> list[OpStrategy]:
    """Every way ``node`` may run on a TP axis of size ``t`` (always includes ``replicate``)."""
    ins = tensor_args(node)
    shape = out_shape(node)
    replicate = OpStrategy(name="replicate", out=R, inputs=tuple(R for _ in ins), compute_fraction=1.0)
    kind = RULES.get(node.target, "replicate")
    if shape is None or t == 1 or node.meta.get("autopar.expert_rows"):
        # a routed experts' rows (``graph.experts.row_region``): expert parallelism moves them and
        # their count varies per step, which a TP collective sized at capture could not follow
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
        found.extend(_batched_matmul_strategies(node, ins, shape, sharded, t))
    elif kind in ("follow", "reduce_last"):
        found.extend(follow_strategies(node, kind, ins, shape, sharded, t))
    return found


def _linear_strategies(node: fx.Node, shape: tuple[int, ...], t: int) -> list[OpStrategy]:
    """Column- and row-parallel ways to run a linear-kind node (Megatron's split of an MLP)."""
    found: list[OpStrategy] = []
    _, w, b, transposed = linear_parts(node)
    wshape = shape_of(w) if isinstance(w, fx.Node) else None
    reads = [x for x in (w, b) if isinstance(x, fx.Node)]
    if wshape is None or any(x.op != "get_attr" for x in reads):
        return found  # a weight computed first (DeepSeek-V3's router: ``weight.float()``): replicated
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
    wshape = shape_of(w) if isinstance(w, fx.Node) else None
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
    if all(shape_of(a) is not None and shape_of(a)[1] % t == 0 for a in ins[:3]) and shape[1] % t == 0:
        # an attention mask broadcast over heads (size 1 there) stays whole (Rf: free without a gradient)
        mask = tuple(
            RF if (shape_of(a) or (1, 1))[1] == 1 or len(shape_of(a) or ()) < 4 else S(1) for a in ins[3:]
        )
        return [OpStrategy(name="heads", out=S(1), inputs=(S(1),) * 3 + mask, compute_fraction=1 / t)]
    return []


def _batched_matmul_strategies(
    node: fx.Node, ins: list[fx.Node], shape: tuple[int, ...], sharded: list[int], t: int
) -> list[OpStrategy]:
    """A batched matmul with a batch dim (heads) split on both operands; ``baddbmm``'s added term
    follows it too, or stays whole where it broadcasts (ALiBi's (b·heads, 1, s) bias does not)."""
    found = []
    for d in (d for d in sharded if d < len(shape) - 2):
        need = [S(d)] * len(ins)
        if node.target == aten.baddbmm.default:
            k = in_dim_for(node, ins[0], d)
            if k is None:
                continue
            need[0] = RF if k == -1 else S(k)
        found.append(OpStrategy(name="follow", out=S(d), inputs=tuple(need), compute_fraction=1 / t))
    return found


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
    "EXPANDS",
    "LINEAR_ARGS",
    "RESHAPES",
    "RF",
    "RULES",
    "VIEWS",
    "OpStrategy",
    "R",
    "S",
    "boundary",
    "cut_dim",
    "fused_chunks",
    "in_dim_for",
    "linear_parts",
    "out_shape",
    "partial_grad_params",
    "propagate",
    "shape_of",
    "shard_dim",
    "strategies",
    "stream_placement",
    "tensor_args",
    "view_dim_map",
    "vocab_parallel_output",
]
