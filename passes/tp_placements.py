"""Placements on the tensor-parallel axis and the operator facts every TP rule reads.

A tensor on the TP axis is in one of three placements:

- ``R``   replicated: every rank holds the whole tensor;
- ``S(d)`` sharded on dim d: rank r holds the r-th of t equal slices;
- ``Rf``  (an *input* requirement only) replicated, consumed by an operator whose
  weights are sharded, so the gradient flowing back is a partial sum that must be
  all-reduced — Megatron's ``f`` operator (Shoeybi et al. 2019, §3, Fig. 3).

``OpStrategy`` is one way to run one operator; ``tp_rules`` lists them per operator kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

R, RF = "R", "Rf"


def S(dim: int) -> str:
    """The placement 'sharded on dim ``dim``' (dims counted from 0)."""
    return f"S{dim}"


def shard_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


@dataclass(frozen=True, kw_only=True)
class OpStrategy:
    """One way to run one operator on the TP axis."""

    name: str
    """``replicate``, ``column``, ``row``, ``heads``, ``follow`` …: shown in plans."""
    out: str
    """Placement of the output (for tuple outputs: of every element)."""
    inputs: tuple[str, ...]
    """Required placement of each tensor argument, in the order of ``tensor_args``."""
    compute_fraction: float
    """Share of the operator's FLOPs and bytes each rank does: 1 or 1/t."""
    reduce_output: bool = False
    """The operator reduces its partial output itself: all-reduce to ``R`` (row-parallel linear), or
    reduce-scatter to ``S(1)`` (row-parallel under sequence parallelism)."""
    reduce_param_grads: bool = False
    """The operator runs on a token shard with replicated parameters (a norm under sequence
    parallelism): their gradients are partial sums, all-reduced over the TP group once per step."""
    params: dict[str, str] = field(default_factory=dict)
    """Placement of each parameter argument (``weight``/``bias``) when sharded."""


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs (graph nodes with a shape), in argument order, flattening lists."""
    out: list[fx.Node] = []
    for a in node.args:
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(x, fx.Node) and x.op != "get_attr" and shape_of(x) is not None:
                out.append(x)
    return out


def int_arg(a: Any) -> int:
    """An operator's integer argument (a dim, a size) as an int (fx types arguments loosely)."""
    return int(a)


def shape_of(n: fx.Node) -> tuple[int, ...] | None:
    s = n.meta.get("autopar.shape")
    if isinstance(s, tuple) and all(isinstance(d, int) for d in s):
        return s
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def out_shape(n: fx.Node) -> tuple[int, ...] | None:
    """Shape of the node's (first) output."""
    val = n.meta.get("val")
    if isinstance(val, (list, tuple)) and val and isinstance(val[0], torch.Tensor):
        return tuple(val[0].shape)
    return shape_of(n)


LINEAR_ARGS = {aten.linear.default: (0, 1, 2, False), aten.addmm.default: (1, 2, 0, True)}
"""Operator → (input index, weight index, bias index, weight stored (in, out))."""


def linear_parts(node: fx.Node) -> tuple[Any, Any, Any, bool]:
    """(input, weight, bias or None, weight is (in, out)) of a linear-kind node."""
    xi, wi, bi, transposed = LINEAR_ARGS[node.target]  # type: ignore[index]
    args = list(node.args) + [None] * 3
    return args[xi], args[wi], args[bi], transposed


__all__ = [
    "LINEAR_ARGS",
    "RF",
    "OpStrategy",
    "R",
    "S",
    "int_arg",
    "linear_parts",
    "out_shape",
    "shape_of",
    "shard_dim",
    "tensor_args",
]
