"""A graph's nodes as the kernels that run them: eager, one kernel per operator, or compiled,
each chain of elementwise and reduction operators between matmuls one fused kernel
(``fusion_groups``). ``OpCost`` is what the roofline prices (``compute.layer_forward_s``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.graph.dispatch import fused_attention

if TYPE_CHECKING:
    import torch.fx as fx


@dataclass(frozen=True, kw_only=True)
class OpCost:
    """One kernel of the forward pass."""

    flops: int
    """Forward FLOPs (split by TP)."""
    kernel_flops: int
    """Forward FLOPs the kernel executes (``autopar.kernel_flops``: a causal flash attention
    skips about half of ``flops``); time is priced from these."""
    mem_bytes: int
    """Bytes read and written."""
    stream: bool
    """An op on the residual stream (b, s, h) with no FLOPs (norm, residual add):
    replicated by tensor parallelism, split by sequence parallelism."""
    attention: bool = False
    """A fused attention kernel (``graph.dispatch.fused_attention``): priced at the device's
    attention efficiency, its backward at ``compute.FLASH_BACKWARD_RATIO`` × its forward."""
    expert: bool = False
    """A routed experts' grouped matmul (``autopar.expert``): under expert parallelism the
    busiest rank runs ``Strategy.expert_skew`` × its even share of rows."""


def elem_bytes_of(dtype: str) -> int:
    """Bytes per element of a dtype named as ``autopar.dtype`` (``float32``, ``bfloat16``)."""
    return {"float64": 8, "float32": 4, "int64": 8, "int32": 4}.get(dtype, 2)


def shape_of(n: fx.Node) -> tuple[int, ...]:
    return tuple(n.meta.get("autopar.shape", ()))


def is_stream_op(n: fx.Node, h: int | None) -> bool:
    """An operator on the residual stream (``OpCost.stream``): no FLOPs, an output (…, h)."""
    shape = shape_of(n)
    return not n.meta.get("autopar.fwd_flops", 0) and len(shape) >= 2 and shape[-1] == h


def fusion_groups(members: list[fx.Node], h: int) -> tuple[OpCost, ...]:
    """A layer's forward kernels as a compiler that fuses elementwise and reduction ops runs them.

    Inductor (Ansel et al. 2024, "PyTorch 2", §5: pointwise, reduction and scatter ops fuse
    into one kernel; matmuls and attention are external library calls) runs each operator with
    FLOPs (a matmul, a fused attention) as it is, and each connected chain of FLOP-free
    operators between them as one kernel. That kernel reads the tensors its chain takes from
    outside it once and writes only what leaves the chain, so its bytes are

        Σ bytes(inputs from outside the chain) + Σ bytes(outputs read outside the chain or by none),

    not Σ over its ops of (inputs + outputs) as eager kernels move them. A chain is on the
    residual stream (``OpCost.stream``) when most of its bytes come from ops that are. Kernels in
    the order of their first operator."""
    mine = {n for n in members if n.op == "call_function"}
    fusible = {n for n in mine if not n.meta.get("autopar.fwd_flops")}
    root: dict[fx.Node, fx.Node] = {n: n for n in fusible}

    def find(n: fx.Node) -> fx.Node:
        while root[n] is not n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for n in fusible:  # a chain: FLOP-free ops joined by the tensors they pass each other
        for a in n.all_input_nodes:
            if a in fusible:
                root[find(a)] = find(n)
    chains: dict[fx.Node, list[fx.Node]] = {}
    for n in members:
        if n in fusible:
            chains.setdefault(find(n), []).append(n)
    kernels: list[tuple[int, OpCost]] = []
    order = {n: i for i, n in enumerate(members)}
    for chain in chains.values():
        inside = set(chain)
        reads = {a for n in chain for a in n.all_input_nodes if a not in inside}
        writes = [n for n in chain if not n.users or any(u not in inside for u in n.users)]
        moved = sum(out_bytes(a) for a in reads) + sum(out_bytes(n) for n in writes)
        if not moved or not any(n.meta.get("autopar.mem_bytes") for n in chain):
            continue  # views only: no kernel
        on_stream = sum(int(n.meta.get("autopar.mem_bytes", 0)) for n in chain if is_stream_op(n, h))
        total = sum(int(n.meta.get("autopar.mem_bytes", 0)) for n in chain)
        op = OpCost(flops=0, kernel_flops=0, mem_bytes=moved, stream=2 * on_stream >= total)
        kernels.append((order[chain[0]], op))
    for n in mine - fusible:
        kernels.append((order[n], op_cost(n, h)))
    return tuple(op for _, op in sorted(kernels, key=lambda k: k[0]))


def out_bytes(n: fx.Node) -> int:
    """Bytes of a node's outputs (``autopar.out_bytes``; from shape and dtype where missing)."""
    if "autopar.out_bytes" in n.meta:
        return int(n.meta["autopar.out_bytes"])
    return numel(shape_of(n)) * node_elem_bytes(n) if shape_of(n) else 0


def op_cost(n: fx.Node, h: int) -> OpCost:
    """One node as the kernel it runs (``OpCost``)."""
    flops = int(n.meta.get("autopar.fwd_flops", 0))
    return OpCost(
        flops=flops,
        kernel_flops=int(n.meta.get("autopar.kernel_flops", flops)),
        mem_bytes=int(n.meta.get("autopar.mem_bytes", 0)),
        stream=is_stream_op(n, h),
        attention=fused_attention(n),
        expert=bool(n.meta.get("autopar.expert", False)),
    )


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def node_elem_bytes(n: fx.Node) -> int:
    return elem_bytes_of(str(n.meta.get("autopar.dtype")))


__all__ = [
    "OpCost",
    "elem_bytes_of",
    "fusion_groups",
    "is_stream_op",
    "node_elem_bytes",
    "numel",
    "op_cost",
    "shape_of",
]
