"""A model's profile at any micro-batch, from its captures at micro-batch 1 and 2.

Every quantity a ``ModelProfile`` holds is affine in the micro-batch (FLOPs and activation
bytes scale with it; weight reads and per-model buffers such as a causal mask do not), so the
planner captures twice and prices every micro-batch size it tries by arithmetic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autopar.cost_models.kernels import OpCost
from autopar.cost_models.profile import CallCost, LayerCost, ModelProfile


def at_micro_batch(one: ModelProfile, two: ModelProfile, b: float) -> ModelProfile:
    """The profile at micro-batch ``b`` from captures at micro-batch 1 and 2.

    Every quantity is affine in the micro-batch (FLOPs and activation bytes
    scale with it; weight reads and per-model buffers such as a causal mask
    do not), so x(b) = x(1) + (b − 1)·(x(2) − x(1)) is exact. Saves a capture
    per micro-batch size the planner tries.
    """
    assert one.micro_batch == 1 and two.micro_batch == 2 and one.layers == two.layers

    def lin(x1: float, x2: float) -> int:
        return round(x1 + (b - 1) * (x2 - x1))

    types = {}
    for name, a in one.layer_types.items():
        c = two.layer_types[name]
        assert len(a.ops) == len(c.ops), name
        types[name] = LayerCost(
            name=name,
            ops=_ops_at(a.ops, c.ops, lin),
            fused_ops=_ops_at(a.fused_ops, c.fused_ops, lin),
            fwd_flops=lin(a.fwd_flops, c.fwd_flops),
            bwd_flops=lin(a.bwd_flops, c.bwd_flops),
            params=a.params,
            saved_stream_bytes=lin(a.saved_stream_bytes, c.saved_stream_bytes),
            saved_sharded_bytes=lin(a.saved_sharded_bytes, c.saved_sharded_bytes),
            saved_quadratic_bytes=lin(a.saved_quadratic_bytes, c.saved_quadratic_bytes),
            saved_expert_bytes=lin(a.saved_expert_bytes, c.saved_expert_bytes),
            quadratic_flops=lin(a.quadratic_flops, c.quadratic_flops),
            tp_reduce_bytes=lin(a.tp_reduce_bytes, c.tp_reduce_bytes),
            tp_reduce_count=a.tp_reduce_count,
            calls=_calls_at(a.calls, c.calls, lin),
            matrix_params=a.matrix_params,
            matrix_sides=a.matrix_sides,
            experts=a.experts,
            expert_params=a.expert_params,
            tied_params=a.tied_params,
            a2a_bytes=lin(a.a2a_bytes, c.a2a_bytes),
            weight_out_bytes=tuple(
                lin(x, y) for x, y in zip(a.weight_out_bytes, c.weight_out_bytes, strict=True)
            ),  # type: ignore[arg-type]
        )
    return dataclasses.replace(one, micro_batch=b, layer_types=types)


def _ops_at(
    one: tuple[OpCost, ...], two: tuple[OpCost, ...], lin: Callable[[float, float], int]
) -> tuple[OpCost, ...]:
    """Kernels at micro-batch b from the same kernels at 1 and 2 (affine in b); where the two
    captures' kernels differ in number, those at 2 scaled by b/2."""
    if len(one) != len(two):
        one = tuple(
            dataclasses.replace(
                y, flops=y.flops // 2, kernel_flops=y.kernel_flops // 2, mem_bytes=y.mem_bytes // 2
            )
            for y in two
        )
    return tuple(
        OpCost(
            flops=lin(x.flops, y.flops),
            kernel_flops=lin(x.kernel_flops, y.kernel_flops),
            mem_bytes=lin(x.mem_bytes, y.mem_bytes),
            stream=x.stream,
            attention=x.attention,
        )
        for x, y in zip(one, two, strict=True)
    )


def _calls_at(
    one: tuple[CallCost, ...], two: tuple[CallCost, ...], lin: Callable[[float, float], int]
) -> tuple[CallCost, ...]:
    """The calls at micro-batch b from those at 1 and 2 (affine, as every other quantity); where
    the two captures dispatched differently (a size-1 batch dim may take another kernel), the
    calls at 2 scaled by b/2."""
    if [x.key for x in one] != [y.key for y in two]:
        one = tuple(
            dataclasses.replace(
                y,
                flops=y.flops // 2,
                kernel_flops=y.kernel_flops // 2,
                mem_bytes=y.mem_bytes // 2,
                out_bytes=y.out_bytes // 2,
            )
            for y in two
        )
    return tuple(
        dataclasses.replace(
            y,
            flops=lin(x.flops, y.flops),
            kernel_flops=lin(x.kernel_flops, y.kernel_flops),
            mem_bytes=lin(x.mem_bytes, y.mem_bytes),
            out_bytes=lin(x.out_bytes, y.out_bytes),
        )
        for x, y in zip(one, two, strict=True)
    )
