"""A strategy on node groups: the same prices as one type of node where the groups are alike, each
stage on its own device where they differ, uneven shares, and one-line placement errors."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import Cluster
from autopar.cost_models.estimate import estimate
from autopar.cost_models.mixed import cell_groups, mixed_estimate
from autopar.errors import AutoparError
from autopar.groups import MixedCluster
from autopar.strategy import Strategy
from tests.cost_models.conftest import SMALL_GPT_SEQ

pytestmark = pytest.mark.quick


def two(first: str, second: str, *, gpn: int = 4, nodes: tuple[int, int] = (1, 1)) -> MixedCluster:
    """Two groups of presets ``first`` and ``second``."""
    groups = tuple(
        dataclasses.replace(Cluster.preset(p, nodes=n, gpus_per_node=gpn), name=name)
        for p, n, name in ((first, nodes[0], "one"), (second, nodes[1], "two"))
    )
    return MixedCluster(name="m", groups=groups, between=groups[0].inter_node)


@pytest.fixture(scope="module")
def llama8b():
    """Llama 3 8B at seq 2048, micro-batch 1: compute-bound enough for the devices to differ (the
    small GPT's steps are latencies)."""
    from autopar.planner import ModelProfiles

    return ModelProfiles.of("llama3-8b", dtype="bf16", seq=2048).at(1)


STRATEGIES = [
    dict(pp=2, dp=4, zero=1),
    dict(pp=2, dp=2, tp=2, zero=3, sequence_parallel=True),
    dict(pp=2, dp=4, schedule="interleaved", virtual_stages=2, recompute="full"),
    dict(pp=1, dp=8, zero=2),
    dict(pp=2, dp=4, schedule="zbv", virtual_stages=2),
]


@pytest.mark.parametrize("knobs", STRATEGIES)
def test_alike_groups_price_as_one_type(small_gpt_profile, knobs) -> None:
    """Two groups of the same preset are the preset's cluster: every term the same, whatever the
    node order (the mechanism adds nothing where the devices are alike)."""
    mixed = two("dgx-a100-80g", "dgx-a100-80g")
    st = Strategy(global_batch=32, seq=SMALL_GPT_SEQ, micro_batch=1, **knobs)
    one = estimate(small_gpt_profile, Cluster.preset("dgx-a100-80g", nodes=2, gpus_per_node=4), st)
    for order in (("one", "two"), ("two", "one")):
        got = mixed_estimate(small_gpt_profile, mixed, st, order)
        assert got.step_time_s == pytest.approx(one.step_time_s, rel=1e-12)
        assert got.breakdown_s == pytest.approx(one.breakdown_s, rel=1e-12)
        assert [m.peak_bytes for m in got.memory] == pytest.approx([m.peak_bytes for m in one.memory])


def test_each_stage_on_its_device(llama8b) -> None:
    """Stages on groups: the A100 stage takes the A100's time, the H100 stage the H100's, and the
    step is the slower's pipeline; the faster group's devices idle for the difference."""
    mixed = two("dgx-a100-80g", "dgx-h100")
    st = Strategy(pp=2, dp=4, global_batch=32, seq=2048)
    a100 = estimate(llama8b, Cluster.preset("dgx-a100-80g", nodes=2, gpus_per_node=4), st)
    h100 = estimate(llama8b, Cluster.preset("dgx-h100", nodes=2, gpus_per_node=4), st)
    got = mixed_estimate(llama8b, mixed, st, ("one", "two"))
    assert h100.step_time_s < got.step_time_s <= a100.step_time_s * (1 + 1e-9)
    assert got.stage_times[0].forward_s == pytest.approx(a100.stage_times[0].forward_s)
    assert got.stage_times[1].forward_s == pytest.approx(h100.stage_times[1].forward_s)
    by_name = {g["group"]: g for g in got.groups}
    assert by_name["one"]["pipeline_ranks"] == [0] and by_name["two"]["pipeline_ranks"] == [1]
    assert by_name["two"]["busy_s"] < by_name["one"]["busy_s"]
    assert by_name["two"]["idle_s"] == pytest.approx(got.step_time_s - by_name["two"]["busy_s"])
    assert got.to_dict()["groups"][0]["group"] == "one"


def test_faster_replicas_take_more_micro_batches(llama8b) -> None:
    """Replicas on groups: with even shares the A100 replicas set the step; moving micro-batches
    to the H100 replicas (the same global batch) shortens it, and too many lengthens it again."""
    even = Strategy(pp=2, dp=2, tp=2, global_batch=32, seq=2048)
    # pp outermost: with 4 GPUs a node, node 0 holds pipeline rank 0 of both replicas
    assert cell_groups(two("dgx-a100-80g", "dgx-h100"), even, ("one", "two")) == [[0, 0], [1, 1]]
    mixed_r = two("dgx-a100-80g", "dgx-h100", gpn=2, nodes=(2, 2))
    nodes = ("one", "two", "one", "two")  # each pipeline rank's nodes: replica 0 on A100, 1 on H100
    assert cell_groups(mixed_r, even, nodes) == [[0, 1], [0, 1]]
    times = [
        mixed_estimate(llama8b, mixed_r, dataclasses.replace(even, dp_shares=s), nodes).step_time_s
        for s in ((16, 16), (8, 24), (2, 30))
    ]
    base = mixed_estimate(llama8b, mixed_r, even, nodes).step_time_s
    assert times[0] == pytest.approx(base)
    assert times[1] < times[0] and times[1] < times[2]


def test_bad_placements_are_one_line_errors(small_gpt_profile) -> None:
    mixed = two("dgx-a100-80g", "dgx-h100", gpn=2, nodes=(2, 2))
    st = Strategy(pp=2, dp=2, tp=2, global_batch=32, seq=SMALL_GPT_SEQ)
    for nodes, message in (
        (("one", "two"), "names 2 nodes; the cluster has 4"),
        (("one", "one", "one", "two"), "places 3 nodes in group one"),
    ):
        with pytest.raises(AutoparError, match=message):
            mixed_estimate(small_gpt_profile, mixed, st, nodes)
    wide = Strategy(pp=1, dp=1, tp=8, global_batch=32, seq=SMALL_GPT_SEQ)
    with pytest.raises(AutoparError, match="need one device type"):
        cell_groups(mixed, wide, ("one", "one", "two", "two"))
