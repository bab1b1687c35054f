"""Tensor-parallel plans at run time: capture the model, resolve the plan's per-operator
strategies on this graph, and apply the tensor-parallel pass on the TP mesh axis."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import AutoparError
from autopar.graph import CapturedModel
from autopar.passes.tensor_parallel import PARTIAL_GRAD, tensor_parallel
from autopar.passes.tp_rules import SHARDING, OpStrategy, propagate, strategies
from autopar.plan import Plan
from autopar.runtime import ParallelModel, compute_dtype, device_type, loss_scaler
from autopar.tp_choice import layer_nodes, op_keys


def resolve_strategies(
    gm: fx.GraphModule,
    layers: Sequence[Any],
    table: dict[str, dict[str, tuple[str, str]]],
    t: int,
    *,
    sp: bool = False,
) -> dict[str, OpStrategy]:
    """Node name → strategy for every layer whose type the plan's table covers."""
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


def tensor_parallel_captured(
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


def dp_placement(param: nn.Parameter) -> Any:
    """FSDP2's dim for a parameter: not the dim of a fused column shard (``_StridedShard``, which a
    second shard of the same dim would scramble), else FSDP2's default (dim 0)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [p.dim for p in getattr(param, "placements", ()) if isinstance(p, _StridedShard)]
    if strided and param.dim() > 1:
        return Shard(1 if strided[0] == 0 else 0)
    return None


def parallelize_tp(
    model: nn.Module,
    plan: Plan,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
) -> ParallelModel:
    """tp > 1: the tensor-parallel pass on the (dp, tp) mesh, TP innermost (inside a node).

    Blocks are outlined into submodules at their original paths, so the plan's per-block
    recomputation applies and FSDP2 shards block by block. The data-parallel axis of a 2-D
    plan always runs through FSDP2 (composable ``replicate`` and DDP do not compose with
    DTensor parameters): ZeRO 0–2 keep parameters unsharded between forward and backward
    (``reshard_after_forward=False``), ZeRO 3 reshards them."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.passes.pipeline_split import outline_blocks
    from autopar.runtime_pp import fqn, recompute_blocks, rewritten_graph, shard_over_dp

    st = plan.strategy
    mesh = init_device_mesh(device_type(), (st.dp, st.tp), mesh_dim_names=("dp", "tp"))
    gm, names, partial = rewritten_graph(model, plan, mesh["tp"])
    # blocks become submodules at their own paths: FSDP2 shards them, checkpoint_wrapper recomputes
    gm = recompute_blocks(outline_blocks(gm, names), plan.recompute)
    half = compute_dtype(model, plan)
    autocast = None
    if st.dp > 1:
        shard_over_dp(gm, plan, mesh["dp"], half)
    else:
        autocast = half
    scaler = loss_scaler(plan, sharded=True)  # DTensor gradients, sharded over TP
    opt = optimizer_cls(gm.parameters(), **kwargs)
    params = {fqn(n): p for n, p in gm.named_parameters()}
    return ParallelModel(
        module=gm,
        optimizer=opt,
        plan=plan,
        loss_fn=loss_fn,
        autocast_dtype=autocast,
        scaler=scaler,
        partial_grads=[params[name] for name in partial],  # after FSDP2 replaced them
        tp_group=mesh["tp"].get_group().group_name,
    )


__all__ = ["dp_placement", "parallelize_tp", "resolve_strategies", "tensor_parallel_captured"]
