"""What one operator's TP choice costs, by hand arithmetic: placement changes under full
recompute, and the share of residual-stream work a layout keeps per rank."""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.cost_models.comm import group_link
from autopar.cost_models.compute import layer_forward_s
from autopar.cost_models.profile import LayerCost, OpCost
from autopar.cost_models.terms import HIDDEN
from autopar.cost_models.tp import collective_time_s, reshard
from autopar.mesh import Axis
from autopar.passes.tp_rules import RF

LINK = group_link(Cluster.preset("dgx-a100-80g"), Axis("group", 8, 1))
SIZE = 25_165_824  # one (s, h) bf16 activation of the 22B model: 2048 · 6144 · 2 bytes


def test_full_recompute_repeats_forward_collectives_only() -> None:
    """S1 → Rf is an all-gather forward, and backward gathers the kept shard again (hidden behind
    the input-gradient GEMM, as Megatron-LM schedules it: counted, no time) before the
    reduce-scatter (the conjugate); under full recompute the second forward gathers it instead,
    so the all-gather counts twice, the reduce-scatter once."""
    ag = collective_time_s("all_gather", SIZE, 8, LINK)
    rs = collective_time_s("reduce_scatter", SIZE, 8, LINK)
    once, kinds = reshard("S1", RF, SIZE, 8, LINK)
    twice, again = reshard("S1", RF, SIZE, 8, LINK, forward_passes=2)
    assert kinds == [("all_gather", "forward"), ("all_gather", HIDDEN), ("reduce_scatter", "backward")]
    assert again == [("all_gather", "forward"), ("reduce_scatter", "backward")]
    assert once == pytest.approx(ag + rs) and twice == pytest.approx(2 * ag + rs)
    # S1 → R gathers forward; a consumer that saves it has it gathered again in backward, one
    # that does not (an add) leaves backward a local slice
    assert reshard("S1", "R", SIZE, 8, LINK)[1] == [("all_gather", "forward"), ("all_gather", HIDDEN)]
    assert reshard("S1", "R", SIZE, 8, LINK, kept=False) == (pytest.approx(ag), [("all_gather", "forward")])
    # R → S1 is a local slice forward and an all-gather of the gradient backward: not repeated
    assert reshard("R", "S1", SIZE, 8, LINK, forward_passes=2)[0] == pytest.approx(ag)


def test_stream_share_prices_residual_ops_as_the_layout_runs_them() -> None:
    """A norm (no FLOPs, 1 GB moved) and a matmul (1 TFLOP): the matmul splits t ways always; the
    norm moves all its bytes when replicated, 1/t of them when the layout splits the sequence."""
    dev = Cluster.preset("dgx-a100-80g").device
    layer = LayerCost(
        name="Block",
        ops=(
            OpCost(flops=0, kernel_flops=0, mem_bytes=10**9, stream=True),
            OpCost(flops=10**12, kernel_flops=10**12, mem_bytes=0, stream=False),
        ),
        fwd_flops=10**12,
        bwd_flops=2 * 10**12,
        params=0,
        saved_stream_bytes=0,
        saved_sharded_bytes=0,
        saved_quadratic_bytes=0,
        quadratic_flops=0,
        tp_reduce_bytes=0,
        tp_reduce_count=0,
    )
    matmul_s = 10**12 / 8 / dev.achievable_flops("bf16")
    norm_s = 10**9 / dev.hbm_bandwidth_bytes_per_s
    whole = layer_forward_s(layer, dev, "bf16", tp=8, sp=False)
    assert whole == pytest.approx(matmul_s + norm_s)
    assert layer_forward_s(layer, dev, "bf16", tp=8, sp=True) == pytest.approx(matmul_s + norm_s / 8)
    split = layer_forward_s(layer, dev, "bf16", tp=8, sp=False, stream_share=1 / 8)
    assert split == pytest.approx(matmul_s + norm_s / 8)
