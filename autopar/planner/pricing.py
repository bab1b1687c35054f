"""One model on one cluster, priced: the path every estimate takes (the search, its
baselines, ``autopar estimate`` and the benchmarks), tensor parallelism priced by the
per-operator choice at its width (``tp_layouts``)."""

from __future__ import annotations

from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models.estimate import Estimate, estimate
from autopar.cost_models.terms import Terms, Units, build_terms, layer_units
from autopar.planner.profiles import ModelProfiles
from autopar.planner.recompute_ilp import frontier
from autopar.planner.tp_layouts import TPLayouts
from autopar.recompute_policy import RecomputePolicy
from autopar.strategy import Strategy


class Pricer:
    """``estimate(strategy)`` and the linear ``terms(strategy)`` the layout ILP solves over, for
    one model (its ``ModelProfiles``) on one cluster; the per-layer units of each (tp, sp, TP
    objective, micro-batch, compile) are built once."""

    def __init__(
        self,
        profiles: ModelProfiles,
        cluster: Cluster,
        *,
        dtype: str,
        reserve_bytes: float | None = None,
        tp_graph_micro_batch: int = 1,
    ) -> None:
        """``tp_graph_micro_batch``: the micro-batch whose graph the per-operator TP choice is
        solved on (``TPLayouts``)."""
        self.profiles, self.cluster, self.reserve_bytes = profiles, cluster, reserve_bytes
        self.layouts = TPLayouts(profiles, cluster, dtype, micro_batch=tp_graph_micro_batch)
        self.dtype = dtype
        self._units: dict[tuple[Any, ...], Units] = {}
        self._policies: tuple[RecomputePolicy, ...] | None = None

    @property
    def policies(self) -> tuple[RecomputePolicy, ...]:
        """The model's per-operator recompute policies on this cluster (``recompute_ilp``),
        found once from the capture at micro-batch 1."""
        if self._policies is None:
            self._policies = frontier(self.profiles.base, self.cluster, self.dtype)
        return self._policies

    def estimate(self, st: Strategy) -> Estimate:
        """The cost model's estimate of ``st`` (its layout, or an even split)."""
        return estimate(
            self.profiles.at(st.rank_sequences),
            self.cluster,
            st,
            reserve_bytes=self.reserve_bytes,
            tp_layout=self.layouts(st),
        )

    def terms(self, st: Strategy) -> Terms:
        """The linear terms of ``st``'s outer knobs (``cost_models.terms``)."""
        prof = self.profiles.at(st.rank_sequences)
        units = self.units(st)
        return build_terms(prof, self.cluster, st, units=units, reserve_bytes=self.reserve_bytes)

    def units(self, st: Strategy, cluster: Cluster | None = None) -> Units:
        """Each layer's unit terms for ``st`` on ``cluster`` (default this pricer's; a mixed
        cluster's group ``view``: ``cost_models.mixed``), built once per what they depend on."""
        cluster = cluster or self.cluster
        # what ``layer_units`` reads of the strategy (ep and skew: its all-to-alls, local experts
        # and the busiest rank's expert rows; the head's rank: its copy of a tied embedding)
        layout = (st.tp, st.sequence_parallel, st.tp_objective, st.micro_batch, st.policies, st.compile)
        key: tuple[Any, ...] = (*layout, st.ep, st.expert_skew, st.head_rank != 0, st.cp)
        if cluster is not self.cluster:  # a group's devices and links (views are made afresh)
            key += (cluster.name, cluster.device.name, cluster.intra_node, cluster.inter_node)
        if key not in self._units:
            prof = self.profiles.at(st.rank_sequences)
            self._units[key] = layer_units(prof, cluster, st, self.layouts(st))
        return self._units[key]


__all__ = ["Pricer"]
