"""Cost-model building blocks against published closed forms and hand arithmetic."""

from __future__ import annotations

import pytest

from autopar import Cluster
from autopar.cost_models import closed_forms, comm
from autopar.cost_models.compute import roofline_time_s
from autopar.cost_models.memory import inflight_stage_copies, model_state_bytes
from autopar.mesh import Axis


@pytest.mark.parametrize(("zero", "gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_model_states_reproduce_the_paper(zero: int, gb: float) -> None:
    # Rajbhandari et al. SC'20 Fig. 1: Ψ = 7.5B, N_d = 64.
    total = sum(model_state_bytes(7.5e9, zero=zero, dp=64, dtype="bf16").values())
    assert round(total / 1e9, 1) == gb  # the paper prints one decimal


def test_gpt_closed_forms_by_hand() -> None:
    assert closed_forms.gpt_param_count(l=96, h=12288, V=51200, s=2048) == pytest.approx(174.6e9, rel=1e-3)
    # 72·B·s·l·h²·(1 + s/6h + V/12lh) for B=1, s=1, l=1, h=6, V=12: 72·36·(1 + 1/36 + 12/72)
    assert closed_forms.gpt_model_flops(B=1, s=1, l=1, h=6, V=12) == pytest.approx(72 * 36 + 72 + 432)
    assert closed_forms.layer_activation_bytes(s=2, b=1, h=4, a=2) == 2 * 4 * (34 + 5 * 2 * 2 / 4)


def test_ring_collectives_by_hand() -> None:
    link = comm.GroupLink(bandwidth_bytes_per_s=100e9, latency_s=5e-6, crosses_nodes=False)
    # 8 ranks, 1 GB: 2·7·5 µs + 2·7/8·1e9/1e11 = 70 µs + 17.5 ms
    assert comm.allreduce_time_s(1e9, 8, link) == pytest.approx(70e-6 + 0.0175)
    assert comm.allgather_time_s(1e9, 8, link) == pytest.approx(35e-6 + 0.00875)
    assert comm.reduce_scatter_time_s(1e9, 8, link) == comm.allgather_time_s(1e9, 8, link)
    assert comm.allreduce_time_s(1e9, 1, link) == 0.0
    assert comm.p2p_time_s(1e6, link) == pytest.approx(5e-6 + 1e-5)


def test_group_links_follow_the_topology() -> None:
    c = Cluster.preset("dgx-a100-80g", nodes=4)  # 230 GB/s NVLink, 200 GB/s per node
    tp = comm.group_link(c, Axis("group", 8, 1))
    assert not tp.crosses_nodes and tp.bandwidth_bytes_per_s == 230e9
    dp = comm.group_link(c, Axis("group", 4, 8))  # one rank per node: 8 rings share each node's NICs
    assert dp.crosses_nodes and dp.bandwidth_bytes_per_s == pytest.approx(200e9 / 8)
    dp2 = comm.group_link(c, Axis("group", 32, 1))  # all 8 GPUs of each node talk at once
    assert dp2.crosses_nodes and dp2.bandwidth_bytes_per_s == pytest.approx(200e9 / 8)
    assert not comm.group_link(c, Axis("group", 2, 4)).crosses_nodes


def test_inflight_micro_batches_per_schedule() -> None:
    assert inflight_stage_copies("gpipe", stage=0, pp=4, micro_batches=16, virtual=1) == 16
    assert [inflight_stage_copies("1f1b", stage=i, pp=4, micro_batches=16, virtual=1) for i in range(4)] == [
        4,
        3,
        2,
        1,
    ]
    assert inflight_stage_copies("1f1b", stage=0, pp=4, micro_batches=2, virtual=1) == 2
    # Megatron interleaved warm-up on rank 0: 2(p−1) + (v−1)p = 6 + 4 = 10 chunks, +1, each 1/2 stage
    assert inflight_stage_copies("interleaved", stage=0, pp=4, micro_batches=16, virtual=2) == 5.5


def test_roofline() -> None:
    assert roofline_time_s(1e12, 1e9, flops_per_s=1e12, bytes_per_s=1e12) == 1.0
    assert roofline_time_s(1e9, 1e12, flops_per_s=1e12, bytes_per_s=1e12) == 1.0
