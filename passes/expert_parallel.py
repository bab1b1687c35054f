"""Expert parallelism: each MoE layer's routed experts split over the ranks of an ``ep`` mesh axis.

A captured MoE layer runs its experts as grouped matmuls over expert-sorted rows
(``graph.experts``). For ep > 1 the pass, per layer:

1. makes the stacked expert weights (E, …) DTensors ``Shard(0)`` on the ep axis: rank r holds
   experts r·E/ep … (r + 1)·E/ep − 1, read locally (``to_local``);
2. inserts ``dispatch`` before the first grouped matmul: the ranks exchange their rows-per-
   expert counts, send each row to the rank holding its expert (an all-to-all with autograd:
   its backward returns the rows' gradients the same way), and regroup what they received by
   local expert, with the local experts' offsets;
3. inserts ``combine`` after the last: the inverse regrouping and the all-to-all back, so each
   row returns to its rank in its original place.

Between the two, every operator must act on each row alone (the activations and gating of the
experts' MLP): checked, or the layer is refused with what it found. No row is dropped: dispatch
moves every row the router sent (dropless, as the model's own forward), so the numerics are
the single-device model's up to the order of the floating-point sums in the weight gradients.
The nodes between dispatch and combine are tagged ``autopar.experts`` with the experts' module
path, so the runtime can outline them (``outline_experts``) into the module FSDP2 shards over the
ranks holding the same experts.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import fx

from autopar.errors import AutoparError
from autopar.graph.experts import ExpertGroup, expert_groups, is_grouped_mm, row_region, weight_source
from autopar.mesh import simulated
from autopar.passes.pipeline_split import outline
from autopar.passes.tp_collectives import waited

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EXPERTS = "autopar.experts"
"""Node meta key: the experts' module path, on the nodes that run on routed rows."""


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


def by_local_expert(received: torch.Tensor) -> torch.Tensor:
    """The order that groups rows received as (source, local expert) blocks by local expert.

    ``received`` (ep, E_local) counts rows from each source for each local expert; rows arrive
    source-major. Block (s, e) starts at ``start[s, e]`` (exclusive prefix sum, source-major);
    taken expert-major, block k lands at ``c_k`` (prefix sum, expert-major), so the row at
    output position p of block k is ``start_k + (p − c_k)``."""
    flat = received.reshape(-1)
    start = (flat.cumsum(0) - flat).view_as(received).t().reshape(-1)
    counts = received.t().reshape(-1)
    landing = counts.cumsum(0) - counts
    total = int(counts.sum())
    shift = torch.repeat_interleave(start - landing, counts, output_size=total)
    return torch.arange(total, device=received.device) + shift


def dispatch(rows: torch.Tensor, offs: torch.Tensor, group: Any, ep: int) -> tuple[Any, ...]:
    """Send expert-sorted ``rows`` (cumulative counts ``offs`` per expert, (E,)) to the ranks
    holding their experts. Returns the rows this rank's experts take, grouped by local expert,
    their offsets (same dtype as ``offs``), and what ``combine`` needs to send results back."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())  # rows per expert
    local = counts.numel() // ep
    received = waited(funcol.all_to_all_single(counts, None, None, group)).view(ep, local)
    if simulated():  # no peer sends its counts: ``_even_routing``
        send, recv, order, local_offs = _even_routing(rows.shape[0], counts.numel(), ep, offs.dtype)
    else:
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        order = by_local_expert(received)
        local_offs = received.sum(0).cumsum(0).to(offs.dtype)
    got = waited(funcol.all_to_all_single_autograd(rows.contiguous(), recv, send, group))
    # × ep on the rows' gradient leaving the experts, ÷ ep (combine) on the one entering them:
    # the expert weights' gradients are divided by ep and nothing else changes (see combine)
    return _ScaleGrad.apply(got[order], float(ep)), local_offs, (order, send, recv, ep)


def _even_routing(rows: int, experts: int, ep: int, dtype: torch.dtype) -> tuple[Any, ...]:
    """``dispatch``'s sizes on a simulated rank (``mesh.simulated``: fake tensors hold no
    counts): every expert takes an even share of every rank's rows, as the cost model prices
    ``expert_skew`` 1. Real tensors, made outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    base, extra = divmod(rows, experts)
    even = [base + (e < extra) for e in range(experts)]
    local = experts // ep
    sizes = [sum(even[d * local : (d + 1) * local]) for d in range(ep)]
    with unset_fake_temporarily():
        received = torch.tensor(even).view(ep, local)
        return sizes, sizes, by_local_expert(received), received.sum(0).cumsum(0).to(dtype)


def combine(out: torch.Tensor, ctx: tuple[Any, ...], group: Any) -> torch.Tensor:
    """Inverse of ``dispatch`` on the experts' output rows: back to their ranks and places.

    In backward each rank's expert-weight gradients sum the rows of its whole ep group (what the
    all-to-all brought), and FSDP2 then averages them over the dp / ep ranks holding the same
    experts: the gradient entering the experts is divided by ep here (and the rows' gradient
    leaving them multiplied back in ``dispatch``), so the weights get the mean over all dp ranks,
    as every other weight does."""
    order, send, recv, ep = ctx
    out = _ScaleGrad.apply(out, 1.0 / ep)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return waited(funcol.all_to_all_single_autograd(out[inverse].contiguous(), send, recv, group))


def _rows(node: Any) -> set[int | None]:
    """The leading dims of what ``node`` computes (each tensor of a tuple)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    vals = val if isinstance(val, list | tuple) else [val]
    return {v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else None for v in vals}


def _with_checks(region: set[fx.Node]) -> set[fx.Node]:
    """``region`` and export's dtype checks of its values (``_assert_tensor_metadata``: dtype,
    device and layout, never the rows), which move with it."""
    checks = {
        u for n in region for u in n.users if u.target == torch.ops.aten._assert_tensor_metadata.default
    }
    return region | checks


def _check_rows(group: ExpertGroup, region: set[fx.Node]) -> None:
    """Every node between the first and the last matmul keeps the rows (dim 0), reads no other
    row-shaped tensor from outside, and is read only inside (the last matmul's output aside)."""
    checked = _with_checks(region)
    for n in region:
        outside = [u for u in n.users if u not in checked and n is not group.last]
        own = {group.offs, *([group.first.args[0]] if n in group.entries else [])}  # what dispatch moves
        foreign = [
            i
            for i in n.all_input_nodes
            if i not in region and i not in own and weight_source(i) is None and group.rows in _rows(i)
        ]
        if _rows(n) != {group.rows} or outside or foreign:
            what = (
                f"read by {outside[0].name} outside the experts"
                if outside
                else f"reads {foreign[0].name}, rows from outside the experts"
                if foreign
                else "does not keep the rows"
            )
            raise AutoparError(
                f"expert parallelism: {n.name} ({n.target}) between {group.path}'s grouped matmuls "
                f"{what}; this MoE form is not supported, plan with --ep 1"
            )


def _distribute(gm: fx.GraphModule, weight: fx.Node, mesh: DeviceMesh) -> list[fx.Node]:
    """Make the stacked expert weight ``weight`` reads a DTensor Shard(0) on ``mesh``'s ep axis
    (and Replicate on its tp axis, where the TP pass made it a replicated DTensor); return the
    local reads of it (``to_local``: the TP pass's, or one inserted right after the get_attr),
    which its users read."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    owner, _, attr = str(weight.target).rpartition(".")
    module = gm.get_submodule(owner)
    param = getattr(module, attr)
    if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("tp",):
        param = param.to_local()  # replicated over tp: the whole (E, …) weight
    if not isinstance(param, DTensor):
        placements = [Shard(0), *[Replicate()] * (mesh.ndim - 1)]
        shard = distribute_tensor(param.detach(), mesh, placements)
        module._parameters[attr] = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
    reads = [u for u in weight.users if u.op == "call_method" and u.target == "to_local"]
    if reads and len(reads) == len(weight.users):
        return reads
    with gm.graph.inserting_after(weight):
        local = gm.graph.call_method("to_local", (weight,))
    weight.replace_all_uses_with(local, delete_user_cb=lambda u: u is not local)
    local.meta = dict(weight.meta)
    return [local]


def _rewrite(gm: fx.GraphModule, group: ExpertGroup, mesh: DeviceMesh, ep: int, name: str) -> None:
    region = row_region(gm, group)
    _check_rows(group, region)
    graph, first, last, rows = gm.graph, group.first, group.last, group.first.args[0]
    assert isinstance(rows, fx.Node)
    layer = first.meta.get("autopar.layer")
    with graph.inserting_before(first):
        sent = graph.call_function(dispatch, (rows, group.offs, name, ep))
        parts = [graph.call_function(operator.getitem, (sent, k)) for k in range(3)]
    with graph.inserting_after(last):
        back = graph.call_function(combine, (last, parts[2], name))
    last.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
    for mm in group.entries:
        mm.update_arg(0, parts[0])
    for mm in group.matmuls:
        mm.update_arg(2, parts[1])
    # the values the new nodes stand for (shapes as captured: the rows a rank takes vary per step)
    parts[0].meta, parts[1].meta, back.meta = dict(rows.meta), dict(group.offs.meta), dict(last.meta)
    for n in (sent, *parts, back):
        n.meta["autopar.layer"] = layer
    chains = {n for w in group.weights for local in _distribute(gm, w, mesh) for n in _weight_chain(local)}
    for n in _with_checks(region) | chains:
        n.meta[EXPERTS] = group.path


def _weight_chain(local: fx.Node) -> set[fx.Node]:
    """A local weight read and the views/casts between it and the matmuls (moved with them)."""
    chain, todo = {local}, [local]
    while todo:
        for u in todo.pop().users:
            if u.op == "call_function" and u.meta.get(EXPERTS) is None and not is_grouped_mm(u):
                chain.add(u)
                todo.append(u)
    return chain


def expert_parallel(gm: fx.GraphModule, mesh: DeviceMesh) -> fx.GraphModule:
    """Rewrite every MoE layer of ``gm`` for the ep mesh axis ``mesh`` (see the module doc), or
    for the ("ep", "tp") mesh under tensor parallelism: the experts split over ep, replicated
    over tp (each TP rank dispatches its copy of the rows within its own ep group)."""
    groups = expert_groups(gm)
    if not groups:
        raise AutoparError(
            "ep > 1 but the model has no routed experts run as grouped matmuls (torch._grouped_mm or "
            "transformers' grouped experts); plan with --ep 1"
        )
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    for group in groups:
        if group.experts % ep_mesh.size():
            raise AutoparError(
                f"ep={ep_mesh.size()} does not divide {group.path}'s {group.experts} experts; plan with an "
                "ep that divides them"
            )
    for group in groups:
        _rewrite(gm, group, mesh, ep_mesh.size(), ep_mesh.get_group().group_name)
    gm.graph.lint()
    gm.recompile()
    return gm


def outline_experts(block: fx.GraphModule, path: str) -> tuple[fx.GraphModule, list[str]]:
    """Outline the experts of the block at ``path`` (nodes tagged ``EXPERTS``) into child
    modules at their own paths (relative to the block); returns the block and those paths."""
    prefix = path + "."

    def group(n: fx.Node) -> str | None:
        owner = n.meta.get(EXPERTS)
        return owner[len(prefix) :] if isinstance(owner, str) and owner.startswith(prefix) else None

    children = sorted({g for n in block.graph.nodes if (g := group(n)) is not None})
    return (outline(block, group), children) if children else (block, [])


__all__ = ["EXPERTS", "by_local_expert", "combine", "dispatch", "expert_parallel", "outline_experts"]
