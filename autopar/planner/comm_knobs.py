"""The communication knobs a search prices for one choice of degrees and ZeRO stage: the
gradient reduction's dtype, HSDP's replica count, PowerSGD's rank and DDP's bucket size.

Lossless knobs are priced wherever they can change the step; lossy ones (``Strategy.lossy_comm``)
only where the user allows them (``Constraints.allow_lossy_comm``). A constraint fixes a knob.
"""

from __future__ import annotations

from collections.abc import Iterator

from autopar.mesh import ParallelDims
from autopar.request import PlanRequest
from autopar.strategy import DDP_BUCKET_MB, runs_on_ddp


def comm_knobs(
    request: PlanRequest, *, tp: int, pp: int, dp: int, zero: int, ep: int = 1, cp: int = 1
) -> Iterator[tuple[str, int, int, float]]:
    """(grad_reduce, dp_replicate, powersgd_rank, bucket_mb) worth pricing for these degrees
    (expert and context parallelism run without HSDP: one replica; the gradients of a cp plan
    are reduced over dp·cp ranks, adjacent in the mesh, priced as a dp of that size)."""
    degrees = {"tp": tp, "pp": pp, "dp": dp * cp, "zero": zero, "ep": ep}
    for reduce in _grad_reduces(request, **degrees):
        for replicas in _replicas(request, tp=tp, dp=dp, zero=zero) if ep == 1 and cp == 1 else [1]:
            for rank in _powersgd_ranks(request, **degrees, reduce=reduce):
                for bucket in _buckets(request, **degrees):
                    yield reduce, replicas, rank, bucket


def _grad_reduces(request: PlanRequest, *, tp: int, pp: int, dp: int, zero: int, ep: int) -> list[str]:
    """The gradient reduction dtypes worth pricing: the constraint's; fp32 at dp 1 (nothing is
    reduced) or where bf16 would be lossy and not allowed (``Strategy.lossy_comm``); else bf16
    alone — half the bytes, the same compute and memory under FSDP2, so never slower — but both
    on DDP, whose compression hook casts each bucket on the compute stream
    (``compression.compress_s_per_param``), a cost a fully hidden all-reduce does not repay; and
    int8 on DDP where lossy communication is allowed (always lossy)."""
    c = request.constraints
    if c.grad_reduce is not None:
        return [c.grad_reduce]
    if dp == 1 or not (request.dtype == "bf16" or c.allow_lossy_comm):
        return ["fp32"]
    if not runs_on_ddp(tp=tp, pp=pp, dp=dp, zero=zero, ep=ep):
        return ["bf16"]
    return ["fp32", "bf16", "int8"] if c.allow_lossy_comm else ["fp32", "bf16"]


def _replicas(request: PlanRequest, *, tp: int, dp: int, zero: int) -> list[int]:
    """HSDP replica counts worth pricing (``Strategy.dp_replicate``): the constraint's; 1 below
    ZeRO-2 or where the DP axis fits in a node; else also shard groups of one node's and two
    nodes' DP ranks (k = gpus_per_node / tp and twice that, at least 2 and fewer than dp).
    HSDP is lossless: it trades the states one group shards for collectives inside it."""
    c = request.constraints
    if c.dp_replicate is not None:
        r = c.dp_replicate
        return [r] if r == 1 or (zero >= 2 and dp % r == 0 and dp // r >= 2) else []
    gpn = request.cluster.gpus_per_node
    if zero < 2 or not ParallelDims(dp=dp, tp=tp).axis("dp").crosses_nodes(gpn):
        return [1]
    groups = [k for k in (gpn // tp, 2 * gpn // tp) if gpn % tp == 0 and 2 <= k < dp and dp % k == 0]
    return [1, *(dp // k for k in groups)]


POWERSGD_RANK = 4
"""The PowerSGD rank a free search prices (Vogels et al. 2019 train ResNet-18 and an LSTM at
rank 1–4 to uncompressed accuracy; torch's docs suggest starting at 1–4)."""


def _powersgd_ranks(
    request: PlanRequest, *, tp: int, pp: int, dp: int, zero: int, ep: int, reduce: str
) -> list[int]:
    """PowerSGD ranks worth pricing: the constraint's where the plan runs on DDP with fp32
    reduction (``Strategy.powersgd_rank``); else 0, and ``POWERSGD_RANK`` too where the user
    allows lossy communication and DDP's all-reduce leaves the node."""
    c, ddp = request.constraints, runs_on_ddp(tp=tp, pp=pp, dp=dp, zero=zero, ep=ep) and reduce == "fp32"
    if c.powersgd_rank is not None:
        return [c.powersgd_rank] if c.powersgd_rank == 0 or ddp else []
    crosses = ParallelDims(dp=dp, tp=tp).axis("dp").crosses_nodes(request.cluster.gpus_per_node)
    return [0, POWERSGD_RANK] if c.allow_lossy_comm and ddp and crosses else [0]


BUCKET_MBS = (DDP_BUCKET_MB, 100.0, 400.0)
"""DDP bucket caps (MiB) a free search prices where the all-reduce leaves the node: torch's
default and 4× and 16× it (fewer latencies per step for a longer last bucket; ``cost_models.buckets``)."""


def _buckets(request: PlanRequest, *, tp: int, pp: int, dp: int, zero: int, ep: int) -> list[float]:
    """DDP bucket caps worth pricing (``Strategy.bucket_mb``): torch's default on every plan not
    on DDP; on DDP the constraint's, else ``BUCKET_MBS`` where the all-reduce leaves the node
    (its latency, per bucket, is the inter-node one) and the default inside a node."""
    if not runs_on_ddp(tp=tp, pp=pp, dp=dp, zero=zero, ep=ep):
        return [DDP_BUCKET_MB]
    c = request.constraints
    if c.bucket_mb is not None:
        return [c.bucket_mb]
    crosses = ParallelDims(dp=dp, tp=tp).axis("dp").crosses_nodes(request.cluster.gpus_per_node)
    return list(BUCKET_MBS) if crosses else [DDP_BUCKET_MB]


__all__ = ["BUCKET_MBS", "POWERSGD_RANK", "comm_knobs"]
