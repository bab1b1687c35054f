"""What a per-operator recompute policy costs: the bytes a block keeps and the seconds it redoes.

Selective activation checkpointing (PyTorch's ``create_selective_checkpoint_contexts``, the
policy torchtitan's per-op AC uses) runs the block's forward under a dispatch mode that caches
the outputs of the calls the policy keeps and drops everything else autograd would save; in
backward the forward runs again, every call not kept recomputed, every kept one read from the
cache. So, per micro-batch, for a policy keeping the calls K of the block's calls C:

    kept bytes      = block input + Σ_{c ∈ K} out_bytes(c)
    recompute time  = Σ_{c ∈ C \\ K} roofline(c)       (Williams et al. 2009, as ``compute``)

(nothing is skipped for being unused: eager recomputation reruns the forward as written). The
input is what full recomputation keeps too (Korthikanti et al. 2022 §5: 2sbh). Under tensor
parallelism t an output ``sharded`` by it costs 1/t, a ``stream`` output 1/t only with sequence
parallelism, a row-parallel matmul's ``whole`` partial sums their full size; compute divides
by t except the stream's bytes, as in ``compute.layer_forward_s``.
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.cluster import DeviceSpec
from autopar.cost_models.profile import CallCost, LayerCost
from autopar.graph.dispatch import attention_call


def output_share(placement: str, *, tp: int, sp: bool) -> float:
    """Share of an output's bytes one rank holds (``CallCost.placement``)."""
    if placement == "sharded" or (placement == "stream" and sp):
        return 1 / tp
    return 1.0


def kept_bytes(
    layer: LayerCost,
    keep: frozenset[str],
    *,
    tp: int,
    sp: bool,
    input_bytes: float,
    measured: Mapping[str, int] | None = None,
) -> float:
    """Bytes one block keeps for backward per micro-batch on one GPU under a policy keeping the
    calls ``keep`` (``op#k`` names): its input (÷t under SP) plus the kept outputs, each as
    ``measured`` on one GPU at this width where given (``autopar profile``), else captured (the
    block's output costs nothing either way: the next block keeps it as its input)."""
    measured = measured or {}
    kept = sum(
        measured[c.key]
        if c.key in measured and c.out_bytes
        else c.out_bytes * output_share(c.placement, tp=tp, sp=sp)
        for c in layer.calls
        if c.key in keep
    )
    return input_bytes / (tp if sp else 1) + kept


def call_time_s(call: CallCost, device: DeviceSpec, dtype: str, *, tp: int, stream_share: float) -> float:
    """Roofline seconds of one call on one GPU: kernel FLOPs ÷ t at the achievable rate, or its
    bytes (÷ t, the stream's × ``stream_share``) at HBM bandwidth, whichever is longer."""
    share = stream_share if call.placement == "stream" else 1 / tp
    return max(
        call.kernel_flops / tp / device.achievable_flops(dtype, attention=attention_call(call.key)),
        call.mem_bytes * share / device.hbm_bandwidth_bytes_per_s,
    )


def recompute_s(
    layer: LayerCost, keep: frozenset[str], device: DeviceSpec, dtype: str, *, tp: int, stream_share: float
) -> float:
    """Seconds the backward spends recomputing one block per micro-batch: every call not kept."""
    return sum(
        call_time_s(c, device, dtype, tp=tp, stream_share=stream_share)
        for c in layer.calls
        if c.key not in keep
    )


def recompute_flops(layer: LayerCost, keep: frozenset[str]) -> float:
    """FLOPs the backward redoes for one block (whole layer, for hardware FLOP/s)."""
    return float(sum(c.flops for c in layer.calls if c.key not in keep))


def policy_costs(
    layer: LayerCost,
    keep: frozenset[str],
    device: DeviceSpec,
    dtype: str,
    *,
    tp: int,
    sp: bool,
    stream_share: float,
    input_bytes: float,
    measured_fwd_s: float | None,
    measured_bytes: Mapping[str, int] | None = None,
) -> tuple[float, float, float]:
    """(recompute seconds, bytes kept, recompute FLOPs) of one block per micro-batch under the
    policy keeping ``keep``. With a measured forward, the recompute time is that forward times
    the roofline's share of it the policy redoes; with measured call bytes, those are kept."""
    redo = recompute_s(layer, keep, device, dtype, tp=tp, stream_share=stream_share)
    if measured_fwd_s is not None:
        whole = recompute_s(layer, frozenset(), device, dtype, tp=tp, stream_share=stream_share)
        redo = measured_fwd_s * redo / whole if whole else 0.0
    act = kept_bytes(layer, keep, tp=tp, sp=sp, input_bytes=input_bytes, measured=measured_bytes)
    return redo, act, recompute_flops(layer, keep)


__all__ = ["call_time_s", "kept_bytes", "output_share", "policy_costs", "recompute_flops", "recompute_s"]
