"""Mixed clusters: nodes of different GPU types, memory sizes and networks in one job.

A ``MixedCluster`` is node groups, each a homogeneous ``Cluster`` (its device, node count,
GPUs per node, NVLink and network), and the link between groups. It comes from a YAML file with
a ``groups:`` list (each entry a cluster as ``Cluster.from_dict`` reads it: a ``preset`` and
overrides, or every field) and an optional ``between:`` link::

    name: a100-h100
    groups:
      - {name: a100, preset: dgx-a100-80g, num_nodes: 2}
      - {name: h100, preset: dgx-h100, num_nodes: 2}
    between: {bandwidth_bytes_per_s: 200 GB/s, latency_s: 10 us}   # per node; default: the
                                                                     # slower group's network

A plan on it says which group each node rank is (``Plan.node_groups``): ranks fill nodes in
order as on one type, so a rank's group is its node's. Groups must have the same GPUs per node
(torchrun's ``--nproc-per-node`` is one number per job).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.cluster import DTYPES, Cluster, DeviceSpec, LinkSpec, link_spec
from autopar.errors import ClusterSpecError
from autopar.spec_fields import mapping, read_yaml, reject_unknown, require, string


@dataclass(frozen=True, kw_only=True)
class MixedCluster:
    """Node groups of different devices, joined group to group by ``between``."""

    name: str
    """The cluster's name, e.g. ``"a100-h100"``."""
    groups: tuple[Cluster, ...]
    """Each node group as a homogeneous cluster; its ``name`` names the group (unique)."""
    between: LinkSpec
    """Per-node network between nodes of different groups (bytes/s each way, latency)."""

    def __post_init__(self) -> None:
        if len(self.groups) < 2:
            raise ClusterSpecError(
                f"groups: a mixed cluster needs at least 2 node groups, got {len(self.groups)} "
                "(one type of node: give it as a plain cluster)"
            )
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ClusterSpecError(f"groups: each group needs its own name, got {names}")
        per_node = {g.gpus_per_node for g in self.groups}
        if len(per_node) != 1:
            raise ClusterSpecError(
                f"groups: every group needs the same gpus_per_node (torchrun runs one number of "
                f"processes per node), got { ({g.name: g.gpus_per_node for g in self.groups}) }"
            )
        for g in self.groups:
            if g.compute_profile is not None or g.comm_profile is not None:
                raise ClusterSpecError(
                    f"groups.{g.name}: measured profiles are not read for node groups yet; "
                    "describe the group's device and links"
                )

    @property
    def gpus_per_node(self) -> int:
        """Devices per node (the same in every group)."""
        return self.groups[0].gpus_per_node

    @property
    def num_nodes(self) -> int:
        """Nodes in all groups."""
        return sum(g.num_nodes for g in self.groups)

    @property
    def world_size(self) -> int:
        """Devices in all groups."""
        return sum(g.world_size for g in self.groups)

    def index(self, name: str) -> int:
        """The position of the group called ``name``."""
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise ClusterSpecError(f"no node group {name!r}; the groups are {[g.name for g in self.groups]}")

    def view(self, group: int, *, crossing: bool = False) -> Cluster:
        """Group ``group``'s devices and links as one cluster of all the job's nodes: what the cost
        models price a rank of that group with. ``crossing``: the rank's data-parallel or pipeline
        peers are in other groups, so its network is the slower of its own and ``between``."""
        g = self.groups[group]
        inter = slower(g.inter_node, self.between) if crossing else g.inter_node
        return dataclasses.replace(g, num_nodes=self.num_nodes, inter_node=inter)

    def ideal(self) -> Cluster:
        """A cluster of all the nodes, each with the best of every group's numbers (most memory,
        highest peaks, fastest links): nothing on the mixed cluster runs faster than on it, so its
        estimates bound the mixed plans' from below (what the planner's search orders by)."""
        devices = [g.device for g in self.groups]
        dtypes = [d for d in DTYPES if all(d in dev.peak_flops for dev in devices)]
        peak = {d: max(dev.peak_flops[d] for dev in devices) for d in dtypes}
        # the efficiencies of the fastest achievable bf16 FLOP/s (matmul and attention apart)
        matmul = max(dev.achievable_flops("bf16") for dev in devices) / peak["bf16"]
        attention = max(dev.achievable_flops("bf16", attention=True) for dev in devices) / peak["bf16"]
        device = DeviceSpec(
            name="+".join(dev.name for dev in devices),
            memory_bytes=max(dev.memory_bytes for dev in devices),
            peak_flops=peak,
            hbm_bandwidth_bytes_per_s=max(dev.hbm_bandwidth_bytes_per_s for dev in devices),
            matmul_efficiency=matmul,
            attention_efficiency=attention,
            overlap_slowdown=min(dev.overlap_slowdown for dev in devices),
        )
        return Cluster(
            name=f"{self.name} (best of each group)",
            num_nodes=self.num_nodes,
            gpus_per_node=self.gpus_per_node,
            device=device,
            intra_node=faster(*(g.intra_node for g in self.groups)),
            inter_node=faster(self.between, *(g.inter_node for g in self.groups)),
        )

    # ---- constructors and files ------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MixedCluster:
        """Build from a dict with ``groups:`` (as read from YAML or written by ``to_dict``)."""
        data = mapping(data, "cluster")
        reject_unknown(data, {"name", "groups", "between"}, "")
        entries = require(data, "groups", "")
        if not isinstance(entries, list):
            raise ClusterSpecError(f"groups: expected a list of node groups, got {type(entries).__name__}")
        groups = []
        for i, entry in enumerate(entries):
            entry = mapping(entry, f"groups[{i}]")
            if "name" not in entry:
                raise ClusterSpecError(f"groups[{i}]: give the group a name (e.g. name: h100)")
            try:
                groups.append(Cluster.from_dict(entry))
            except ClusterSpecError as e:
                raise ClusterSpecError(f"groups.{entry['name']}: {e}") from None
        between = data.get("between")
        link = slower(*(g.inter_node for g in groups)) if between is None else link_spec(between, "between")
        return cls(name=string(data.get("name", "mixed"), "name"), groups=tuple(groups), between=link)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> MixedCluster:
        """Read a mixed cluster's YAML file."""
        data = read_yaml(path, "cluster file")
        try:
            return cls.from_dict(data)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{os.fspath(path)}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of base-unit numbers; ``MixedCluster.from_dict(c.to_dict()) == c``."""
        return {
            "name": self.name,
            "groups": [g.to_dict() for g in self.groups],
            "between": dataclasses.asdict(self.between),
        }

    def describe(self) -> str:
        """One line: each group's nodes and device."""
        parts = [f"{g.name}: {g.num_nodes}× {g.gpus_per_node} {g.device.name}" for g in self.groups]
        return f"{self.name} ({'; '.join(parts)})"


AnyCluster = Cluster | MixedCluster
"""What a plan can be made for: one type of node, or node groups."""


def faster(*links: LinkSpec) -> LinkSpec:
    """The best of ``links``: the highest bandwidth and the lowest latency."""
    return LinkSpec(
        bandwidth_bytes_per_s=max(x.bandwidth_bytes_per_s for x in links),
        latency_s=min(x.latency_s for x in links),
    )


def slower(*links: LinkSpec) -> LinkSpec:
    """The worst of ``links``: the lowest bandwidth and the highest latency."""
    return LinkSpec(
        bandwidth_bytes_per_s=min(x.bandwidth_bytes_per_s for x in links),
        latency_s=max(x.latency_s for x in links),
    )


def load_cluster(spec: str, *, nodes: int | None = None, gpus_per_node: int | None = None) -> AnyCluster:
    """The CLI's CLUSTER argument: a preset, a YAML file, or a YAML file of node groups."""
    if spec.endswith((".yaml", ".yml")) and os.path.isfile(spec):
        data = read_yaml(spec, "cluster file")
        if isinstance(data, Mapping) and "groups" in data:
            if nodes is not None or gpus_per_node is not None:
                raise ClusterSpecError(
                    f"{spec} has node groups: set num_nodes and gpus_per_node per group in the file "
                    "instead of --nodes / --gpus-per-node"
                )
            return MixedCluster.from_yaml(spec)
    return Cluster.load(spec, nodes=nodes, gpus_per_node=gpus_per_node)


def load_one_type(
    spec: str, *, nodes: int | None = None, gpus_per_node: int | None = None, what: str = "this command"
) -> Cluster:
    """``load_cluster`` for commands that run on one type of node: node groups are refused in one
    line saying which command plans them."""
    cluster = load_cluster(spec, nodes=nodes, gpus_per_node=gpus_per_node)
    if isinstance(cluster, MixedCluster):
        raise ClusterSpecError(
            f"{spec} describes node groups ({cluster.describe()}): `autopar plan` plans them and `autopar "
            f"verify --plan` checks the plan; {what} needs one type of node for now"
        )
    return cluster


__all__ = [
    "AnyCluster",
    "MixedCluster",
    "faster",
    "load_cluster",
    "load_one_type",
    "slower",
]
