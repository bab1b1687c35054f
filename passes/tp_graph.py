"""Which operators a tensor-parallel layer has, and the names plans give them.

The per-operator TP choice (``planner/tp_ilp``), its pricing (``cost_models/tp``) and the
rewrite at run time (``passes/tensor_parallel``) all look at the same operators of a layer:
the call_function nodes of one ``autopar.layer`` that produce tensors. ``op_keys`` names them
the same way in every layer of a type (``attn.c_attn:linear#0``), which is how a Plan records
each operator's strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autopar.graph.dag import digraph, downstream
from autopar.passes.tp_rules import out_shape


def needs_grad(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose values need a gradient: those computed from a parameter."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}  # tied: every name
    reads = {n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) in params}
    return {n.name for n in downstream(digraph(gm.graph), reads)}


def produces_tensor(n: fx.Node) -> bool:
    """A call_function with a (first) tensor output: metadata asserts, which return nothing, are not."""
    return n.op == "call_function" and out_shape(n) is not None and n.meta.get("val") is not None


def layer_nodes(gm: fx.GraphModule, layer: int) -> list[fx.Node]:
    """The operators of layer index ``layer`` that produce tensors, in graph order."""
    return [n for n in gm.graph.nodes if n.meta.get("autopar.layer") == layer and produces_tensor(n)]


@dataclass(frozen=True, kw_only=True)
class GraphIndex:
    """What every per-layer ILP of one graph reads, found in one pass over it (GPT-3 175B's graph
    has 3,566 nodes: scanning it for every ILP took about half as long as the solves)."""

    grads: frozenset[str]
    """``needs_grad`` of the graph."""
    layers: dict[int, tuple[fx.Node, ...]]
    """Layer index → ``layer_nodes`` of it."""


def index_graph(gm: fx.GraphModule) -> GraphIndex:
    """The ``GraphIndex`` of ``gm``."""
    layers: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        i = n.meta.get("autopar.layer")
        if i is not None and produces_tensor(n):
            layers.setdefault(i, []).append(n)
    return GraphIndex(
        grads=frozenset(needs_grad(gm)), layers={i: tuple(nodes) for i, nodes in layers.items()}
    )


def op_keys(nodes: list[fx.Node], prefix: str) -> dict[str, str]:
    """Node name → a name that is the same in every layer of a type: ``module:op#k``, where module
    is the owning module relative to the layer (``prefix``), op the ATen operator and k counts
    earlier uses of that operator in that module (e.g. ``attn.c_attn:linear#0``, ``attn:view#2``)."""
    seen: dict[tuple[str, str], int] = {}
    keys = {}
    for n in nodes:
        module = str(n.meta.get("autopar.module", ""))
        rel = module[len(prefix) :].lstrip(".") if module.startswith(prefix) else module
        op = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        k = seen.get((rel, op), 0)
        seen[rel, op] = k + 1
        keys[n.name] = f"{rel}:{op}#{k}"
    return keys


__all__ = [
    "GraphIndex",
    "index_graph",
    "layer_nodes",
    "needs_grad",
    "op_keys",
    "produces_tensor",
]
