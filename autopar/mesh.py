"""The plan's device mesh as arithmetic: its dims outermost first, each group's size and
stride, a rank's coordinates, the ranks of every group, which groups leave a node.

The one owner of the rank layout (torchtitan's ``ParallelDims``): the cost models price a group
by its ``Axis`` (size and stride), the planner asks which axes cross nodes, the runtime builds
its ``DeviceMesh`` from ``mesh_dims`` and ``flattened`` and its ad-hoc groups from ``groups``,
the monitor asks for a rank's stage. No other module computes a stride or a coordinate
(``tests/autopar/test_mesh.py`` reads the tree for it, as ``test_architecture`` does for cycles).

Ranks fill the mesh row-major (torch's ``init_device_mesh``), TP innermost so that its groups
stay inside a node, data parallelism next, the pipeline outermost:

    rank = ((pp_i · dp + dp_i) · cp + cp_i) · tp + tp_i,   dp_i = rep_i · dp_shard + shard_i   (HSDP)
                                                           dp_i = edp_i · ep + ep_i            (EP)

so a group of n ranks along a dim spaced s apart has stride s = the product of the sizes of
the dims inside it, and a rank's coordinate on it is (rank // s) mod n. Context parallelism
(each sequence split over cp ranks) sits between dp and tp, as torchtitan orders it; its dim
is in the mesh only when cp > 1, so every other plan's mesh is (pp, dp, tp) as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Axis:
    """A family of process groups: ``size`` ranks each, ``stride`` ranks apart."""

    name: str
    size: int
    stride: int

    def coordinate(self, rank: int) -> int:
        """``rank``'s index within its group: (rank // stride) mod size."""
        return (rank // self.stride) % self.size

    def crosses_nodes(self, gpus_per_node: int) -> bool:
        """Whether a group spans more than one node (ranks fill nodes in order): its first and
        last rank are (size − 1)·stride apart, so it fits a node when size · stride ≤ the node's
        GPUs (groups aligned to nodes, as every mesh dim's are)."""
        return self.size > 1 and self.size * self.stride > gpus_per_node

    def per_node(self, gpus_per_node: int) -> int:
        """Ranks of one group on one node: all of them when the group fits a node, else the
        node's GPUs ÷ the stride (one when the stride is a node or more)."""
        if not self.crosses_nodes(gpus_per_node):
            return self.size
        return max(1, min(self.size, gpus_per_node // self.stride))


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of a plan and the mesh they lay out (``Strategy.dims``)."""

    pp: int = 1
    """Pipeline stages (outermost dim)."""
    dp: int = 1
    """Data-parallel ranks, as (dp_replicate, dp_shard) under HSDP, (dp / ep, ep) under EP."""
    tp: int = 1
    """Tensor-parallel ranks (innermost dim)."""
    dp_replicate: int = 1
    """HSDP replica groups of dp / dp_replicate shard ranks each (1: no HSDP)."""
    ep: int = 1
    """Expert-parallel ranks, taken from dp (1: no EP)."""
    cp: int = 1
    """Context-parallel ranks: each sequence split over cp ranks (between dp and tp)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "dp_replicate", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh degree {name} must be a positive integer, got {value!r}")
        if self.dp % self.dp_replicate or self.dp % self.ep or (self.ep > 1 and self.dp_replicate > 1):
            raise ValueError(
                f"dp {self.dp} must split into dp_replicate {self.dp_replicate} or ep {self.ep} "
                "groups, not both"
            )
        if self.cp > 1 and (self.ep > 1 or self.dp_replicate > 1):
            raise ValueError(f"cp {self.cp} runs without HSDP and expert parallelism")

    @property
    def world_size(self) -> int:
        """Ranks in the mesh: pp · dp · cp · tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same weights and sum their gradients (FSDP2's and DDP's group): the
        data-parallel ranks times the context-parallel ones (torchtitan's ``dp_shard_cp``), as
        each cp rank trains on its part of the same sequences."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks of one HSDP shard group: dp / dp_replicate."""
        return self.dp // self.dp_replicate

    @cached_property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's dims and sizes, outermost first (torchtitan's names): (pp, dp, tp),
        dp as (dp_replicate, dp_shard) under HSDP and as (edp, ep) under EP — ep consecutive
        ranks split each MoE layer's experts, the dp / ep "edp" ranks hold the same ones — and
        (pp, dp, cp, tp) when cp > 1."""
        if self.ep > 1:
            data: tuple[tuple[str, int], ...] = (("edp", self.dp // self.ep), ("ep", self.ep))
        elif self.dp_replicate > 1:
            data = (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard))
        else:
            data = (("dp", self.dp),)
        context = (("cp", self.cp),) if self.cp > 1 else ()
        return (("pp", self.pp), *data, *context, ("tp", self.tp))

    @cached_property
    def flattened(self) -> dict[str, tuple[str, ...]]:
        """Groups that are several adjacent mesh dims at once (``DeviceMesh._flatten``): "dp"
        where the data axis is two dims (what runs over all of it: data, loss, dense ZeRO);
        "dp_cp" when cp > 1 (the data dims and cp: the ranks that reduce the same gradients)."""
        names = tuple(name for name, _ in self.mesh_dims[1:-1] if name != "cp")
        out = {"dp": names} if len(names) > 1 else {}
        return out | ({"dp_cp": (*names, "cp")} if self.cp > 1 else {})

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The dims FSDP2 shards the dense weights over: (dp_replicate, dp_shard) under HSDP (a
        2-D mesh is its hybrid sharding), dp·cp flattened under context parallelism (torchtitan
        folds cp into the shard group), else dp."""
        if self.cp > 1:
            return ("dp_cp",)
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp",)

    @cached_property
    def axes(self) -> dict[str, Axis]:
        """Every group family by name: each mesh dim, each flattened one, the halves of a dp the
        mesh does not split (dp_shard, dp_replicate, edp, ep: all of dp or one rank), and
        "stage" (all ranks of one pipeline stage: every dim inside pp). Stride of a dim = product
        of the sizes of the dims inside it; of a flattened group, its innermost part's."""
        axes: dict[str, Axis] = {}
        stride = 1
        for name, size in reversed(self.mesh_dims):
            axes[name] = Axis(name, size, stride)
            stride *= size
        for name, parts in self.flattened.items():
            axes[name] = Axis(name, math.prod(axes[p].size for p in parts), axes[parts[-1]].stride)
        dp = axes["dp"]
        if "dp_shard" not in axes:  # no HSDP: ZeRO shards over all of dp, one replica
            axes["dp_shard"] = Axis("dp_shard", dp.size, dp.stride)
            axes["dp_replicate"] = Axis("dp_replicate", 1, dp.stride * dp.size)
        if "ep" not in axes:  # no EP: each rank holds every expert, as every dp rank does
            axes["ep"] = Axis("ep", 1, dp.stride)
            axes["edp"] = Axis("edp", dp.size, dp.stride)
        if "cp" not in axes:  # no CP: one rank per sequence; the gradient group is dp's
            axes["cp"] = Axis("cp", 1, axes["tp"].size)
            axes["dp_cp"] = Axis("dp_cp", dp.size, dp.stride)
        axes["stage"] = Axis("stage", self.world_size // self.pp, 1)
        return axes

    def axis(self, name: str) -> Axis:
        """The group family ``name`` (one of ``axes``)."""
        if name not in self.axes:
            raise KeyError(f"no mesh axis {name!r}: one of {', '.join(self.axes)}")
        return self.axes[name]

    def coordinate(self, rank: int, name: str) -> int:
        """``rank``'s index along ``name`` (its pipeline stage for "pp", replica for "dp", …)."""
        return self.axis(name).coordinate(rank)

    def group(self, rank: int, name: str) -> list[int]:
        """The ranks of ``rank``'s group along ``name``, in axis order."""
        a = self.axis(name)
        first = rank - a.coordinate(rank) * a.stride
        return [first + i * a.stride for i in range(a.size)]

    def groups(self, name: str, along: tuple[int, ...] | None = None) -> list[list[int]]:
        """Every group along ``name``, first ranks ascending (the same order on every rank, as
        ``new_subgroups_by_enumeration`` needs); ``along``: only these coordinates of each group
        (the pipeline ranks that share a tied weight, say)."""
        a = self.axis(name)
        picked = range(a.size) if along is None else along
        firsts = [r for r in range(self.world_size) if a.coordinate(r) == 0]
        return [[first + i * a.stride for i in picked] for first in firsts]

    def crossing(self, gpus_per_node: int, names: tuple[str, ...] = ("pp", "dp", "tp")) -> tuple[str, ...]:
        """Those of ``names`` whose groups span more than one node."""
        return tuple(n for n in names if self.axis(n).crosses_nodes(gpus_per_node))


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node ``rank`` runs on: ranks fill nodes in order (torchrun's node ranks)."""
    return rank // gpus_per_node


def simulated() -> bool:
    """Whether this process simulates one rank of the mesh (``autopar dryrun``): its process
    group is torch's ``fake`` backend, whose collectives move no data and which has no timeouts,
    so the checks that ranks agree (plan, batch, random state) have nothing to compare, and what
    peers would send (stage shapes, expert counts) is decided here."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "fake"


def partner(rank: int, distance: int) -> int:
    """The rank paired with ``rank`` when ranks pair up ``distance`` apart (0↔d, 1↔d+1, …,
    2d↔3d, …): how ``profile-comm`` finds a peer inside a node (d = 1) or one node away."""
    return rank + distance if (rank // distance) % 2 == 0 else rank - distance


__all__ = ["Axis", "ParallelDims", "node_of", "partner", "simulated"]
