"""DDP's gradient buckets: how many all-reduces backward issues, and what is left after it.

DDP (ZeRO 0–1 on the model as written) groups the gradients into buckets of at most
``Strategy.bucket_mb`` MiB of fp32 gradients (torch ``DistributedDataParallel(bucket_cap_mb=…)``;
Li et al. 2020, "PyTorch Distributed", §3.2.3 and Fig. 6) and all-reduces each as soon as its
last gradient is ready, hidden behind the rest of backward. With P parameters on the rank and a
cap of C bytes there are n = ⌈4P / C⌉ buckets, so one step pays n all-reduce latencies instead of
one (α·n: fewer, larger buckets pay it fewer times), and the last bucket — the first layers'
gradients, ready only when backward ends — is reduced with nothing left to hide it (smaller
buckets leave less). A parameter larger than the cap makes a bucket of its own in torch; the
count here ignores that. torch also closes a bucket once it reaches the cap, so a bucket may
overshoot it by part of a tensor: the count is ⌈4P/C⌉ or one fewer when tensors are small
against the cap. The first step runs as one bucket (DDP learns the gradients' order in it and
rebuilds the buckets after: measured, ``test_ddp_buckets_of_the_planned_cap_match_single_process``);
the steady state is priced.

Overlap. Gradients become ready evenly through backward (time T): bucket i of n is ready at
i·T/n, and the buckets' all-reduces (c = α + σ·G/n each) run one after another. When c ≤ T/n each
finishes before the next is ready and only the last one's c is exposed; otherwise they queue
from the first one's readiness at T/n, so the last finishes at T/n + n·c and
n·c − T·(n − 1)/n = n·α + σ·G − T·(1 − 1/n) is exposed. Only the backward after the first bucket
is full can hide communication (``overlap_share``): one bucket for the whole model hides none.
"""

from __future__ import annotations

import math

from autopar.strategy import Strategy

BUCKET_GRAD_BYTES = 4
"""Bytes per gradient element in a DDP bucket: fp32 (the parameters' dtype under autocast, and
what the cap counts, whatever a compression hook then sends)."""


def ddp_bucket_bytes(st: Strategy) -> float:
    """The bucket cap in bytes (``Strategy.bucket_mb`` MiB)."""
    return st.bucket_mb * 2**20


def ddp_buckets(params: float, st: Strategy) -> int:
    """All-reduces per step of a DDP rank holding ``params`` parameters: ⌈4·params / cap⌉ (at
    least 1); 1 for every plan not on DDP (FSDP2 prices its collectives per block)."""
    if not st.uses_ddp:
        return 1
    return max(1, math.ceil(BUCKET_GRAD_BYTES * params / ddp_bucket_bytes(st)))


def overlap_share(buckets: int) -> float:
    """Share of the backward that can hide DDP's all-reduces with ``buckets`` buckets: 1 − 1/n
    (the module doc: the backward before the first bucket fills hides nothing)."""
    return 1.0 - 1.0 / buckets


def last_bucket_s(params: float, st: Strategy, ar_lat_s: float, ar_s_per_param: float) -> float:
    """The all-reduce of DDP's last bucket, which starts when backward ends: min(cap, the rank's
    4·params bytes) of gradients, at ``ar_lat_s`` + ``ar_s_per_param`` per parameter (what
    compression leaves on the wire); 0 at dp 1."""
    if st.dims.dp_cp == 1:
        return 0.0
    bucket_params = min(ddp_bucket_bytes(st) / BUCKET_GRAD_BYTES, params)
    return ar_lat_s + ar_s_per_param * bucket_params


__all__ = ["BUCKET_GRAD_BYTES", "ddp_bucket_bytes", "ddp_buckets", "last_bucket_s", "overlap_share"]
