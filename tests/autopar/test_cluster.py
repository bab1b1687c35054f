"""Cluster presets, YAML round trip, and one clear error per malformed field."""

from __future__ import annotations

import pytest
import yaml

from autopar import Cluster, ClusterSpecError
from autopar.cluster import PRESETS
from autopar.units import parse_quantity


def test_presets_have_datasheet_numbers() -> None:
    h100 = Cluster.preset("dgx-h100", nodes=4)
    assert h100.world_size == 32
    assert h100.device.peak_flops["bf16"] == 989e12
    assert h100.device.hbm_bandwidth_bytes_per_s == 3.35e12
    assert h100.inter_node.bandwidth_bytes_per_s == 400e9
    a100 = Cluster.preset("dgx-a100-80g")
    assert a100.device.memory_bytes == 80e9
    assert a100.device.peak_flops["bf16"] == 312e12
    assert Cluster.preset("dgx-a100-40g").device.hbm_bandwidth_bytes_per_s == 1.555e12
    assert Cluster.preset("dgx-h200").device.memory_bytes == 141e9
    capped = Cluster.preset("h100-96g-500w").device  # stated assumptions: peak × 500/700, HBM2e
    assert capped.peak_flops["bf16"] == pytest.approx(989e12 * 500 / 700) and capped.memory_bytes == 96e9
    assert capped.hbm_bandwidth_bytes_per_s == 2.4e12
    # commodity PCIe nodes on Ethernet: datasheet peaks (dense), PCIe and 90% of line rate assumed
    l40s = Cluster.preset("l40s-100gbe", nodes=2)
    assert l40s.device.peak_flops["bf16"] == 362e12 and l40s.device.memory_bytes == 48e9
    assert l40s.inter_node.bandwidth_bytes_per_s == pytest.approx(100e9 / 8 * 0.9)
    pcie = Cluster.preset("a100-pcie-25gbe")
    assert pcie.device.hbm_bandwidth_bytes_per_s == 1.935e12
    assert pcie.inter_node.bandwidth_bytes_per_s == pytest.approx(25e9 / 8 * 0.9)
    assert pcie.intra_node.bandwidth_bytes_per_s == 20e9 < a100.intra_node.bandwidth_bytes_per_s / 10
    cpu = Cluster.preset("cpu", gpus_per_node=4)
    assert cpu.world_size == 4 and cpu.device.memory_bytes == 5 * 2**30
    assert set(PRESETS) >= {"dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "dgx-h200", "cpu"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_yaml_round_trip(name: str, tmp_path) -> None:
    c = Cluster.preset(name, nodes=3)
    path = tmp_path / "c.yaml"
    c.to_yaml(path)
    assert Cluster.from_yaml(path) == c
    assert Cluster.from_dict(c.to_dict()) == c
    assert not (tmp_path / "c.yaml.tmp").exists()


def test_yaml_with_preset_units_and_overrides(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "preset: dgx-h100\nnum_nodes: 2\ndevice:\n  memory_bytes: 94 GB\ninter_node:\n  latency_s: 7 us\n"
    )
    c = Cluster.from_yaml(path)
    assert c.num_nodes == 2 and c.device.memory_bytes == 94e9
    assert c.inter_node.latency_s == pytest.approx(7e-6)
    assert c.inter_node.bandwidth_bytes_per_s == 400e9  # from the preset


def _full() -> dict:
    return Cluster.preset("dgx-a100-80g").to_dict()


def _drop(d: dict, *path: str) -> dict:
    node = d
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return d


def _set(d: dict, value: object, *path: str) -> dict:
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_drop(_full(), "num_nodes"), "num_nodes: missing"),
        (_drop(_full(), "device", "memory_bytes"), "device.memory_bytes: missing"),
        (_drop(_full(), "intra_node", "latency_s"), "intra_node.latency_s: missing"),
        (
            _set(_full(), -1, "device", "memory_bytes"),
            "device.memory_bytes: expected a positive number",
        ),
        (
            _set(_full(), 0, "device", "memory_bytes"),
            "device.memory_bytes: expected a positive number",
        ),
        (
            _set(_full(), 0, "inter_node", "bandwidth_bytes_per_s"),
            "inter_node.bandwidth_bytes_per_s: expected a positive number",
        ),
        (
            _set(_full(), -5, "intra_node", "bandwidth_bytes_per_s"),
            "intra_node.bandwidth_bytes_per_s: expected a positive number",
        ),
        (_set(_full(), "two", "num_nodes"), "num_nodes: expected a positive integer"),
        (_set(_full(), 2.5, "gpus_per_node"), "gpus_per_node: expected a positive integer"),
        (_set(_full(), [1], "device", "memory_bytes"), "device.memory_bytes: expected a number"),
        (
            _set(_full(), "lots", "device", "hbm_bandwidth_bytes_per_s"),
            "device.hbm_bandwidth_bytes_per_s: expected a number with a unit",
        ),
        (
            _set(_full(), "80 parsecs", "device", "memory_bytes"),
            "device.memory_bytes: can't read the unit",
        ),
        (
            _set(_full(), 1.5, "device", "matmul_efficiency"),
            "device.matmul_efficiency: expected a fraction",
        ),
        (
            _set(_full(), -1, "device", "peak_flops", "bf16"),
            "device.peak_flops.bf16: expected a positive",
        ),
        (_drop(_full(), "device", "peak_flops", "bf16"), "device.peak_flops.bf16"),
        (
            _set(_full(), 1, "device", "peak_flops", "int4"),
            "device.peak_flops.int4: expected a dtype",
        ),
        (_set(_full(), 1, "bogus"), "bogus: unknown field"),
        ({"preset": "dgx-z900"}, "preset: unknown cluster preset 'dgx-z900'"),
        ([1, 2], "cluster: expected a mapping"),
    ],
)
def test_malformed_cluster_names_the_field(data: object, message: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        Cluster.from_dict(data)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_yaml_file_errors(tmp_path) -> None:
    with pytest.raises(ClusterSpecError, match="does not exist"):
        Cluster.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_nodes: [1, 2\n")
    with pytest.raises(ClusterSpecError, match="not valid YAML"):
        Cluster.from_yaml(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ClusterSpecError, match="is empty"):
        Cluster.from_yaml(empty)
    neg = tmp_path / "neg.yaml"
    d = _set(_full(), -80, "device", "memory_bytes")
    neg.write_text(yaml.safe_dump(d))
    with pytest.raises(ClusterSpecError, match=r"neg.yaml: device.memory_bytes: expected a positive"):
        Cluster.from_yaml(neg)


def test_unknown_preset_and_load() -> None:
    with pytest.raises(ClusterSpecError, match="unknown cluster preset 'dgx-x'"):
        Cluster.preset("dgx-x")
    assert Cluster.load("dgx-h100", nodes=2).world_size == 16
    with pytest.raises(ClusterSpecError, match="no peak FLOP/s for fp8"):
        Cluster.preset("dgx-h100").device.achievable_flops("fp8")


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("80 GB", "bytes", 80e9),
        ("80GiB", "bytes", 80 * 2**30),
        ("400 GB/s", "bytes_per_s", 400e9),
        ("989 TFLOP/s", "flops", 989e12),
        ("5 us", "seconds", 5e-6),
        ("1.5e3", "bytes", 1500.0),
        (12, "bytes", 12.0),
    ],
)
def test_parse_quantity(text: object, kind: str, value: float) -> None:
    assert parse_quantity(text, kind, "f") == pytest.approx(value)
