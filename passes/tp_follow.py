"""TP rules of the operators that follow their inputs: elementwise, shape, indexing and
last-dim reductions.

Such an operator can be sharded on output dim d when every input either has a dim that becomes
d (``in_dim_for``: through a reshape, transpose, select, broadcast …) and is sharded on it, or is
broadcast along d and stays whole — a causal mask (1, 1, s, s) under scores split over the
heads, an ALiBi bias, a norm's weight under a split sequence. A whole input read by a sharded
operator gets a partial gradient on each rank: it is read as ``Rf`` (all-reduced in backward,
free for masks and tables that need no gradient), a parameter read directly is all-reduced
once per step instead (``reduce_param_grads``). A linear's output split into
chunks along its features (fused QKV, fused gate and up projections) is the one cut that may
follow a split: the weight is then sharded chunk-wise (``fused_chunks``).
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.passes.tp_placements import (
    LINEAR_ARGS,
    RF,
    OpStrategy,
    S,
    int_arg,
    out_shape,
    shape_of,
    shard_dim,
)

aten = torch.ops.aten

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
"""Reshapes with a shape argument (divided by t on a sharded dim)."""

VIEWS = (*RESHAPES, aten.flatten.using_ints, aten.unflatten.int)
"""Operators whose dims map as a reshape's do (``view_dim_map``)."""

EXPANDS = (aten.expand.default, aten.broadcast_to.default)
"""Broadcasts with a shape argument."""


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


def in_dim_for(node: fx.Node, src: fx.Node, out_dim: int) -> int | None:
    """The dim of input ``src`` that becomes output dim ``out_dim`` (None: no single dim does;
    -1: ``src`` is broadcast along it, so it stays replicated)."""
    target = node.target
    ins, outs = shape_of(src), out_shape(node)
    if ins is None or outs is None:
        return None
    if target in VIEWS:
        inverse = {v: k for k, v in view_dim_map(ins, outs).items()}
        return inverse.get(out_dim)
    if target == aten.transpose.int:
        d0, d1 = (int_arg(x) % len(ins) for x in node.args[1:3])
        return d1 if out_dim == d0 else d0 if out_dim == d1 else out_dim
    if target == aten.permute.default:
        return int_arg(node.args[1][out_dim])  # type: ignore[index]
    if target == aten.unsqueeze.default:
        d = int_arg(node.args[1]) % len(outs)
        return None if out_dim == d else out_dim - (out_dim > d)
    if target in EXPANDS:
        return None if ins[out_dim - (len(outs) - len(ins))] == 1 else out_dim - (len(outs) - len(ins))
    if target in (aten.select.int, aten.index.Tensor):
        return _picked_dim(node, src, ins, out_dim)
    return _broadcast_dim(ins, outs, out_dim)


def _broadcast_dim(ins: tuple[int, ...], outs: tuple[int, ...], out_dim: int) -> int:
    """Elementwise with broadcasting (dims aligned from the right): the input dim under
    ``out_dim``, or -1 where the input is broadcast along it (a mask of size 1 over the heads)."""
    k = out_dim - (len(outs) - len(ins))
    return -1 if k < 0 or ins[k] == 1 else k


def _picked_dim(node: fx.Node, src: fx.Node, ins: tuple[int, ...], out_dim: int) -> int | None:
    """``select(x, dim, i)`` drops ``dim``; ``x[..., idx]`` (``index.Tensor`` with one 1-D index
    tensor) keeps every dim. The picked dim itself can't be sharded; index tensors stay whole."""
    if src is not node.args[0]:
        return -1
    if node.target == aten.select.int:
        dim = int_arg(node.args[1]) % len(ins)
        return out_dim + (out_dim >= dim)
    indices = list(node.args[1])  # type: ignore[arg-type]
    picked = [i for i, x in enumerate(indices) if x is not None]
    if len(picked) != 1 or len(shape_of(indices[picked[0]]) or (0, 0)) != 1:
        return None  # several index tensors broadcast together: no dim maps one to one
    return None if out_dim == picked[0] else out_dim


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
        return int_arg(dim) % len(shape) if shape is not None else None
    return None


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
    """``linear → split`` into equal chunks along the output features (fused QKV): each chunk can
    be column-sharded when the weight is sharded chunk-wise (``_StridedShard``), as Megatron lays
    out fused QKV. Unequal sizes (DeepSeek-V3's [kv_lora_rank, rope dims]) are not: the chunks
    ``fused_chunks`` counts are equal, so such a split needs its input whole."""
    src = node.args[0]
    return (
        node.target in (aten.split.Tensor, aten.chunk.default)
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
            if u.target in (aten.split.Tensor, aten.chunk.default) and u.args[0] is cur:
                dim = int_arg(u.args[2]) if len(u.args) > 2 else 0
                width = (out_shape(cur) or (0,))[-1]
                if dim in (-1, len(out_shape(cur) or ()) - 1):  # split(size) or chunk(count)
                    count = int_arg(u.args[1])
                    return count if u.target == aten.chunk.default else width // count
            elif u.target in RESHAPES and _feature_source(u) is node:
                frontier.append(u)
    return 1


def follow_strategies(
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
        attrs = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        if any(in_dim_for(node, p, d) not in (-1, None) for p in attrs):
            continue
        params = [a for a in attrs if a.meta.get("autopar.param_bytes")]  # not buffers (a mask)
        if any(shard_dim(p) is not None for p in need):  # some input carries the sharding
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
        k, in_shape = in_dim_for(node, a, d), shape_of(a)
        if k is None or (k >= 0 and in_shape is not None and in_shape[k] % t):
            return None  # no such input dim, or it does not split t ways (2 KV heads at tp 4)
        need.append(RF if k == -1 else S(k))  # broadcast: whole, its gradient partial (Megatron's f)
    return need


__all__ = [
    "EXPANDS",
    "RESHAPES",
    "VIEWS",
    "cut_dim",
    "follow_strategies",
    "fused_chunks",
    "in_dim_for",
    "view_dim_map",
]
