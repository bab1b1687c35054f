"""Per-operator recompute policies priced by hand: bytes kept, seconds redone, TP/SP shares."""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.cost_models.profile import CallCost, LayerCost
from autopar.cost_models.recompute import (
    call_time_s,
    kept_bytes,
    output_share,
    policy_costs,
    recompute_flops,
    recompute_s,
)

DEVICE = Cluster.preset("dgx-h100").device
MM = CallCost(
    key="mm#0",
    flops=2 * 10**12,
    kernel_flops=2 * 10**12,
    mem_bytes=10**8,
    out_bytes=4000,
    keepable=True,
    placement="sharded",
)
NORM = CallCost(
    key="mul#0",
    flops=0,
    kernel_flops=0,
    mem_bytes=3 * 10**9,
    out_bytes=1000,
    keepable=True,
    placement="stream",
)
ROW = CallCost(
    key="mm#1",
    flops=10**12,
    kernel_flops=10**12,
    mem_bytes=10**8,
    out_bytes=2000,
    keepable=True,
    placement="whole",
)
LAYER = LayerCost(
    name="Block",
    ops=(),
    fwd_flops=3 * 10**12,
    bwd_flops=6 * 10**12,
    params=0,
    saved_stream_bytes=0,
    saved_sharded_bytes=0,
    saved_quadratic_bytes=0,
    quadratic_flops=0,
    tp_reduce_bytes=0,
    tp_reduce_count=0,
    calls=(MM, NORM, ROW),
)


def test_output_shares() -> None:
    assert output_share("sharded", tp=4, sp=False) == 0.25
    assert output_share("stream", tp=4, sp=False) == 1.0
    assert output_share("stream", tp=4, sp=True) == 0.25
    assert output_share("whole", tp=4, sp=True) == 1.0  # a row-parallel matmul's partial sums


def test_kept_bytes_by_hand() -> None:
    # input 512 + kept outputs: mm 4000 (sharded), mul 1000 (stream), mm#1 2000 (whole)
    assert kept_bytes(LAYER, frozenset(), tp=1, sp=False, input_bytes=512) == 512
    assert kept_bytes(LAYER, frozenset({"mm#0", "mul#0"}), tp=1, sp=False, input_bytes=512) == 5512
    # tp 2 without SP: the input and the stream stay whole, the sharded output halves
    assert kept_bytes(LAYER, frozenset({"mm#0", "mul#0", "mm#1"}), tp=2, sp=False, input_bytes=512) == (
        512 + 2000 + 1000 + 2000
    )
    # with SP the input and the stream halve too; the partial sums never do
    assert kept_bytes(LAYER, frozenset({"mm#0", "mul#0", "mm#1"}), tp=2, sp=True, input_bytes=512) == (
        256 + 2000 + 500 + 2000
    )


def test_recompute_seconds_by_hand() -> None:
    rate, bw = DEVICE.achievable_flops("bf16"), DEVICE.hbm_bandwidth_bytes_per_s
    mm_s = max(2e12 / rate, 1e8 / bw)  # compute-bound
    norm_s = 3e9 / bw  # memory-bound
    row_s = max(1e12 / rate, 1e8 / bw)
    assert call_time_s(MM, DEVICE, "bf16", tp=1, stream_share=1.0) == pytest.approx(mm_s)
    assert call_time_s(NORM, DEVICE, "bf16", tp=2, stream_share=1.0) == pytest.approx(norm_s)
    assert call_time_s(NORM, DEVICE, "bf16", tp=2, stream_share=0.5) == pytest.approx(norm_s / 2)
    assert recompute_s(LAYER, frozenset(), DEVICE, "bf16", tp=1, stream_share=1.0) == pytest.approx(
        mm_s + norm_s + row_s
    )
    assert recompute_s(LAYER, frozenset({"mm#0"}), DEVICE, "bf16", tp=1, stream_share=1.0) == pytest.approx(
        norm_s + row_s
    )
    assert recompute_flops(LAYER, frozenset({"mm#0"})) == 1e12


def test_a_measured_forward_is_scaled_by_the_share_redone() -> None:
    keep = frozenset({"mm#0"})
    whole = recompute_s(LAYER, frozenset(), DEVICE, "bf16", tp=1, stream_share=1.0)
    part = recompute_s(LAYER, keep, DEVICE, "bf16", tp=1, stream_share=1.0)
    redo, act, flops = policy_costs(
        LAYER, keep, DEVICE, "bf16", tp=1, sp=False, stream_share=1.0, input_bytes=512, measured_fwd_s=0.01
    )
    assert redo == pytest.approx(0.01 * part / whole)
    assert act == 512 + 4000
    assert flops == 1e12
    analytic = policy_costs(
        LAYER, keep, DEVICE, "bf16", tp=1, sp=False, stream_share=1.0, input_bytes=512, measured_fwd_s=None
    )
    assert analytic[0] == pytest.approx(part)
