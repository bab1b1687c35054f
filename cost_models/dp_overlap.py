"""The data-parallel / ZeRO communication a rank's compute does not hide: the overlap rule the
estimate, the layout ILP and the timeline share."""

from __future__ import annotations

from typing import Any

from autopar.cost_models.buckets import overlap_share
from autopar.cost_models.rank_load import RankLoad
from autopar.cost_models.terms import Terms


def dp_exposed_s(terms: Terms, load: RankLoad) -> float:
    """Data-parallel / ZeRO time this rank cannot hide (the overlap rule in estimate's doc).

    With L = the rank's FSDP2 units (``RankLoad.zero_units``: its blocks and the roots holding
    the embedding or head), one all-gather of S bytes costs α_g + σ_g·S, one
    reduce-scatter α_r + σ_r·S and one all-reduce α_a + σ_a·S (ring: α_g = α_r = (dp−1)·α,
    σ_g = σ_r = (dp−1)/(dp·β), α_a = 2α_g, σ_a = 2σ_g; or measured), G gradient bytes,
    W weight bytes, overlap O = κ·(backward − one block's backward), and fwd, bwd below
    also scaled by κ, the share of compute that hides communication (``Terms.overlap``):
      ZeRO-0  max(B, n·α_a + σ_a·G − (1 − 1/n)·O), n DDP's buckets (``buckets.ddp_buckets``: an
              all-reduce each, the first ready after 1/n of backward: ``buckets.overlap_share``),
              B the last bucket's all-reduce (``last_bucket_s``)
      ZeRO-1  the same + α_g + σ_g·W (torch's ZeroRedundancyOptimizer keeps
              DDP's all-reduce, then broadcasts each updated shard)
      ZeRO-2  m·max(0, L·α_r + σ_r·G − O) + α_g + σ_g·W
      ZeRO-3  m·[max(g₁, L·α_g + σ_g·W − fwd) + max(g₁ + r₁, L·α_g + σ_g·W + L·α_r + σ_r·G − bwd)]
    with g₁, r₁ one block's gather and reduce-scatter (``zero3_unhidden_s``): no compute precedes
    the first block's gather in each direction or follows the last one's reduce-scatter. ZeRO-3
    gathers each block twice per micro-batch, also under full recompute: the FSDP2 unit wraps the
    checkpointed block (recompute before ``fully_shard``, as torchtitan's ``apply_ac`` precedes
    ``apply_fsdp``), so the pre-backward gather serves the recomputed forward and the backward.
    Under a pipeline (pp > 1) torch's schedules reduce-scatter only in the step's last backward
    (``memory.rank_state_bytes``): ZeRO-2 pays its term once, not m times, and ZeRO-3
      m·[max(g₁, L·α_g + σ_g·W − fwd) + max(g₁, L·α_g + σ_g·W − bwd)] + max(r₁, L·α_r + σ_r·G − bwd).
    Hidden communication is not free: each overlapped term E of a collective time C becomes
    E + s·(C − E), s the device's ``overlap_slowdown`` (the compute its kernels lose to the
    hidden C − E); the ZeRO-1/2 weight all-gather after the optimizer hides behind nothing.
    """
    st, lat, spb = terms.strategy, terms.lat_s, terms.s_per_byte
    rlat, rspb = terms.rs_lat_s, terms.rs_s_per_byte
    if st.dims.dp_cp == 1:
        return 0.0
    params = terms.weighted(load.params, load.expert_params, "comm")  # experts: over dp/ep ranks
    grad, weights = params * terms.grad_bytes, params * terms.weight_bytes
    kappa = terms.overlap
    overlap = kappa * (load.bwd_s - terms.block["none"].bwd_s)
    m, s = st.micro_batches, terms.overlap_slowdown
    if st.zero in (0, 1):
        all_reduce = terms.ddp_buckets * terms.ar_lat_s + terms.ar_s_per_byte * grad
        ddp = max(terms.last_bucket_s, all_reduce - overlap_share(terms.ddp_buckets) * overlap)
        return slowed(ddp, all_reduce, s) + (lat + spb * weights if st.zero == 1 else 0.0)
    reductions = 1 if st.pp > 1 else m  # reduce-scatters per step
    if st.zero == 2:
        rs = load.zero_units * rlat + rspb * grad
        return reductions * slowed(max(0.0, rs - overlap), rs, s) + lat + spb * weights
    units = load.zero_units  # a gather and a reduce-scatter per FSDP2 unit
    gather, reduce = units * lat + spb * weights, units * rlat + rspb * grad  # gather: fwd, bwd
    first, last = zero3_unhidden_s(terms)
    fwd, bwd = kappa * load.fwd_s, kappa * load.bwd_s
    if st.pp > 1:
        gathers = max(first, gather - fwd) + max(first, gather - bwd)
        return m * slowed(gathers, 2 * gather, s) + slowed(max(last, reduce - bwd), reduce, s)
    return m * slowed(
        max(first, gather - fwd) + max(first + last, gather + reduce - bwd), 2 * gather + reduce, s
    )


def slowed(exposed: Any, total: Any, s: float) -> Any:
    """What ``total`` seconds of communication cost when compute hides all but ``exposed`` of them
    and each hidden second slows that compute by ``s`` (``DeviceSpec.overlap_slowdown``):
    E + s·(C − E) = (1 − s)·E + s·C. Linear in E and C, so the layout ILP states the same rule on
    its affine expressions."""
    return (1 - s) * exposed + s * total


def zero3_unhidden_s(terms: Terms) -> tuple[float, float]:
    """(g₁, r₁): one block's ZeRO-3 weight all-gather and gradient reduce-scatter, the parts no
    compute hides (``dp_exposed_s``)."""
    block = terms.block["none"].params
    return (
        terms.lat_s + terms.s_per_byte * block * terms.weight_bytes,
        terms.rs_lat_s + terms.rs_s_per_byte * block * terms.grad_bytes,
    )


__all__ = ["dp_exposed_s", "slowed", "zero3_unhidden_s"]
