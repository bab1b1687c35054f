"""Mixed clusters: node groups from YAML, round trips, one-line errors, the ideal and a group's view."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import Cluster
from autopar.errors import ClusterSpecError
from autopar.groups import MixedCluster, load_cluster

pytestmark = pytest.mark.quick

A100_H100 = """
name: a100-h100
groups:
  - {name: a100, preset: dgx-a100-80g, num_nodes: 2}
  - {name: h100, preset: dgx-h100, num_nodes: 3}
between: {bandwidth_bytes_per_s: 50 GB/s, latency_s: 20 us}
"""


@pytest.fixture
def mixed(tmp_path) -> MixedCluster:
    path = tmp_path / "mixed.yaml"
    path.write_text(A100_H100)
    got = load_cluster(str(path))
    assert isinstance(got, MixedCluster)
    return got


def test_groups_from_yaml(mixed) -> None:
    assert [g.name for g in mixed.groups] == ["a100", "h100"]
    assert (mixed.num_nodes, mixed.gpus_per_node, mixed.world_size) == (5, 8, 40)
    assert mixed.groups[1].device == Cluster.preset("dgx-h100").device
    assert mixed.between.bandwidth_bytes_per_s == 50e9 and mixed.between.latency_s == pytest.approx(20e-6)
    assert MixedCluster.from_dict(mixed.to_dict()) == mixed


def test_between_defaults_to_the_slower_network() -> None:
    fast = Cluster.preset("dgx-h100").to_dict() | {"name": "h", "num_nodes": 1}
    slow = Cluster.preset("l40s-100gbe").to_dict() | {"name": "l", "num_nodes": 1}
    got = MixedCluster.from_dict({"groups": [fast, slow]})
    assert got.between == Cluster.preset("l40s-100gbe").inter_node


def test_ideal_is_at_least_every_group_and_a_view_is_one_group(mixed) -> None:
    ideal = mixed.ideal()
    assert ideal.world_size == mixed.world_size
    for g in mixed.groups:
        assert ideal.device.memory_bytes >= g.device.memory_bytes
        for attention in (False, True):
            assert ideal.device.achievable_flops("bf16", attention=attention) >= g.device.achievable_flops(
                "bf16", attention=attention
            )
        assert ideal.intra_node.bandwidth_bytes_per_s >= g.intra_node.bandwidth_bytes_per_s
    view = mixed.view(0)
    assert view.device == mixed.groups[0].device and view.num_nodes == mixed.num_nodes
    assert view.inter_node == mixed.groups[0].inter_node
    assert mixed.view(1, crossing=True).inter_node.bandwidth_bytes_per_s == 50e9  # between is slower


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(groups=d["groups"][:1]), "at least 2 node groups"),
        (lambda d: d["groups"][1].update(name="a100"), "its own name"),
        (lambda d: d["groups"][1].update(gpus_per_node=4), "same gpus_per_node"),
        (lambda d: d["groups"][0].pop("name"), "give the group a name"),
        (lambda d: d["groups"][0].update(num_nodes=0), "groups.a100: num_nodes"),
        (lambda d: d.update(between={"bandwidth_bytes_per_s": "fast", "latency_s": 0}), "between"),
        (lambda d: d.update(colour="blue"), "colour"),
    ],
)
def test_bad_groups_are_one_line_errors(change, message) -> None:
    data = {
        "name": "m",
        "groups": [
            {"name": "a100", "preset": "dgx-a100-80g", "num_nodes": 1},
            {"name": "h100", "preset": "dgx-h100", "num_nodes": 1},
        ],
    }
    change(data)
    with pytest.raises(ClusterSpecError, match=message) as e:
        MixedCluster.from_dict(data)
    assert "\n" not in str(e.value)


def test_node_count_flags_are_refused_for_groups(tmp_path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(A100_H100)
    with pytest.raises(ClusterSpecError, match="num_nodes and gpus_per_node per group"):
        load_cluster(str(path), nodes=4)
    plain = load_cluster("dgx-h100", nodes=2)
    assert plain == dataclasses.replace(Cluster.preset("dgx-h100"), num_nodes=2)
