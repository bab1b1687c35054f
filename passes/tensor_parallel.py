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
  backward (``passes.tp_collectives``);
- a row-parallel linear drops its bias, all-reduces its partial output, then adds the bias once.

``tensor_parallel_for_plan(captured, plan, mesh)`` first resolves the Plan's per-operator table
(op keys per layer type) to this graph's nodes. The pass never calls the planner.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.errors import AutoparError
from autopar.graph import CapturedModel
from autopar.passes.tp_collectives import (
    OURS,
    tp_chunks,
    tp_copy,
    tp_gather,
    tp_reduce,
    tp_reduce_scatter,
    tp_reslice,
    tp_slice,
    vocab_embedding,
)
from autopar.passes.tp_graph import layer_nodes, op_keys
from autopar.passes.tp_placements import int_arg
from autopar.passes.tp_rules import (
    EXPANDS,
    RESHAPES,
    RF,
    OpStrategy,
    R,
    cut_dim,
    fused_chunks,
    linear_parts,
    out_shape,
    partial_grad_params,
    propagate,
    shard_dim,
    strategies,
    tensor_args,
    vocab_parallel_output,
)
from autopar.plan import Plan
from autopar.strategy import SHARDING

log = logging.getLogger(__name__)
aten = torch.ops.aten

PARTIAL_GRAD = "R+partial-grad"
"""Placement reported for a replicated parameter applied to token shards (norm weights, a
row-parallel bias under sequence parallelism): each rank's gradient is a partial sum, which
the runtime all-reduces over the TP group once per step, in one bucket, before the optimizer
(as Megatron-LM does for layer-norm gradients under sequence parallelism)."""


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


def is_param(gm: fx.GraphModule, fqn: str) -> bool:
    """Whether ``gm.<fqn>`` is a parameter (not a buffer or a lifted constant)."""
    owner, _, attr = fqn.rpartition(".")
    try:
        mod = gm.get_submodule(owner) if owner else gm
    except AttributeError:
        return False
    return attr in mod._parameters


def _conversion(have: str, need: str, group: str, rank: int, t: int) -> tuple[Any, tuple[Any, ...]] | None:
    """The function (and its extra args) turning placement ``have`` into ``need`` (the table of
    ``cost_models.tp``)."""
    if have == need or (have == R and need == R):
        return None
    hd, nd = shard_dim(have), shard_dim(need)
    if have == R and need == RF:
        return tp_copy, (group,)
    if hd is not None and need in (R, RF):
        return tp_gather, (hd, group, rank, t, need == RF)
    if have == R and nd is not None:
        return tp_slice, (nd, group, rank, t)
    if hd is not None and nd is not None:  # a layer's output into the next layer, through the stream
        return tp_reslice, (hd, nd, group, rank, t)
    raise AssertionError(f"no conversion {have} → {need}: the chooser forbids it")


def written_later(graph: fx.Graph) -> set[str]:
    """Nodes whose tensor an in-place operator writes (directly or through views of it, read off
    each operator's schema: a written first argument, views returning an alias of theirs)."""
    out: set[str] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.arguments:
            continue
        alias = schema.arguments[0].alias_info
        if alias is None or not alias.is_write:
            continue
        dest = n.args[0]
        while isinstance(dest, fx.Node) and dest.name not in out:
            out.add(dest.name)
            view = getattr(dest.target, "_schema", None)
            if dest.op != "call_function" or view is None or not view.returns or not dest.args:
                break
            if view.returns[0].alias_info is None:
                break
            dest = dest.args[0]
    return out


def _copy_meta(dst: fx.Node, src: fx.Node) -> None:
    """``dst`` has ``src``'s global shape and value metadata."""
    dst.meta.update({k: src.meta[k] for k in ("val", "autopar.shape") if k in src.meta})


class _Rewrite:
    """One rewrite of ``gm`` for the 1-D TP mesh ``mesh`` under ``chosen`` (node name → strategy)."""

    def __init__(self, gm: fx.GraphModule, chosen: dict[str, OpStrategy], mesh: DeviceMesh) -> None:
        self.gm, self.graph, self.chosen, self.mesh = gm, gm.graph, chosen, mesh
        self.t, self.rank, self.group = mesh.size(), mesh.get_local_rank(), mesh.get_group().group_name
        self.placements: dict[str, str] = {}
        self.out_of = {name: s.out for name, s in chosen.items()}
        self.converted: dict[tuple[str, str], fx.Node] = {}
        self.partial_grads: set[str] = set()  # replicated parameters applied to token shards
        self.written = written_later(gm.graph)

    def convert(self, consumer: fx.Node, src: fx.Node, need: str) -> None:
        """Feed ``consumer`` the tensor ``src`` in placement ``need``: one conversion per (tensor,
        placement), shared by its consumers (for Megatron's f the consumers' partial gradients add
        up before the single all-reduce)."""
        conv = _conversion(self.out_of.get(src.name, R), need, self.group, self.rank, self.t)
        if conv is None:
            return
        if consumer.target is operator.getitem and isinstance(src.meta.get("val"), (list, tuple)):
            self.convert_element(consumer, conv, need)
            return
        # A tensor filled in place later (DeepSeek-V3's query: new_empty, then copy_ into its
        # slices) is converted where it is read, after the writes, once per reader.
        written = src.name in self.written
        new = None if written else self.converted.get((src.name, need))
        if new is None:
            fn, extra = conv
            with self.graph.inserting_before(consumer) if written else self.graph.inserting_after(src):
                new = self.graph.call_function(fn, (src, *extra))
            _copy_meta(new, src)
            if not written:
                self.converted[src.name, need] = new
        consumer.replace_input_with(src, new)

    def convert_element(self, item: fx.Node, conv: tuple[Any, tuple[Any, ...]], need: str) -> None:
        """A piece of a multi-output operator (``chunk``'s, ``split``'s) is converted after it is
        picked: the placement change applies to the piece, the getitem passes it through."""
        fn, extra = conv
        with self.graph.inserting_after(item):
            new = self.graph.call_function(fn, (item, *extra))
        _copy_meta(new, item)
        item.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        self.out_of[new.name] = need

    def reduce_partials(self, node: fx.Node, s: OpStrategy, bias: fx.Node | None) -> None:
        """After ``node`` (partial sums): all-reduce, or reduce-scatter over the sequence, then add
        ``bias`` once; the result replaces ``node`` for its users."""
        scatter = shard_dim(s.out)
        with self.graph.inserting_after(node):
            if scatter is None:
                red = self.graph.call_function(tp_reduce, (node, self.group))
            else:  # sequence parallelism: each rank keeps its slice of the sequence
                red = self.graph.call_function(tp_reduce_scatter, (node, scatter, self.group))
        out = red
        if bias is not None:
            with self.graph.inserting_after(red):
                out = self.graph.call_function(aten.add.Tensor, (red, bias))
        for new in {red, out}:  # same global shape as the operator's output
            _copy_meta(new, node)
            self.out_of[new.name] = s.out
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not red)

    def local_param(self, node: fx.Node, where: fx.Node, spec: str, split_factor: int = 1) -> fx.Node:
        """The parameter ``node`` reads, made a DTensor placed ``spec``, read locally before ``where``."""
        fqn = str(node.target)
        _set_param(self.gm, fqn, self.mesh, _dtensor_placement(spec, split_factor))
        self.placements[fqn] = spec if split_factor == 1 else f"{spec}x{split_factor}"
        with self.graph.inserting_before(where):
            return self.graph.call_method("to_local", (node,))

    def linear(self, node: fx.Node, s: OpStrategy) -> None:
        """Column- or row-parallel linear: local weight (and bias) shards; a row-parallel output
        is reduced before its bias is added once."""
        x, w, b, transposed = linear_parts(node)
        assert isinstance(w, fx.Node)
        factor = fused_chunks(node) if s.name == "column" else 1
        lw = self.local_param(w, node, s.params["weight"], factor)
        lb = None
        if isinstance(b, fx.Node) and factor > 1:
            # a fused bias stays replicated (FSDP2 can't shard a 1-D _StridedShard again);
            # each rank reads its slice of every chunk
            full = self.local_param(b, node, R)
            with self.graph.inserting_before(node):
                lb = self.graph.call_function(tp_chunks, (full, factor, self.group, self.rank, self.t))
        elif isinstance(b, fx.Node):
            lb = self.local_param(b, node, s.params["bias"])
        if s.name == "column":
            node.args = (lb, x, lw) if transposed else (x, lw, lb)
            return
        if transposed:  # row: partial sums → all-reduce → bias once
            node.target, node.args = aten.mm.default, (x, lw)
        else:
            node.args = (x, lw, None)
        self.reduce_partials(node, s, lb)

    def vocab(self, node: fx.Node, s: OpStrategy) -> None:
        """Vocabulary-parallel lookup: rows outside this rank's range give 0, then all ranks add."""
        w, ids = node.args[0], node.args[1]
        assert isinstance(w, fx.Node)
        vocab = int(w.meta["val"].shape[0])
        lw = self.local_param(w, node, "S0")
        lo, hi = self.rank * vocab // self.t, (self.rank + 1) * vocab // self.t
        pad = int_arg(node.args[2]) if len(node.args) > 2 else -1
        node.target, node.args = vocab_embedding, (lw, ids, lo, hi, pad % vocab if pad != -1 else -1)
        self.reduce_partials(node, s, None)

    def local_shapes(self, node: fx.Node, s: OpStrategy) -> None:
        """Shape constants on the split dim (views, expands, splits) divided by t."""
        d, t = shard_dim(s.out), self.t
        if d is None:
            return
        if node.target in (*RESHAPES, *EXPANDS):
            node.args = (node.args[0], _divide(node.args[1], d, t), *node.args[2:])
        elif node.target == aten.unflatten.int:  # the new dims' sizes: divide the split one
            start, sizes = int_arg(node.args[1]) % len(out_shape(node) or ()), node.args[2]
            if start <= d < start + len(sizes):  # type: ignore[arg-type]
                node.args = (node.args[0], node.args[1], _divide(sizes, d - start, t))
        elif node.target == aten.split.Tensor and cut_dim(node) == d:
            node.args = (node.args[0], int_arg(node.args[1]) // t, *node.args[2:])
        elif node.target == aten.split_with_sizes.default and cut_dim(node) == d:
            node.args = (node.args[0], [int_arg(x) // t for x in node.args[1]], *node.args[2:])  # type: ignore[union-attr]

    def operators(self) -> None:
        """Every chosen operator: its inputs converted, its parameters and shapes made local."""
        for node in list(self.graph.nodes):
            s = self.chosen.get(node.name)
            if s is None:
                continue
            self.partial_grads.update(
                str(p.target) for p in partial_grad_params(node, s)
            )  # before args change
            for slot, src in enumerate(tensor_args(node)):
                self.convert(node, src, s.inputs[slot] if slot < len(s.inputs) else R)
            if s.name in ("column", "row"):
                self.linear(node, s)
            if s.name == "vocab":
                self.vocab(node, s)
            self.local_shapes(node, s)

    def outside(self) -> None:
        """Operators outside the tensor-parallel layers (the head's loss, the graph output) take
        their inputs whole; logits split over the vocabulary leave as a DTensor (the loss is
        computed vocab-parallel)."""
        mesh = self.mesh

        def vocab_logits(x: torch.Tensor, dim: int) -> torch.Tensor:
            """The model's logits, split over the vocabulary, as a DTensor for ``loss_parallel``."""
            return DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)

        for node in list(self.graph.nodes):
            if (
                node.op not in ("call_function", "output")
                or node.name in self.chosen
                or node.target in OURS
                or (node.op != "output" and not isinstance(node.meta.get("val"), torch.Tensor | list | tuple))
            ):
                continue
            for src in tensor_args(node):
                if src.name not in self.chosen:
                    continue
                if node.op == "output" and vocab_parallel_output(src, self.out_of[src.name]):
                    with self.graph.inserting_after(src):
                        wrapped = self.graph.call_function(
                            vocab_logits, (src, shard_dim(self.out_of[src.name]))
                        )
                    node.replace_input_with(src, wrapped)
                else:
                    self.convert(node, src, R)

    def replicate_rest(self) -> None:
        """Every parameter the graph still reads whole becomes a replicated DTensor read locally."""
        for node in list(self.graph.nodes):
            fqn = str(node.target)
            if node.op != "get_attr" or fqn in self.placements or not is_param(self.gm, fqn):
                continue
            users = [u for u in node.users if not (u.op == "call_method" and u.target == "to_local")]
            if users:
                _set_param(self.gm, fqn, self.mesh, Replicate())
                with self.graph.inserting_after(node):
                    local = self.graph.call_method("to_local", (node,))
                for u in users:
                    u.replace_input_with(node, local)
                self.placements[fqn] = R


def tensor_parallel(
    gm: fx.GraphModule, chosen: dict[str, OpStrategy], mesh: DeviceMesh
) -> tuple[fx.GraphModule, dict[str, str]]:
    """Rewrite ``gm`` in place for the TP mesh ``mesh`` (1-D); returns it and {param: placement}
    (``PARTIAL_GRAD`` for parameters whose gradients the runtime must all-reduce each step)."""
    rw = _Rewrite(gm, chosen, mesh)
    rw.operators()
    rw.outside()
    rw.replicate_rest()
    for fqn in rw.partial_grads:
        rw.placements[fqn] = PARTIAL_GRAD
    gm.graph.lint()
    gm.recompile()
    sharded = {k: v for k, v in rw.placements.items() if v not in (R, PARTIAL_GRAD)}
    log.info("tensor parallel over %d ranks: %d parameters sharded: %s", rw.t, len(sharded), sharded)
    return gm, rw.placements


def resolve_strategies(
    gm: fx.GraphModule,
    layers: Sequence[Any],
    table: dict[str, dict[str, tuple[str, str]]],
    t: int,
    *,
    sp: bool = False,
) -> dict[str, OpStrategy]:
    """Node name → strategy for every layer whose type the plan's table (layer type → op key →
    (strategy, output placement)) covers."""
    chosen: dict[str, OpStrategy] = {}
    for layer in layers:
        ops = table.get(layer.type)
        if ops is None:
            continue
        nodes = layer_nodes(gm, layer.index)
        keys = op_keys(nodes, layer.name)
        decided: dict[str, OpStrategy] = {}
        for n in nodes:
            want = ops.get(keys[n.name])
            if want is None:
                continue
            match = [s for s in strategies(n, t) if (s.name, s.out) == want]
            if not match and want[0] not in SHARDING:
                # the plan's graph was traced at another micro-batch, where this reshape had other
                # shapes (a (b·s, h) view with b = 1): let it follow its inputs instead
                continue
            if not match:
                raise AutoparError(
                    f"the plan shards {layer.name} {keys[n.name]} as {want[0]} ({want[1]}), which this "
                    f"model's operator does not allow at tp {t}: the plan was made for another model"
                )
            decided[n.name] = match[0]
        chosen.update(propagate(nodes, decided, t, sp=sp))
        # shape-only no-ops (a contiguous() on an already contiguous tensor) may be traced at one
        # batch size and not another: only the operators that split weights or heads must be there
        missing = [k for k, (name, _) in ops.items() if k not in keys.values() and name in SHARDING]
        if missing:
            raise AutoparError(
                f"the plan names operators {sorted(missing)[:3]} that layer {layer.name} lacks: "
                "it was made for another model"
            )
    return chosen


def tensor_parallel_for_plan(
    captured: CapturedModel, plan: Plan, tp_mesh: DeviceMesh
) -> tuple[fx.GraphModule, list[str]]:
    """Rewrite a capture of the model (at the plan's micro-batch shape) for ``tp_mesh``.

    The returned GraphModule runs on the model's own parameters, now DTensors on the TP axis
    (the model object shares them, so its state_dict names are unchanged). Also returns the
    names of the parameters whose gradients are partial over the TP group (``PARTIAL_GRAD``)."""
    st = plan.strategy
    table = {ltype: {key: (name, out) for key, name, out in ops} for ltype, ops in plan.tensor_parallel}
    chosen = resolve_strategies(captured.gm, captured.layers, table, st.tp, sp=st.sequence_parallel)
    gm, placements = tensor_parallel(captured.gm, chosen, tp_mesh)
    return gm, sorted(k for k, v in placements.items() if v == PARTIAL_GRAD)


__all__ = [
    "PARTIAL_GRAD",
    "is_param",
    "resolve_strategies",
    "tensor_parallel",
    "tensor_parallel_for_plan",
]
