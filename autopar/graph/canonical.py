"""One spelling per operation: rewrites of an exported graph that change no value's meaning.

Model code writes the same operation in several ways; the passes that split operators
(``passes.tp_rules``) and the cost models read one. ``canonical(gm) -> gm`` runs right after
export, before the graph is annotated:

- ``x @ W.T`` with W a 2-D parameter (Falcon's ``FalconLinear``, much research code) is
  ``F.linear(x, W)``: ``aten.matmul(x, aten.t(W))`` (or ``numpy_T``, ``transpose(0, 1)``,
  ``permute(1, 0)``) becomes ``aten.linear(x, W)``;
- a bias added after it, ``linear(x, W) + b`` with b a 1-D parameter of the output width,
  becomes ``aten.linear(x, W, b)``.

Both compute the same product with the same operands (``linear`` is ``x @ W.T + b``); the
float result may round differently in its last bit, as any change of GEMM kernel does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

_TRANSPOSES = (aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default)


def _transposed_param(n: object) -> fx.Node | None:
    """The 2-D parameter ``n`` transposes (``W.T`` in any spelling), else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _TRANSPOSES):
        return None
    src = n.args[0]
    if not (isinstance(src, fx.Node) and src.op == "get_attr" and _ndim(src) == 2):
        return None
    if n.target == aten.transpose.int and sorted(_dims(n.args[1:3])) != [0, 1]:
        return None
    if n.target == aten.permute.default and _dims(n.args[1]) != [1, 0]:
        return None
    return src


def _dims(args: Any) -> list[int]:
    """Dim arguments of a 2-D transpose or permute, made non-negative."""
    return [int(d) % 2 for d in args]


def _ndim(n: fx.Node) -> int | None:
    val = n.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def _bias_of(node: fx.Node) -> fx.Node | None:
    """The 1-D parameter a lone ``add`` user adds to ``node``'s output features, else None."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.target != aten.add.Tensor or user.kwargs or len(user.args) != 2 or user.args[0] is not node:
        return None
    b, out = user.args[1], node.meta.get("val")
    if not (isinstance(b, fx.Node) and b.op == "get_attr" and isinstance(out, torch.Tensor)):
        return None
    bval = b.meta.get("val")
    if not (isinstance(bval, torch.Tensor) and bval.dim() == 1 and bval.shape[0] == out.shape[-1]):
        return None
    return b if bval.dtype == out.dtype else None  # same shape and dtype: node's meta stays right


def fold_linears(gm: fx.GraphModule) -> fx.GraphModule:
    """``x @ W.T`` (+ b) → ``linear(x, W, b)`` in place (see the module docstring)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.matmul.default or len(node.args) != 2:
            continue
        weight = _transposed_param(node.args[1])
        x = node.args[0]
        if weight is None or not isinstance(x, fx.Node) or _ndim(x) in (None, 0, 1):
            continue
        transpose = node.args[1]
        node.target, node.args = aten.linear.default, (x, weight)
        bias = _bias_of(node)
        if bias is not None:
            (add,) = node.users
            node.args = (x, weight, bias)
            add.replace_all_uses_with(node)
            graph.erase_node(add)
        assert isinstance(transpose, fx.Node)
        if not transpose.users:
            graph.erase_node(transpose)
    graph.lint()
    gm.recompile()
    return gm


def canonical(gm: fx.GraphModule) -> fx.GraphModule:
    """Every rewrite of this module, in order."""
    return fold_linears(gm)


__all__ = ["canonical", "fold_linears"]
