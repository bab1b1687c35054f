"""A strategy on a mixed cluster (``groups.MixedCluster``): each pipeline rank of each
data-parallel replica priced on its own group's device and links, by the same terms as on one
type of node (``terms.build_terms`` on the group's ``view``).

A plan says which group each node rank is (``node_groups``); ranks fill nodes in order, so a
rank's group is its node's, and the tp·cp ranks of one cell (a pipeline rank of one replica)
must share a group. Replicas with the same group stage by stage and the same micro-batch count
(``Strategy.dp_shares``) are priced once (``ReplicaClass``). The step (estimate's module doc,
Narayanan et al. SC'21 Eq. 1, per class c of m_c micro-batches):

    T = max_c (m_c + bubble) · (max_k t_{k,c} + t_p2p,c)  +  max over cells of exposed DP/ZeRO
        +  max over cells of the optimizer step

Replicas meet only at the gradient reduction, so each class's pipeline runs at its own pace and
the reduction waits for the slowest; a stage whose replicas sit in different groups reduces over
the slower of their networks and ``between``, a replica whose stages do sends its activations
over it. A faster group's devices idle for T less their own work (``group_summaries``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models.bands import band
from autopar.cost_models.estimate import Estimate, StageMemory, breakdown_s, stage_layer_names, step_flops
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.rank_load import RankLoad, rank_load, rank_memory_terms
from autopar.cost_models.terms import Terms, TPLayout, Units, build_terms, p2p_s
from autopar.cost_models.timeline import stage_times
from autopar.errors import AutoparError
from autopar.groups import MixedCluster
from autopar.mesh import node_of
from autopar.strategy import Strategy, check_strategy

OUTSIDE = ("dp_comm", "optimizer")
"""Breakdown terms outside a replica's pipeline: the cells' worst, whichever class it is in."""


@dataclass(frozen=True, kw_only=True)
class ReplicaClass:
    """Data-parallel replicas alike: the same group at every pipeline rank, the same micro-batches."""

    replicas: tuple[int, ...]
    """Their data-parallel indices."""
    micro_batches: int
    """Micro-batches each runs per step."""
    groups: tuple[int, ...]
    """The group (index into ``MixedCluster.groups``) of each pipeline rank."""
    terms: tuple[Terms, ...]
    """Each pipeline rank's terms on its group's device, at ``micro_batches``."""
    capacity: tuple[float, ...]
    """Each pipeline rank's device memory (bytes)."""
    p2p_s: float
    """Sends per micro-batch on the slowest hop between its pipeline ranks."""


def cell_groups(mixed: MixedCluster, st: Strategy, node_groups: Sequence[str]) -> list[list[int]]:
    """[pipeline rank][replica] → group index of that cell's ranks under ``node_groups``."""
    if st.world_size != mixed.world_size:
        raise AutoparError(f"the plan uses {st.world_size} GPUs but the mixed cluster has {mixed.world_size}")
    if len(node_groups) != mixed.num_nodes:
        raise AutoparError(f"node_groups names {len(node_groups)} nodes; the cluster has {mixed.num_nodes}")
    for g in mixed.groups:
        if (n := list(node_groups).count(g.name)) != g.num_nodes:
            raise AutoparError(f"node_groups places {n} nodes in group {g.name}; it has {g.num_nodes}")
    grid = [[-1] * st.dp for _ in range(st.pp)]
    for rank in range(st.world_size):
        g = mixed.index(node_groups[node_of(rank, mixed.gpus_per_node)])
        k, d = st.dims.coordinate(rank, "pp"), st.dims.coordinate(rank, "dp")
        if grid[k][d] not in (-1, g):
            raise AutoparError(
                f"pipeline rank {k} of replica {d} has ranks in groups {mixed.groups[grid[k][d]].name} and "
                f"{mixed.groups[g].name}: the tp·cp ranks of one stage of one replica need one device type"
            )
        grid[k][d] = g
    return grid


def replica_classes(
    profile: ModelProfile,
    mixed: MixedCluster,
    st: Strategy,
    node_groups: Sequence[str],
    *,
    reserve_bytes: float | None = None,
    tp_layout: TPLayout | None = None,
    units: Callable[[Strategy, Cluster], Units] | None = None,
) -> tuple[ReplicaClass, ...]:
    """The replicas of ``st`` under ``node_groups``, grouped into classes priced alike
    (``units``: each layer's unit terms on a group's view, where a caller keeps them)."""
    grid = cell_groups(mixed, st, node_groups)
    alike: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for d in range(st.dp):
        key = (tuple(grid[k][d] for k in range(st.pp)), st.replica_micro_batches(d))
        alike.setdefault(key, []).append(d)
    built: dict[tuple[int, bool, int], Terms] = {}

    def terms_of(g: int, crossing: bool, st_m: Strategy) -> Terms:
        key = (g, crossing, st_m.micro_batches)
        if key not in built:
            view = mixed.view(g, crossing=crossing)
            known = units(st_m, view) if units is not None else None
            built[key] = build_terms(
                profile, view, st_m, reserve_bytes=reserve_bytes, tp_layout=tp_layout, units=known
            )
        return built[key]

    out = []
    for (groups, m), replicas in alike.items():
        st_m = replace(st, global_batch=m * st.dp * st.micro_batch, dp_shares=())  # m micro-batches
        terms = tuple(terms_of(g, len(set(grid[k])) > 1, st_m) for k, g in enumerate(groups))
        hop = max(t.p2p_s for t in terms)
        if len(set(groups)) > 1:  # a send between groups: over the slower network and ``between``
            hop = max(hop, *(p2p_s(profile, mixed.view(g, crossing=True), st_m) for g in groups))
        out.append(
            ReplicaClass(
                replicas=tuple(replicas),
                micro_batches=m,
                groups=groups,
                terms=terms,
                capacity=tuple(float(mixed.groups[g].device.memory_bytes) for g in groups),
                p2p_s=hop,
            )
        )
    return tuple(out)


def mixed_estimate(
    profile: ModelProfile,
    mixed: MixedCluster,
    st: Strategy,
    node_groups: Sequence[str],
    *,
    reserve_bytes: float | None = None,
    tp_layout: TPLayout | None = None,
    units: Callable[[Strategy, Cluster], Units] | None = None,
    classes: tuple[ReplicaClass, ...] | None = None,
) -> Estimate:
    """Price ``st`` placed by ``node_groups`` on ``mixed`` (module doc; ``units`` as
    ``replica_classes``'; ``classes``: its replica classes where the caller has them: the terms
    don't depend on the layout)."""
    check_strategy(
        st, world_size=mixed.world_size, blocks=profile.blocks, heads=profile.heads, experts=profile.experts
    )
    classes = classes or replica_classes(
        profile, mixed, st, node_groups, reserve_bytes=reserve_bytes, tp_layout=tp_layout, units=units
    )
    counts = st.blocks_per_rank(profile.blocks)
    runs = []
    for c in classes:
        loads = [rank_load(t, k, counts[k]) for k, t in enumerate(c.terms)]
        runs.append((c, loads, breakdown_s(c.terms, loads, p2p_s=c.p2p_s)))
    c, loads, parts = max(runs, key=lambda r: sum(v for k, v in r[2].items() if k not in OUTSIDE))
    breakdown = {k: max(r[2][k] for r in runs) if k in OUTSIDE else v for k, v in parts.items()}
    step = sum(breakdown.values())
    memory, capacity = _tightest_memory(runs, st.pp)
    model_flops, hardware_flops = step_flops(profile, c.terms[0], st, counts)
    peak = sum(
        g.world_size * g.device.peak_flops.get(st.dtype, g.device.peak_flops["bf16"]) for g in mixed.groups
    )
    world = st.world_size
    slow_device = mixed.groups[max(c.groups, key=lambda g: 1 / mixed.groups[g].device.peak_flops["bf16"])]
    return Estimate(
        strategy=st,
        step_time_s=step,
        breakdown_s=breakdown,
        tokens_per_s=st.global_batch * st.seq / step,
        tflops_per_gpu=model_flops / step / world / 1e12,
        hardware_tflops_per_gpu=hardware_flops / step / world / 1e12,
        mfu=model_flops / step / peak,
        hfu=hardware_flops / step / peak,
        memory=memory,
        memory_capacity_bytes=min(capacity),
        stage_capacity_bytes=capacity,
        stage_layers=tuple(tuple(names) for names in stage_layer_names(profile, st)),
        notes=(f"mixed cluster {mixed.describe()}: each stage priced on its group's device",),
        compute_basis="each group's peak × matmul efficiency (its preset or YAML)",
        stage_times=tuple(stage_times(t, counts, loads)[k] for k, t in enumerate(c.terms)),
        p2p_hop_s=c.p2p_s / (2 * st.virtual_stages),
        recompute_choices={
            r: {"act_bytes": u.act_bytes, "recompute_s": u.recompute_s} for r, u in c.terms[0].block.items()
        },
        band=band(st, slow_device.device.name),
        groups=group_summaries(mixed, runs, step),
    )


def _tightest_memory(
    runs: list[tuple[ReplicaClass, list[RankLoad], dict[str, float]]], pp: int
) -> tuple[tuple[StageMemory, ...], tuple[float, ...]]:
    """Each pipeline rank's memory where it is fullest of its device among the classes."""
    memory, capacity = [], []
    for k in range(pp):
        rows = [
            (StageMemory(stage=k, **rank_memory_terms(c.terms[k], k, loads[k])), c.capacity[k])
            for c, loads, _ in runs
        ]
        mem, cap = max(rows, key=lambda r: r[0].peak_bytes / r[1])
        memory.append(mem)
        capacity.append(cap)
    return tuple(memory), tuple(capacity)


def group_summaries(
    mixed: MixedCluster, runs: list[tuple[ReplicaClass, list[RankLoad], dict[str, float]]], step_s: float
) -> tuple[dict[str, Any], ...]:
    """Per group: its pipeline ranks and replicas, micro-batches, and its devices' busy and idle
    seconds per step (busy: the micro-batches' forward, backward, recompute and TP work of its
    cells, averaged over them; idle: the step less that)."""
    out = []
    for g, group in enumerate(mixed.groups):
        cells = [(c, loads[k], k) for c, loads, _ in runs for k, at in enumerate(c.groups) if at == g]
        if not cells:
            continue
        mean_busy = sum(c.micro_batches * load.time_s for c, load, _ in cells) / len(cells)
        out.append(
            {
                "group": group.name,
                "device": group.device.name,
                "gpus": group.world_size,
                "pipeline_ranks": sorted({k for _, _, k in cells}),
                "replicas": sorted({d for c, _, _ in cells for d in c.replicas}),
                "micro_batches": sorted({c.micro_batches for c, _, _ in cells}),
                "busy_s": mean_busy,
                "idle_s": max(0.0, step_s - mean_busy),
                "idle_share": max(0.0, 1 - mean_busy / step_s),
            }
        )
    return tuple(out)


__all__ = ["ReplicaClass", "cell_groups", "group_summaries", "mixed_estimate", "replica_classes"]
