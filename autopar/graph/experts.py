"""Routed experts in a captured graph: each mixture-of-experts layer's grouped matmuls.

Hugging Face's MoE models (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3) and torchtitan run a
layer's routed experts as grouped matmuls: the layer's token rows, sorted by the expert each
was routed to, times the experts' stacked weights (E, K, N), cut by ``offs`` (the cumulative
rows per expert): ``aten._grouped_mm``, transformers' ``grouped_mm_fallback`` (its CPU and
non-bf16 path) or the zoo's ``autopar::grouped_mm``, which the capture records as one node
each. The grouped matmuls of one layer share one ``offs`` node: that is how a layer's experts
are found (``expert_groups``), for the cost model (what each layer's experts hold and
exchange) and for expert parallelism (``passes.expert_parallel``, which moves rows to the rank
holding their expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopar.graph.dag import digraph, downstream, upstream

GROUPED_MM = (
    "aten::_grouped_mm",
    "aten::grouped_mm",
    "transformers::grouped_mm_fallback",
    "autopar::grouped_mm",  # the zoo's (``zoo.grouped``)
)
"""Operators that multiply expert-sorted rows by stacked expert weights: (rows, weights, offs)."""

WEIGHT_VIEWS = ("aten::transpose", "aten::permute", "aten::t", "aten::to", "aten::_to_copy", "aten::alias")
"""What may stand between an expert weight and the grouped matmul reading it (dim 0 untouched
by ``transpose(-2, -1)`` and dtype casts; a ``permute`` is checked to keep dim 0 first)."""


def op_name(target: Any) -> str:
    """``aten::linear`` for ``aten.linear.default``: an operator's qualified name."""
    packet = getattr(target, "_overloadpacket", target)
    return str(getattr(packet, "_qualified_op_name", ""))


def is_grouped_mm(node: fx.Node) -> bool:
    """Whether ``node`` is a grouped matmul of expert-sorted rows (``GROUPED_MM``)."""
    return node.op == "call_function" and op_name(node.target) in GROUPED_MM


@dataclass(frozen=True)
class ExpertGroup:
    """One MoE layer's routed experts in a graph."""

    matmuls: tuple[fx.Node, ...]
    """Its grouped matmuls, in graph order (e.g. gate-up, then down)."""
    offs: fx.Node
    """Cumulative rows per expert, shared by the matmuls: shape (E,)."""
    weights: tuple[fx.Node, ...]
    """The get_attr nodes of the stacked expert weights, (E, …) each."""
    experts: int
    """E, routed experts in the layer."""
    rows: int
    """Rows the first matmul multiplies (tokens × top-k of the captured micro-batch)."""
    path: str
    """The module holding the weights (their common owner), e.g. ``model.layers.0.mlp.experts``."""

    @property
    def first(self) -> fx.Node:
        return self.matmuls[0]

    @property
    def last(self) -> fx.Node:
        return self.matmuls[-1]

    @property
    def entries(self) -> tuple[fx.Node, ...]:
        """The matmuls that read the layer's sorted rows (one fused gate-up matmul in Hugging
        Face's experts; the gate's and the up projection's in torchtitan's and the zoo's)."""
        return tuple(mm for mm in self.matmuls if mm.args[0] is self.first.args[0])


def weight_source(node: fx.Node) -> fx.Node | None:
    """The get_attr an expert matmul's weight argument reads, through ``WEIGHT_VIEWS``; None if
    it is computed otherwise."""
    while (node.op == "call_function" and op_name(node.target) in WEIGHT_VIEWS) or (
        node.op == "call_method" and node.target == "to_local"  # a DTensor weight (the TP pass's)
    ):
        if op_name(node.target) == "aten::permute" and next(iter(node.args[1])) not in (0, -3):  # type: ignore[arg-type]
            return None
        node = node.args[0]  # type: ignore[assignment]
    return node if node.op == "get_attr" else None


def _shape(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()


def expert_groups(gm: fx.GraphModule) -> list[ExpertGroup]:
    """Every MoE layer's experts in ``gm``: grouped matmuls grouped by their ``offs``, in graph
    order. A grouped matmul whose weight is not a stacked parameter (E, …) read directly is not
    an expert layer's (a weight gradient's form, 2-D × 2-D) and is left out."""
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_grouped_mm(n) and len(n.args) > 2 and isinstance(n.args[2], fx.Node):
            by_offs.setdefault(n.args[2], []).append(n)
    groups = []
    for offs, mms in by_offs.items():
        sources = [weight_source(mm.args[1]) for mm in mms]  # type: ignore[arg-type]
        experts = _shape(offs)[0] if _shape(offs) else 0
        if not experts or any(s is None or _shape(s)[:1] != (experts,) for s in sources):
            continue
        weights = tuple(s for s in sources if s is not None)
        path = _common_prefix({str(w.target).rpartition(".")[0] for w in weights})
        groups.append(
            ExpertGroup(
                matmuls=tuple(mms),
                offs=offs,
                weights=weights,
                experts=experts,
                rows=_shape(mms[0].args[0])[0],
                path=path,
            )
        )
    return groups


def _common_prefix(paths: set[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def row_region(gm: fx.GraphModule, group: ExpertGroup) -> set[fx.Node]:
    """The nodes computed from the rows' matmuls up to the last matmul's output (all included):
    what runs on the rows of the rank holding their expert under expert parallelism."""
    g = digraph(gm.graph)
    return downstream(g, list(group.entries)) & upstream(g, [group.last])


__all__ = [
    "GROUPED_MM",
    "ExpertGroup",
    "expert_groups",
    "is_grouped_mm",
    "op_name",
    "row_region",
    "weight_source",
]
