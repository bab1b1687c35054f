"""Attention in a captured graph: the keys and values before a grouped-query repeat.

Models with grouped-query attention (Llama 3: 8 key/value heads for 32–128 query heads) often
repeat K and V to the query heads before ``scaled_dot_product_attention``, as Hugging Face's
``repeat_kv`` and the zoo's Llama do: ``x[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv·rep,
s, d)``, i.e. kv-head i serves query heads i·rep … i·rep + rep − 1 (``repeat_interleave`` on the
head dim). What attention really needs of other positions is the tensor before that repeat: what
context parallelism exchanges (``passes.context_parallel``) and the cost model prices
(``cost_models.context``), as Llama 3 did (Dubey et al. 2024 §3.3.2: K/V all-gathered, small
under GQA).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
MERGES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def unrepeated(x: fx.Node) -> tuple[fx.Node, int]:
    """(the tensor ``x`` repeats, the repeat) where ``x`` (b, kv·rep, s, d) is
    ``merge(expand(unsqueeze(pre, 2), (b, kv, rep, s, d)))`` of ``pre`` (b, kv, s, d), a clone or
    contiguous copy allowed last; else (``x``, 1)."""
    node = x
    if node.target in (aten.clone.default, aten.contiguous.default) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    expand = node.args[0] if node.target in MERGES and node.args else None
    if not (isinstance(expand, fx.Node) and expand.target == aten.expand.default):
        return x, 1
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target == aten.unsqueeze.default):
        return x, 1
    pre = unsqueeze.args[0]
    out, mid = _shape(x), _shape(expand)
    before = _shape(pre) if isinstance(pre, fx.Node) else None
    if unsqueeze.args[1] != 2 or out is None or mid is None or before is None or len(before) != 4:
        return x, 1
    b, kv, s, d = before
    rep = mid[2]
    if mid != (b, kv, rep, s, d) or out != (b, kv * rep, s, d):
        return x, 1
    assert isinstance(pre, fx.Node)
    return pre, rep


def kv_width(gm: fx.GraphModule) -> int | None:
    """Channels per token of the keys the first attention reads before any grouped-query repeat:
    key/value heads × head dim (None without a ``scaled_dot_product_attention``)."""
    for n in gm.graph.nodes:
        if n.target is SDPA and isinstance(n.args[1], fx.Node):
            shape = _shape(unrepeated(n.args[1])[0])
            return shape[1] * shape[3] if shape is not None and len(shape) == 4 else None
    return None


__all__ = ["SDPA", "kv_width", "unrepeated"]
