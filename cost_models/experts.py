"""Expert parallelism's price: each MoE layer's all-to-alls, and what a local expert parameter
weighs in the per-parameter terms.

With ep ranks taken from the data-parallel axis (Lepikhin et al. 2020, GShard §2.2; Fedus et
al. 2022, Switch §2.2; torchtitan's and Megatron's layout), each rank holds E/ep of a layer's
experts. A micro-batch's forward sends each routed row to the rank holding its expert
(dispatch) and brings the result back (combine); the backward runs the conjugate exchanges.
Rows spread evenly over the experts (what the routers' load-balancing loss aims at) leave each
rank 1/ep of its rows and send the rest, so an exchange of S bytes costs the pairwise
all-to-all, (ep − 1)·α + (ep − 1)/ep·S/β (``comm.all_to_all_time_s``). Before the dispatch the
ranks exchange their per-expert row counts (E integers: latency). An imbalance
(``Strategy.expert_skew`` = s: the busiest rank receives s × an even share of rows) is priced
on that rank, which every other waits for: its experts' matmuls at s × their even-share time,
its exchanges at s × the bytes (DeepSpeed-MoE and Tutel size their buffers by the same
per-expert maximum; Rajbhandari et al. 2022 §5, Hwang et al. 2023 §3). s = 1 by default.
"""

from __future__ import annotations

from autopar.cluster import Cluster, DeviceSpec
from autopar.cost_models import comm
from autopar.cost_models import memory as mem
from autopar.cost_models.compute import expert_forward_s
from autopar.cost_models.profile import LayerCost
from autopar.strategy import Strategy

COUNT_BYTES = 8
"""Bytes of one per-expert row count in the dispatch's count exchange (int64)."""


def ep_link(cluster: Cluster, st: Strategy) -> comm.GroupLink:
    """The link of an expert-parallel group: ep consecutive data-parallel ranks (stride tp)."""
    return comm.group_link(cluster, st.dims.axis("ep"))


def ep_forward_s(lc: LayerCost, st: Strategy, link: comm.GroupLink) -> float:
    """One micro-batch's forward all-to-alls of a layer: the count exchange, the dispatch of the
    rows entering the experts and the combine of those leaving (``LayerCost.a2a_bytes``: both),
    each A2A(S) = (ep − 1)·α + (ep − 1)/ep·S/β. The backward repeats the two row exchanges."""
    if st.ep == 1 or not lc.experts:
        return 0.0
    return comm.all_to_all_time_s(COUNT_BYTES * lc.experts, st.ep, link) + ep_backward_s(lc, st, link)


def ep_backward_s(lc: LayerCost, st: Strategy, link: comm.GroupLink) -> float:
    """The backward's two row exchanges (the gradients of the combine and of the dispatch)."""
    if st.ep == 1 or not lc.experts:
        return 0.0
    return 2 * comm.all_to_all_time_s(skew(st) * lc.a2a_bytes / 2, st.ep, link)


def skew(st: Strategy) -> float:
    """The busiest EP rank's rows over an even share: ``Strategy.expert_skew``, at most ep (every
    row on one rank); 1 without expert parallelism (each rank runs its own rows)."""
    return min(st.expert_skew, st.ep) if st.ep > 1 else 1.0


def expert_skew_s(lc: LayerCost, st: Strategy, device: DeviceSpec) -> float:
    """Forward seconds the busiest EP rank spends on rows beyond an even share: (skew − 1) × the
    experts' grouped matmuls at an even share (``compute.expert_forward_s``); its backward is
    twice that, as every matmul's (Narayanan et al. SC'21 §3.5)."""
    return (skew(st) - 1) * expert_forward_s(lc, device, st.dtype) if lc.experts else 0.0


def expert_factors(cluster: Cluster, st: Strategy) -> dict[str, float]:
    """What a local expert parameter weighs against a dense one (``Terms.weighted``), ep > 1:

    - state: ZeRO shards expert states over the e = dp/ep ranks holding the same experts, so
      per parameter ``state_bytes_per_param`` at e shards over that at dp (1 at ZeRO 0);
    - optimizer: a ZeRO ≥ 1 rank updates 1/e of its experts, not 1/dp: × ep;
    - comm: expert gradients are reduced over those e ranks (stride tp·ep), dense ones over dp:
      the ratio of the two collectives' seconds per byte (0 when e = 1: nothing to reduce)."""
    if st.ep == 1:
        return {"expert_state": 1.0, "expert_optimizer": 1.0, "expert_comm": 1.0}
    e = st.dp // st.ep
    state = mem.state_bytes_per_param(st, shard=e) / mem.state_bytes_per_param(st)
    kind = "all_reduce" if st.zero <= 1 else "reduce_scatter"
    kind += "_bf16" if st.grad_reduce == "bf16" else ""
    dense = comm.coefficients(kind, st.dp, comm.group_link(cluster, st.dims.axis("dp")), comm.BULK_BYTES)[1]
    local = comm.coefficients(kind, e, comm.group_link(cluster, st.dims.axis("edp")), comm.BULK_BYTES)[1]
    return {
        "expert_state": state,
        "expert_optimizer": float(st.ep) if st.zero >= 1 else 1.0,
        "expert_comm": local / dense if dense > 0 else 0.0,
    }


__all__ = ["ep_backward_s", "ep_forward_s", "ep_link", "expert_factors", "expert_skew_s", "skew"]
