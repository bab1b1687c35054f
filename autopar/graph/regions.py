"""Grad-mode regions of an exported graph made flat: ``inline_grad_regions(gm) -> gm``.

A model that computes part of its forward under ``torch.no_grad()`` (PhiMoE's router
``sparsemixer`` masks its scores so) is exported by torch.export (non-strict, training IR)
with each such region as a higher-order op, ``wrap_with_set_grad_enabled(False, submod, *xs)``,
whose body is a submodule of the exported program. Every later pass reads one flat graph of
ATen ops, so each region's body is copied into the graph in its place:

- ``enabled=False``: every floating-point tensor leaving the region goes through
  ``aten.detach``, so no gradient flows back through it, as under ``no_grad``; the body's
  own values are computed as they were (the same ops on the same inputs);
- ``enabled=True`` inside a graph that trains with grad on: the body as it is.

A region under ``torch.autocast`` (``wrap_with_autocast``) changes the dtypes its ops compute
in; it is refused in one line (``CaptureError``) rather than run in the wrong precision.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autopar.errors import CaptureError

_SET_GRAD, _AUTOCAST = "wrap_with_set_grad_enabled", "wrap_with_autocast"


def _hop(node: fx.Node) -> str | None:
    """The higher-order op's name for a call of one (``wrap_with_…``), else None."""
    return getattr(node.target, "_name", None) if node.op == "call_function" else None


def inline_grad_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every ``wrap_with_set_grad_enabled`` region's body in its place (nested
    regions too); ``CaptureError`` for an autocast region."""
    changed = False
    for node in list(gm.graph.nodes):
        name = _hop(node)
        if name == _AUTOCAST:
            raise CaptureError(
                "the model runs part of its forward under torch.autocast, which autopar cannot "
                "capture as one graph; remove the autocast context (autopar applies the plan's "
                "precision itself)"
            )
        if name != _SET_GRAD:
            continue
        enabled, sub_node, *inputs = node.args
        assert isinstance(sub_node, fx.Node) and sub_node.op == "get_attr", node.format_node()
        sub = inline_grad_regions(getattr(gm, str(sub_node.target)))
        with gm.graph.inserting_before(node):
            outs = _copy_body(gm.graph, sub, inputs, detach=not enabled)
        for user in list(node.users):
            assert user.target is operator.getitem, user.format_node()  # a region returns a tuple
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not sub_node.users:
            gm.graph.erase_node(sub_node)
            delattr(gm, str(sub_node.target))
        changed = True
    if changed:
        gm.recompile()
    return gm


def _copy_body(graph: fx.Graph, sub: fx.GraphModule, inputs: list[Any], *, detach: bool) -> list[Any]:
    """Copies of ``sub``'s nodes on ``inputs`` (at the graph's insertion point), and what its
    output returns (each floating-point tensor detached where ``detach``)."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    returned: tuple[Any, ...] = ()
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "output":
            returned = tuple(n.args[0])
        else:
            assert n.op == "call_function", n.format_node()  # nested regions are inlined already
            env[n] = graph.node_copy(n, lambda x: env[x])
    outs = [env[r] if isinstance(r, fx.Node) else r for r in returned]
    return [_detached(graph, o) if detach else o for o in outs]


def _detached(graph: fx.Graph, value: Any) -> Any:
    """``aten.detach(value)`` for a floating-point tensor node, else ``value``."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return value
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta = dict(value.meta)
    return out


__all__ = ["inline_grad_regions"]
