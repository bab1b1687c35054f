"""Group graph nodes into layers and recognise repeated identical layers.

Layers are the units the planner places on pipeline stages and chooses
recomputation for: ``embed`` (everything before the first block), one layer
per block of the model's block list (``blocks.0`` … or ``model.layers.0`` …),
and ``head`` (everything after the last block). Layers whose nodes run the
same ops on the same shapes with the same parameter shapes share a layer
type, so a solver can treat them as interchangeable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from autopar.graph.trace import CONSTANT_PREFIX, _op_key, block_index


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One layer of the captured model, with its summed node annotations."""

    index: int
    """Position in execution order (0 = embed)."""
    name: str
    """``embed``, ``head``, or the block's module FQN (e.g. ``blocks.3``)."""
    type: str
    """Layer type name; identical layers share it (e.g. ``Block``)."""
    nodes: tuple[str, ...]
    """Names of the graph nodes in this layer."""
    params: int
    """Parameters read by this layer (a tied weight counts in the first layer that reads it)."""
    param_bytes: int
    """Bytes of those parameters."""
    fwd_flops: int
    """Forward FLOPs for the captured batch and sequence."""
    bwd_flops: int
    """Backward FLOPs (model-FLOPs convention, no recomputation)."""
    saved_bytes: int
    """Bytes of activations saved for backward."""


def find_layer_container(model: nn.Module) -> str | None:
    """FQN of the ModuleList holding the most parameters (the block list), if any."""
    best, best_params = None, 0
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 1:
            if best is not None and fqn.startswith(best + "."):
                continue
            n = sum(p.numel() for p in mod.parameters())
            if n > best_params:
                best, best_params = fqn, n
    return best


def group_layers(gm: fx.GraphModule, container: str | None) -> tuple[Layer, ...]:
    """Assign ``autopar.layer`` / ``autopar.layer_type`` / ``autopar.module`` to every node."""
    nodes = list(gm.graph.nodes)
    blocks = {n: block_index(n, container) if container else None for n in nodes}
    body = [k for k, n in enumerate(nodes) if n.op != "get_attr" and blocks[n] is not None]
    last = body[-1] if body else len(nodes)
    assign: dict[fx.Node, str] = {}
    order: list[str] = ["embed"]
    block_cls: dict[str, str] = {}
    current = "embed"
    for k, n in enumerate(nodes):
        if n.op == "get_attr":
            continue
        if blocks[n] is not None:
            current = f"{container}.{blocks[n]}"
            if current not in block_cls:
                order.append(current)
                block_cls[current] = _block_class(n, current)
        # nodes between two blocks (e.g. ``hidden = out[0]``) stay with the block before
        assign[n] = current if k <= last else "head"
    if body:
        order.append("head")
    for n in nodes:  # parameters belong to the layer of their first reader
        if n.op == "get_attr":
            users = [assign[u] for u in n.users if u in assign]
            assign[n] = min(users, key=order.index) if users else "embed"
        n.meta["autopar.module"] = _owner(n)
    index = {name: k for k, name in enumerate(order)}
    by_layer: dict[str, list[fx.Node]] = {name: [] for name in order}
    for n in nodes:
        by_layer[assign[n]].append(n)
    types = _layer_types(gm, by_layer, block_cls)
    layers = []
    for name in order:
        members = by_layer[name]
        for n in members:
            n.meta["autopar.layer"] = index[name]
            n.meta["autopar.layer_type"] = types[name]
        layers.append(
            Layer(
                index=index[name],
                name=name,
                type=types[name],
                nodes=tuple(n.name for n in members),
                params=sum(_numel(gm, n) for n in members),
                param_bytes=sum(n.meta.get("autopar.param_bytes", 0) for n in members),
                fwd_flops=sum(n.meta.get("autopar.fwd_flops", 0) for n in members),
                bwd_flops=sum(n.meta.get("autopar.bwd_flops", 0) for n in members),
                saved_bytes=sum(n.meta.get("autopar.saved_bytes", 0) for n in members),
            )
        )
    return tuple(layers)


def _block_class(n: fx.Node, name: str) -> str:
    for path, cls in (n.meta.get("nn_module_stack") or {}).values():
        if path == name:
            return str(getattr(cls, "__name__", cls)).rsplit(".", 1)[-1]
    return "Block"


def _owner(n: fx.Node) -> str:
    if n.op == "get_attr":
        return str(n.target).rpartition(".")[0]
    stack = n.meta.get("nn_module_stack") or {}
    paths = [p for p, _ in stack.values()]
    return paths[-1] if paths else ""


def _numel(gm: fx.GraphModule, n: fx.Node) -> int:
    if n.op != "get_attr" or not n.meta.get("autopar.param_bytes"):
        return 0
    t = gm.get_parameter(str(n.target))
    return t.numel()


def _name_in_block(target: str, block: str) -> str:
    """A parameter or buffer named without its block's path, so that identical blocks read
    identical names; a lifted constant (``trace.CONSTANT_PREFIX``) is numbered across the whole
    model, so it is known by its shape alone."""
    return CONSTANT_PREFIX if target.startswith(CONSTANT_PREFIX) else target.removeprefix(block + ".")


def _layer_types(
    gm: fx.GraphModule, by_layer: dict[str, list[fx.Node]], block_cls: dict[str, str]
) -> dict[str, str]:
    sig_names: dict[tuple[object, ...], str] = {}
    used: dict[str, int] = {}
    out: dict[str, str] = {}
    for name, members in by_layer.items():
        if name in ("embed", "head"):
            out[name] = name
            continue
        weights = sorted(  # by name inside the block: their order in the graph may vary
            (
                _name_in_block(str(n.target), name),
                tuple(n.meta["val"].shape),
                str(n.meta["val"].dtype),
            )
            for n in members
            if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)
        )
        sig = (*(_op_key(n) for n in members if n.op != "get_attr"), *weights)
        if sig not in sig_names:
            base = block_cls.get(name, "Block")
            used[base] = used.get(base, 0) + 1
            sig_names[sig] = base if used[base] == 1 else f"{base}#{used[base]}"
        out[name] = sig_names[sig]
    return out
