"""Tensor-parallel plans at run time: capture the model, resolve the plan's per-operator
strategies on this graph, and apply the tensor-parallel pass on the TP mesh axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.passes.tensor_parallel import PARTIAL_GRAD, tensor_parallel
from autopar.passes.tp_rules import OpStrategy, propagate, strategies
from autopar.plan import Plan
from autopar.tp_choice import layer_nodes, op_keys

DECIDING_NAMES = ("column", "row", "heads", "vocab")
"""Strategy names only a deciding operator (linear, attention, embedding) has."""


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
            if not match and want[0] not in DECIDING_NAMES:
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
        # batch size and not another: only the deciding operators must all be there
        missing = [k for k, (name, _) in ops.items() if k not in keys.values() and name in DECIDING_NAMES]
        if missing:
            raise AutoparError(
                f"the plan names operators {sorted(missing)[:3]} that layer {layer.name} lacks: "
                "it was made for another model"
            )
    return chosen


def apply_tensor_parallel(
    model: nn.Module, plan: Plan, tp_mesh: DeviceMesh
) -> tuple[fx.GraphModule, list[str]]:
    """Capture ``model`` at the plan's micro-batch shape and rewrite it for ``tp_mesh``.

    The returned GraphModule runs on the model's own parameters, now DTensors on the TP axis
    (the model object shares them, so its state_dict names are unchanged). Also returns the
    names of the parameters whose gradients are partial over the TP group (``PARTIAL_GRAD``)."""
    st = plan.strategy
    captured = capture(model, batch=st.micro_batch, seq=st.seq)
    table = {ltype: {key: (name, out) for key, name, out in ops} for ltype, ops in plan.tensor_parallel}
    chosen = resolve_strategies(captured.gm, captured.layers, table, st.tp, sp=st.sequence_parallel)
    gm, placements = tensor_parallel(captured.gm, chosen, tp_mesh)
    return gm, sorted(k for k, v in placements.items() if v == PARTIAL_GRAD)


__all__ = ["apply_tensor_parallel", "resolve_strategies"]
