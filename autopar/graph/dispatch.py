"""The kernels a graph node dispatches to, as selective activation checkpointing sees them.

A node of the captured graph (``aten.linear``) runs as several ATen calls below autograd
(``t``, ``view``, ``mm``, ``_unsafe_view``). Selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) decides per such call whether
its output is kept for backward or recomputed, so a recompute policy is written in their terms:
``op_name#k``, the k-th call of that operator in one forward of the block. ``DispatchCall`` is
one call as the capture records it (``node.meta["autopar.dispatch"]``); ``op_name`` is the one
spelling the capture and the runtime's policy share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ATTENTION = "sdpa"
"""Every fused attention kernel (CPU flash, CUDA flash, memory-efficient, cuDNN) has one name:
a plan made on a CPU capture runs on GPUs."""


@dataclass(frozen=True)
class DispatchCall:
    """One ATen call of a node's forward, below autograd."""

    op: str
    """``op_name`` of the operator."""
    flops: int
    """FLOPs of the call (PyTorch's formula table)."""
    mem_bytes: int
    """Bytes of its tensor inputs and outputs (0 for a call that returns a view of an input)."""
    out_bytes: int
    """Bytes of the storage its outputs own (what keeping them costs; 0 for views)."""
    keepable: bool
    """Whether a policy may keep its output: it owns new storage, mutates nothing, and no later
    call writes into it (selective checkpointing refuses a kept tensor changed in place)."""


def op_name(func: Any) -> str:
    """The name a policy uses for ``func`` (an ``OpOverload``): ``mm``, ``mul``, ``sdpa``,
    ``_c10d_functional.all_reduce`` (namespace kept outside ``aten``)."""
    packet = str(func._overloadpacket) if hasattr(func, "_overloadpacket") else str(func)
    if "scaled_dot_product" in packet and "backward" not in packet:
        return ATTENTION
    return packet.removeprefix("aten.")


def fused_attention(n: Any) -> bool:
    """Does graph node ``n`` run a fused attention kernel (``autopar.dispatch`` holds an
    ``sdpa`` call)? Explicit attention (matmul, softmax, matmul) does not."""
    return any(c.op == ATTENTION for c in n.meta.get("autopar.dispatch", ()))


def attention_call(key: str) -> bool:
    """Is ``op#k`` a call of a fused attention kernel?"""
    return key.partition("#")[0] == ATTENTION


def ignored(func: Any) -> bool:
    """Calls selective checkpointing does not see (``SAC_IGNORED_OPS``: detach, size queries)."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    return func in SAC_IGNORED_OPS


def _tensors(x: Any) -> list[torch.Tensor]:
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(x)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def dispatch_call(func: Any, args: Any, kwargs: Any, out: Any, flops: int) -> DispatchCall:
    """Record one call: its FLOPs, the bytes it moves and the bytes its outputs own."""
    inputs = _tensors((args, kwargs))
    outputs = _tensors(out)
    seen = {_storage(t) for t in inputs}
    owned: dict[int, int] = {}
    for t in outputs:
        key = _storage(t)
        if key not in seen:
            owned.setdefault(key, t.untyped_storage().nbytes())
    schema = getattr(func, "_schema", None)
    mutates = bool(schema is not None and schema.is_mutable)
    aliases = len(owned) < len({_storage(t) for t in outputs})
    moved = 0 if aliases else sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
    return DispatchCall(
        op=op_name(func),
        flops=flops,
        mem_bytes=moved,
        out_bytes=sum(owned.values()),
        keepable=bool(owned) and not aliases and not mutates,
    )


def written(func: Any, args: Any, kwargs: Any) -> list[int]:
    """Storages an in-place or ``out=`` call writes (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [_storage(t) for t in _tensors(value)]
    return out


def storages(x: Any) -> set[int]:
    """The storages of the tensors in ``x``."""
    return {_storage(t) for t in _tensors(x)}


def numbered(calls: list[DispatchCall]) -> list[str]:
    """``op#k`` of each call: k counts the earlier calls of the same operator (the runtime's
    policy counts the same way, per forward of the block)."""
    seen: dict[str, int] = {}
    keys = []
    for c in calls:
        k = seen.get(c.op, 0)
        seen[c.op] = k + 1
        keys.append(f"{c.op}#{k}")
    return keys


__all__ = ["DispatchCall", "dispatch_call", "ignored", "numbered", "op_name", "storages", "written"]
