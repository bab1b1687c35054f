"""The data-parallel / ZeRO collectives of a strategy as ``Terms`` carries them: each one's
latency and seconds per byte at the message size it runs (``comm.coefficients``), the DDP
buckets, and the overlap parameters (``dp_overlap`` prices what compute does not hide)."""

from __future__ import annotations

from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models import comm
from autopar.cost_models import memory as mem
from autopar.cost_models.buckets import BUCKET_GRAD_BYTES, ddp_bucket_bytes, ddp_buckets, last_bucket_s
from autopar.cost_models.compression import POWERSGD_LATENCY_FACTOR, wire_bytes_per_param
from autopar.cost_models.profile import ModelProfile
from autopar.strategy import Strategy


def dp_coefficients(
    cluster: Cluster, st: Strategy, unit_bytes: float, unit_grad_bytes: float, bucket_bytes: float
) -> tuple[tuple[float, float], ...]:
    """(latency s, s per byte) of the DP group's all-gather, reduce-scatter and all-reduce; the
    reductions on bf16 tensors when the plan reduces in bf16 (measured apart by profile-comm).
    Each as it runs its messages (``comm.coefficients``): a ZeRO unit's ``unit_bytes`` (one
    block's weights) for the gathers, its ``unit_grad_bytes`` (their gradients on the wire) for
    the reduce-scatters, a DDP bucket's ``bucket_bytes`` for the all-reduce.

    HSDP (``Strategy.dp_replicate`` r > 1, shard groups of k = dp / r consecutive DP ranks): the
    all-gather runs within a shard group (k ranks, stride tp), and each reduce-scatter of S bytes
    within it is followed by an all-reduce of its S/k output across the r groups (stride tp·k),
    as FSDP2 reduces each unit under HSDP: α_r = α_rs(k) + α_ar(r), σ_r = σ_rs(k) + σ_ar(r)/k.
    The all-reduce (DDP, ZeRO 0–1) spans the whole DP axis: HSDP needs ZeRO-2/3. Under int8
    reduction it is an all-gather of each rank's codes (``runtime.quantized``): a bucket of B
    wire bytes gathers p · B, so its seconds per wire byte are p · σ_ag(p · B)."""
    on = "_bf16" if st.grad_reduce == "bf16" else ""
    k, r, dims = st.dp_shard, st.dp_replicate, st.dims
    shard_link = comm.group_link(cluster, dims.axis("dp_shard" if r > 1 else "dp_cp"))  # + cp ranks
    gather = comm.coefficients("all_gather", k, shard_link, unit_bytes)
    rs_lat, rs_spb = comm.coefficients(f"reduce_scatter{on}", k, shard_link, unit_grad_bytes)
    if r > 1:
        across = comm.group_link(cluster, dims.axis("dp_replicate"))
        ar_lat, ar_spb = comm.coefficients(f"all_reduce{on}", r, across, unit_grad_bytes / k)
        rs_lat, rs_spb = rs_lat + ar_lat, rs_spb + ar_spb / k
    dp_link = comm.group_link(cluster, dims.axis("dp_cp"))
    if st.grad_reduce == "int8":  # DDP's reduction as an all-gather of every rank's codes
        p = dims.dp_cp
        lat, spb = comm.coefficients("all_gather", p, dp_link, p * bucket_bytes)
        return gather, (rs_lat, rs_spb), (lat, spb * p)  # S = p · bucket gathered per bucket
    return gather, (rs_lat, rs_spb), comm.coefficients(f"all_reduce{on}", dims.dp_cp, dp_link, bucket_bytes)


def dp_terms(
    profile: ModelProfile, cluster: Cluster, st: Strategy, block_params: float, rank_params: float
) -> dict[str, Any]:
    """The DP/ZeRO fields of ``Terms``: the collectives' coefficients at the sizes they run
    (one block's parameters per ZeRO unit, a DDP bucket), the buckets, the overlap."""
    wire = wire_bytes_per_param(profile, st)
    unit_bytes = block_params * mem.STATE_BYTES[st.dtype][0]
    bucket_bytes = min(ddp_bucket_bytes(st) / BUCKET_GRAD_BYTES, rank_params) * wire  # the cap: fp32 bytes
    (lat, s_per_byte), (rs_lat, rs_s_per_byte), (ar_lat, ar_s_per_byte) = dp_coefficients(
        cluster, st, unit_bytes, block_params * wire, bucket_bytes
    )
    ar_lat *= POWERSGD_LATENCY_FACTOR if st.powersgd_rank else 1  # a chain of 3 all-reduces per bucket
    return {
        "grad_bytes": wire,
        "lat_s": lat,
        "s_per_byte": s_per_byte,
        "rs_lat_s": rs_lat,
        "rs_s_per_byte": rs_s_per_byte,
        "ar_lat_s": ar_lat,
        "ar_s_per_byte": ar_s_per_byte,
        "overlap": cluster.comm_profile.overlap if cluster.comm_profile is not None else 1.0,
        "overlap_slowdown": cluster.device.overlap_slowdown,
        "ddp_buckets": ddp_buckets(rank_params, st),
        "last_bucket_s": last_bucket_s(rank_params, st, ar_lat, ar_s_per_byte * wire),
    }


__all__ = ["dp_coefficients", "dp_terms"]
