"""Tensor-parallel rewriting: apply chosen per-operator strategies to a captured graph.

``tensor_parallel(gm, choice, mesh)`` rewrites the graph so that each rank runs its
shard on local tensors:

- sharded parameters become DTensors on the TP mesh (``Shard(0)`` for column-parallel
  weights, ``_StridedShard(0, split_factor=k)`` for a fused projection whose output is
  split into k chunks such as QKV, ``Shard(1)`` for row-parallel weights), so FSDP2 and
  DCP see the original global tensors; every other parameter becomes a replicated DTensor.
  The graph reads them with ``to_local()``;
- shape constants on a sharded dim (``view(B, T, heads, head_dim)``, ``split(C)``) are
  divided by t, so model code that hard-codes the head count runs unchanged;
- placement changes between operators become collectives with Megatron's conjugate
  backward (``tp_copy``: identity forward, all-reduce backward; ``tp_reduce``: all-reduce
  forward, identity backward; ``tp_gather``/``tp_slice``), built on
  ``torch.distributed._functional_collectives``;
- a row-parallel linear drops its bias, all-reduces its partial output, then adds the bias once.

The pass never calls the planner: strategies come from ``autopar.tp_choice``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.passes.tp_rules import (
    RESHAPES,
    RF,
    OpStrategy,
    R,
    cut_dim,
    fused_chunks,
    linear_parts,
    partial_grad_params,
    shard_dim,
    tensor_args,
    vocab_parallel_output,
)

log = logging.getLogger(__name__)
aten = torch.ops.aten


# ---- collectives with Megatron's conjugate backward ------------------------------------------


def _wait(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(x) if isinstance(x, funcol.AsyncCollectiveTensor) else x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _wait(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return _wait(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward takes this rank's slice, reduce-scattering first when the
    gradient is a partial sum (the gathered tensor feeds column-parallel weights)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str, rank: int, size: int, partial: bool) -> Any:
        ctx.args = dim, group, rank, size, partial
        return _wait(funcol.all_gather_tensor(x.contiguous(), gather_dim=dim, group=group))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dim, group, rank, size, partial = ctx.args
        if partial:
            out = _wait(funcol.reduce_scatter_tensor(g.contiguous(), "sum", scatter_dim=dim, group=group))
        else:
            out = g.chunk(size, dim=dim)[rank].contiguous()
        return out, None, None, None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str, rank: int, size: int) -> torch.Tensor:
        ctx.args = dim, group
        return x.chunk(size, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dim, group = ctx.args
        return (
            _wait(funcol.all_gather_tensor(g.contiguous(), gather_dim=dim, group=group)),
            None,
            None,
            None,
            None,
        )


class _Chunks(torch.autograd.Function):
    """This rank's slice of each of k chunks of a replicated vector (a fused bias); backward
    all-gathers the slices' gradients so every rank holds the whole, identical gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, group: str, rank: int, size: int) -> torch.Tensor:
        ctx.args = k, group, size
        return x.view(k, size, -1)[:, rank].reshape(-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        k, group, _size = ctx.args
        parts = _wait(funcol.all_gather_tensor(g.contiguous().view(1, k, -1), gather_dim=0, group=group))
        return parts.transpose(0, 1).reshape(-1), None, None, None, None  # (size, k, m) → (k, size, m)


def tp_chunks(x: torch.Tensor, k: int, group: str, rank: int, size: int) -> torch.Tensor:
    """Slices r of each of k chunks of a replicated vector; gradients all-gathered."""
    return _Chunks.apply(x, k, group, rank, size)  # type: ignore[no-any-return]


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
        ctx.args = dim, group
        return _wait(funcol.reduce_scatter_tensor(x.contiguous(), "sum", scatter_dim=dim, group=group))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dim, group = ctx.args
        return _wait(funcol.all_gather_tensor(g.contiguous(), gather_dim=dim, group=group)), None, None


def tp_reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Sequence-parallel g: reduce-scatter partial sums along ``dim`` forward, all-gather backward."""
    return _ReduceScatter.apply(x, dim, group)  # type: ignore[no-any-return]


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows [lo, hi) of the embedding; other ids give zeros (the
    partial sums all ranks then add up: Megatron's vocabulary-parallel embedding)."""
    outside = (ids < lo) | (ids >= hi)
    rows = torch.ops.aten.embedding.default(weight, (ids - lo).masked_fill(outside, 0))
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron f: identity forward, all-reduce of the gradient."""
    return _Copy.apply(x, group)  # type: ignore[no-any-return]


def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron g: all-reduce forward, identity backward."""
    return _Reduce.apply(x, group)  # type: ignore[no-any-return]


def tp_gather(x: torch.Tensor, dim: int, group: str, rank: int, size: int, partial: bool) -> torch.Tensor:
    """All-gather forward; slice (or reduce-scatter a partial gradient) backward."""
    return _Gather.apply(x, dim, group, rank, size, partial)  # type: ignore[no-any-return]


def tp_slice(x: torch.Tensor, dim: int, group: str, rank: int, size: int) -> torch.Tensor:
    """Keep this rank's slice forward; all-gather backward."""
    return _Slice.apply(x, dim, group, rank, size)  # type: ignore[no-any-return]


# ---- the pass ------------------------------------------------------------------------------


def _dtensor_placement(spec: str, split_factor: int) -> Placement:
    if spec.startswith("S") and split_factor > 1:
        return _StridedShard(int(spec[1:]), split_factor=split_factor)
    return Shard(int(spec[1:])) if spec.startswith("S") else Replicate()


def _set_param(root: nn.Module, fqn: str, mesh: DeviceMesh, placement: Placement) -> None:
    """Replace parameter ``fqn`` by a DTensor parameter, everywhere it is used (tied weights
    stay tied: every module holding the same Parameter gets the new one)."""
    owner_name, _, attr = fqn.rpartition(".")
    param = getattr(root.get_submodule(owner_name), attr)
    if hasattr(param, "device_mesh"):
        return  # already distributed (a tied weight seen twice)
    new = nn.Parameter(
        distribute_tensor(param.detach(), mesh, [placement]), requires_grad=param.requires_grad
    )
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is param:
                module._parameters[name] = new


def _divide(shape: Any, dim: int, t: int) -> list[Any]:
    out = list(shape)
    if out[dim] == -1:
        return out  # inferred from the (local) input
    assert isinstance(out[dim], int) and out[dim] % t == 0, (shape, dim, t)
    out[dim] //= t
    return out


PARTIAL_GRAD = "R+partial-grad"
"""Placement reported for a replicated parameter applied to token shards (norm weights, a
row-parallel bias under sequence parallelism): each rank's gradient is a partial sum, which
the runtime all-reduces over the TP group once per step, in one bucket, before the optimizer
(as Megatron-LM does for layer-norm gradients under sequence parallelism)."""


def tensor_parallel(
    gm: fx.GraphModule, chosen: dict[str, OpStrategy], mesh: DeviceMesh
) -> tuple[fx.GraphModule, dict[str, str]]:
    """Rewrite ``gm`` in place for the TP mesh ``mesh`` (1-D); returns it and {param: placement}
    (``PARTIAL_GRAD`` for parameters whose gradients the runtime must all-reduce each step)."""
    t = mesh.size()
    rank = mesh.get_local_rank()
    group = mesh.get_group().group_name
    graph = gm.graph
    placements: dict[str, str] = {}
    out_of = {name: s.out for name, s in chosen.items()}
    converted: dict[tuple[str, str], fx.Node] = {}
    partial_grads: set[str] = set()  # replicated parameters applied to token shards

    def convert(consumer: fx.Node, src: fx.Node, need: str) -> None:
        """Feed ``consumer`` the tensor ``src`` in placement ``need``: one conversion per (tensor,
        placement), shared by its consumers (for Megatron's f the consumers' partial gradients add
        up before the single all-reduce)."""
        conv = _conversion(out_of.get(src.name, R), need, group, rank, t)
        if conv is None:
            return
        new = converted.get((src.name, need))
        if new is None:
            fn, extra = conv
            with graph.inserting_after(src):
                new = graph.call_function(fn, (src, *extra))
            new.meta.update({k: src.meta[k] for k in ("val", "autopar.shape") if k in src.meta})
            converted[src.name, need] = new
        consumer.replace_input_with(src, new)

    def reduce_partials(node: fx.Node, s: OpStrategy, bias: fx.Node | None) -> None:
        """After ``node`` (partial sums): all-reduce, or reduce-scatter over the sequence, then add
        ``bias`` once; the result replaces ``node`` for its users."""
        scatter = shard_dim(s.out)
        with graph.inserting_after(node):
            if scatter is None:
                red = graph.call_function(tp_reduce, (node, group))
            else:  # sequence parallelism: each rank keeps its slice of the sequence
                red = graph.call_function(tp_reduce_scatter, (node, scatter, group))
        out = red
        if bias is not None:
            with graph.inserting_after(red):
                out = graph.call_function(aten.add.Tensor, (red, bias))
        for new in {red, out}:  # same global shape as the operator's output
            new.meta.update({k: node.meta[k] for k in ("val", "autopar.shape") if k in node.meta})
            out_of[new.name] = s.out
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not red)

    def local_param(node: fx.Node, where: fx.Node, spec: str, split_factor: int = 1) -> fx.Node:
        fqn = str(node.target)
        _set_param(gm, fqn, mesh, _dtensor_placement(spec, split_factor))
        placements[fqn] = spec if split_factor == 1 else f"{spec}x{split_factor}"
        with graph.inserting_before(where):
            return graph.call_method("to_local", (node,))

    for node in list(graph.nodes):
        s = chosen.get(node.name)
        if s is None:
            continue
        partial_grads.update(str(p.target) for p in partial_grad_params(node, s))  # before args change
        # 1. the inputs: insert the placement change each input needs
        for slot, src in enumerate(tensor_args(node)):
            convert(node, src, s.inputs[slot] if slot < len(s.inputs) else R)
        # 2. the parameters and shape constants
        if s.name in ("column", "row"):
            x, w, b, transposed = linear_parts(node)
            assert isinstance(w, fx.Node)
            factor = fused_chunks(node) if s.name == "column" else 1
            lw = local_param(w, node, s.params["weight"], factor)
            lb = None
            if isinstance(b, fx.Node) and factor > 1:
                # a fused bias stays replicated (FSDP2 can't shard a 1-D _StridedShard again);
                # each rank reads its slice of every chunk
                full = local_param(b, node, R)
                with graph.inserting_before(node):
                    lb = graph.call_function(tp_chunks, (full, factor, group, rank, t))
            elif isinstance(b, fx.Node):
                lb = local_param(b, node, s.params["bias"])
            if s.name == "column":
                node.args = (lb, x, lw) if transposed else (x, lw, lb)
            else:  # row: partial sums → all-reduce → bias once
                if transposed:
                    node.target, node.args = aten.mm.default, (x, lw)
                else:
                    node.args = (x, lw, None)
                reduce_partials(node, s, lb)
        if s.name == "vocab":  # vocabulary-parallel lookup: rows outside this rank's range are 0
            w, ids = node.args[0], node.args[1]
            assert isinstance(w, fx.Node)
            vocab = int(w.meta["val"].shape[0])
            lw = local_param(w, node, "S0")
            lo, hi = rank * vocab // t, (rank + 1) * vocab // t
            node.target, node.args = vocab_embedding, (lw, ids, lo, hi)
            reduce_partials(node, s, None)
        d = shard_dim(s.out)
        if d is not None and node.target in (*RESHAPES, aten.expand.default):
            node.args = (node.args[0], _divide(node.args[1], d, t), *node.args[2:])
        elif d is not None and node.target == aten.split.Tensor and cut_dim(node) == d:
            node.args = (node.args[0], int(node.args[1]) // t, *node.args[2:])  # type: ignore[call-overload]
        elif d is not None and node.target == aten.split_with_sizes.default and cut_dim(node) == d:
            node.args = (node.args[0], [int(x) // t for x in node.args[1]], *node.args[2:])  # type: ignore[union-attr]

    def vocab_logits(x: torch.Tensor, dim: int) -> torch.Tensor:
        """The model's logits, split over the vocabulary, as a DTensor for ``loss_parallel``."""
        return DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)

    # operators outside the tensor-parallel layers (the head) take their inputs whole; logits
    # split over the vocabulary leave as a DTensor (the loss is computed vocab-parallel)
    for node in list(graph.nodes):
        if (
            node.op in ("call_function", "output")
            and node.name not in chosen
            and node.target not in _OURS
            and (node.op == "output" or isinstance(node.meta.get("val"), torch.Tensor | list | tuple))
        ):
            for src in tensor_args(node):
                if (
                    node.op == "output"
                    and src.name in chosen
                    and vocab_parallel_output(src, out_of[src.name])
                ):
                    with graph.inserting_after(src):
                        wrapped = graph.call_function(vocab_logits, (src, shard_dim(out_of[src.name])))
                    node.replace_input_with(src, wrapped)
                elif src.name in chosen:
                    convert(node, src, R)
    # 3. every parameter the graph still reads whole becomes a replicated DTensor read locally
    for node in list(graph.nodes):
        if node.op == "get_attr" and str(node.target) not in placements and is_param(gm, str(node.target)):
            users = [u for u in node.users if not (u.op == "call_method" and u.target == "to_local")]
            if users:
                _set_param(gm, str(node.target), mesh, Replicate())
                with graph.inserting_after(node):
                    local = graph.call_method("to_local", (node,))
                for u in users:
                    u.replace_input_with(node, local)
                placements[str(node.target)] = R
    for fqn in partial_grads:
        placements[fqn] = PARTIAL_GRAD
    graph.lint()
    gm.recompile()
    sharded = {k: v for k, v in placements.items() if v not in (R, PARTIAL_GRAD)}
    log.info("tensor parallel over %d ranks: %d parameters sharded: %s", t, len(sharded), sharded)
    return gm, placements


_OURS = (tp_copy, tp_reduce, tp_reduce_scatter, tp_gather, tp_slice, tp_chunks, vocab_embedding)


def is_param(gm: fx.GraphModule, fqn: str) -> bool:
    """Whether ``gm.<fqn>`` is a parameter (not a buffer or a lifted constant)."""
    owner, _, attr = fqn.rpartition(".")
    try:
        mod = gm.get_submodule(owner) if owner else gm
    except AttributeError:
        return False
    return attr in mod._parameters


def _conversion(have: str, need: str, group: str, rank: int, t: int) -> tuple[Any, tuple[Any, ...]] | None:
    """The function (and its extra args) turning placement ``have`` into ``need`` (table in tp_choice)."""
    if have == need or (have == R and need == R):
        return None
    hd, nd = shard_dim(have), shard_dim(need)
    if have == R and need == RF:
        return tp_copy, (group,)
    if hd is not None and need in (R, RF):
        return tp_gather, (hd, group, rank, t, need == RF)
    if have == R and nd is not None:
        return tp_slice, (nd, group, rank, t)
    raise AssertionError(f"no conversion {have} → {need}: the chooser forbids it")


__all__ = [
    "PARTIAL_GRAD",
    "is_param",
    "tensor_parallel",
    "tp_chunks",
    "tp_copy",
    "tp_gather",
    "tp_reduce",
    "tp_reduce_scatter",
    "tp_slice",
    "vocab_embedding",
]
