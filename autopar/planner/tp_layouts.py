"""What the per-operator TP choice (``tp_ilp``) means for a whole model and for the planner.

``layer_choices`` runs one ``choose_layer`` ILP per block type and one for embedding and head;
``cost_models.tp_layout.layout_of`` prices such a choice for the outer cost model; ``tp_tables``
writes it into the Plan; ``TPLayouts`` caches the layouts the planner's search prices, and
offers the leanest layout as a second candidate where it differs from the fastest (the
per-operator ILP trades time for memory; the outer search, which knows the memory of the whole
plan, decides which side of that trade it needs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from autopar import cache
from autopar.cluster import Cluster
from autopar.cost_models.terms import TPLayer, TPLayout
from autopar.errors import AutoparError
from autopar.planner.profiles import ModelProfiles
from autopar.strategy import Strategy, remat

if TYPE_CHECKING:  # the graph and its ILPs: imported where a layout is solved, not read from the cache
    from torch import fx

    from autopar.cost_models.tp import LayerTP
    from autopar.graph import CapturedModel, Layer
    from autopar.passes.tp_graph import GraphIndex


def plan_table(
    gm: fx.GraphModule, layer: int, prefix: str, choice: LayerTP
) -> tuple[tuple[str, str, str], ...]:
    """Every operator's choice as (op key, strategy, output placement) for the Plan. At run time
    an operator the table doesn't name (a no-op traced only at another batch size) follows its
    inputs (``tp_rules.propagate``)."""
    from autopar.passes.tp_graph import layer_nodes, op_keys

    nodes = layer_nodes(gm, layer)
    keys = op_keys(nodes, prefix)
    return tuple((keys[n.name], choice.strategies[n.name].name, choice.strategies[n.name].out) for n in nodes)


def layer_choices(
    cap: CapturedModel,
    cluster: Cluster,
    tp: int,
    dtype: str,
    *,
    sp: bool = False,
    objective: str = "time",
    fastest: list[tuple[int, tuple[Layer, ...], LayerTP]] | None = None,
    index: GraphIndex | None = None,
    forward_passes: int = 1,
) -> list[tuple[int, tuple[Layer, ...], LayerTP]]:
    """Every ILP a model needs, as (times it runs per micro-batch, the layers one solve covers,
    choice): one per block type (solved on its first block), and one for embedding and head
    together (they may share a weight, which then takes one placement). ``fastest``: this
    function's answer for ``time`` (``choose_layer`` may reuse it for ``memory``);
    ``forward_passes``: ``forward_passes(st, blocks)``."""
    from autopar.passes.tp_graph import index_graph
    from autopar.planner.tp_ilp import choose_layer

    blocks: dict[str, list[Layer]] = {}
    for layer in cap.layers[1:-1]:
        blocks.setdefault(layer.type, []).append(layer)
    index = index or index_graph(cap.gm)
    groups: list[tuple[int, tuple[Layer, ...]]] = [(len(same), (same[0],)) for same in blocks.values()]
    groups.append((1, (cap.layers[0], cap.layers[-1])))
    hints = [choice for _, _, choice in fastest] if fastest else [None] * len(groups)
    return [
        (
            repeats,
            layers,
            choose_layer(
                cap.gm,
                layers[0].index if len(layers) == 1 else tuple(layer.index for layer in layers),
                tp,
                cluster,
                dtype=dtype,
                sp=sp,
                objective=objective,
                index=index,
                fastest=hint,
                forward_passes=forward_passes,
            ),
        )
        for (repeats, layers), hint in zip(groups, hints, strict=True)
    ]


def forward_passes(st: Strategy, blocks: int) -> int:
    """How often a block's forward runs per micro-batch: 2 when every block is checkpointed whole
    (full or a per-operator policy: its forward runs again in backward), else 1 (a mix is priced
    as no recompute: the per-operator choice is made once for a block type; the outer model
    still counts each such block's collectives twice)."""
    whole = all(
        sum(n for r, n in zip(st.choices, counts, strict=True) if remat(r)) == sum(counts)
        for counts in st.blocks_per_rank(blocks)
    )
    return 2 if whole else 1


def tp_tables(
    cap: CapturedModel, cluster: Cluster, st: Strategy, *, heads: int | None, blocks: int
) -> Tables:
    """Per layer type, the per-operator TP strategies the ILPs choose for ``st`` on ``cap`` (best:
    the graph captured at the plan's micro-batch); empty at tp 1."""
    if st.tp == 1:
        return ()
    if heads and heads % st.tp:
        raise AutoparError(
            f"tp {st.tp}: no way to split {heads} attention heads {st.tp} ways; "
            "choose a tp that divides the head count"
        )
    passes = forward_passes(st, blocks)  # the model's blocks (the capture may hold fewer)
    choices = layer_choices(
        cap,
        cluster,
        st.tp,
        st.dtype,
        sp=st.sequence_parallel,
        objective=st.tp_objective,
        forward_passes=passes,
    )
    return tuple(
        (layer.type, plan_table(cap.gm, layer.index, layer.name, choice))
        for _, layers, choice in choices
        for layer in layers
    )


Tables = tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...]
"""Per layer type, every operator's (op key, strategy, output placement): ``Plan.tensor_parallel``."""


def cache_key(
    profiles: ModelProfiles, cluster: Cluster, dtype: str, micro_batch: int, key: tuple[int, bool, str, int]
) -> dict[str, Any] | None:
    """What names a per-operator TP choice in the disk cache (``autopar.cache``): the model's
    captures, the cluster, dtype, the graph's micro-batch and the ILP's knobs (tp, sp, objective,
    forward passes); None for a model that is never cached."""
    if profiles.key is None:
        return None
    tp, sp, objective, passes = key
    knobs = {"tp": tp, "sp": sp, "objective": objective, "passes": passes}
    return {**profiles.key, "cluster": cluster.to_dict(), "dtype": dtype, "micro_batch": micro_batch, **knobs}


def plan_tables(profiles: ModelProfiles, cluster: Cluster, st: Strategy) -> Tables:
    """``tp_tables`` on the graph captured at the plan's micro-batch, from the disk cache where a
    capture of the same code solved them (``autopar.cache``)."""
    if st.tp == 1:
        return ()
    base = profiles.base
    passes = forward_passes(st, base.blocks)
    where = cache_key(
        profiles, cluster, st.dtype, st.micro_batch, (st.tp, st.sequence_parallel, st.tp_objective, passes)
    )
    hit = cache.load("tables", where) if where is not None else None
    if hit is not None:
        return tuple((str(kind), tuple((str(k), str(s), str(o)) for k, s, o in rows)) for kind, rows in hit)
    tables = tp_tables(profiles.captured(st.micro_batch), cluster, st, heads=base.heads, blocks=base.blocks)
    if where is not None:
        cache.store("tables", where, [[kind, [list(r) for r in rows]] for kind, rows in tables])
    return tables


LEAN_GAIN = 0.01
"""The least saving of parameters per rank for which the leanest TP layout is searched too."""


class TPLayouts:
    """Strategy → the per-operator TP choice at its width (``layout_of``), solved once per
    (tp, sp, objective) on one captured graph (collective sizes scale with the micro-batch);
    None at tp 1. The outer search prices tensor parallelism with what the chosen
    operators issue and keep, not with Megatron's count."""

    def __init__(
        self, profiles: ModelProfiles, cluster: Cluster, dtype: str, *, micro_batch: int = 1
    ) -> None:
        """``micro_batch``: whose graph the per-operator ILPs are solved on (``profiles.at(b)``'s
        capture; the search solves once, on micro-batch 1's)."""
        self.profiles, self.cluster, self.dtype, self.micro_batch = profiles, cluster, dtype, micro_batch
        self._index: GraphIndex | None = None
        self.choices: dict[tuple[int, bool, str, int], list[tuple[int, tuple[Layer, ...], LayerTP]]] = {}
        self.solved: dict[tuple[int, bool, str, int], TPLayout] = {}
        self.lean_pays: dict[tuple[int, bool], bool] = {}

    @property
    def graph(self) -> CapturedModel:
        """The graph the ILPs are solved on (captured the first time a width above 1 is priced;
        a profile derived for a micro-batch above 2 holds micro-batch 1's)."""
        graph = self.profiles.at(self.micro_batch).captured
        return graph or self.profiles.captured(self.micro_batch if self.micro_batch <= 2 else 1)

    @property
    def index(self) -> GraphIndex:
        from autopar.passes.tp_graph import index_graph

        if self._index is None:
            self._index = index_graph(self.graph.gm)
        return self._index

    def _choices(
        self, tp: int, sp: bool, objective: str, passes: int
    ) -> list[tuple[int, tuple[Layer, ...], LayerTP]]:
        key = (tp, sp, objective, passes)
        if key not in self.choices:
            fastest = self._choices(tp, sp, "time", passes) if objective == "memory" else None
            self.choices[key] = layer_choices(
                self.graph,
                self.cluster,
                tp,
                self.dtype,
                sp=sp,
                objective=objective,
                fastest=fastest,
                index=self.index,
                forward_passes=passes,
            )
        return self.choices[key]

    def __call__(self, st: Strategy) -> TPLayout | None:
        if st.tp == 1:
            return None
        passes = forward_passes(st, self.profiles.base.blocks)  # the model's (the capture may hold fewer)
        key = (st.tp, st.sequence_parallel, st.tp_objective, passes)
        if key not in self.solved:
            where = cache_key(self.profiles, self.cluster, self.dtype, self.micro_batch, key)
            self.solved[key] = self._cached(where) or self._solve(key, where)
        return self.solved[key]

    @staticmethod
    def _cached(where: dict[str, Any] | None) -> TPLayout | None:
        hit = cache.load("tp", where) if where is not None else None
        if hit is None:
            return None
        return {
            name: TPLayer(
                collectives=tuple((str(k), str(w), float(b)) for k, w, b in t["collectives"]),
                local_params=float(t["local_params"]),
                stream_share=float(t["stream_share"]),
            )
            for name, t in hit.items()
        }

    def _solve(self, key: tuple[int, bool, str, int], where: dict[str, Any] | None) -> TPLayout:
        """The layout solved on the graph (captured now if the profile came from the cache), kept
        in the disk cache under ``where``."""
        from autopar.cost_models.tp_layout import layout_of

        layout = layout_of(self.graph, key[0], self._choices(*key), self.index)
        if where is not None:
            cache.store("tp", where, {name: dataclasses.asdict(t) for name, t in layout.items()})
        return layout

    def variants(self, st: Strategy) -> list[Strategy]:
        """``st`` with the fastest layout, and with the leanest where that keeps at least
        ``LEAN_GAIN`` fewer parameters per rank over the whole model (what the outer memory model
        sees of a layout; a smaller saving would double the search for nothing); a strategy
        already ``memory`` stays as it is."""
        return [st, replace(st, tp_objective="memory")] if self.lean_pays_for(st) else [st]

    def lean_pays_for(self, st: Strategy) -> bool:
        """Whether ``variants`` gives ``st`` a leanest twin (solved once per TP width and SP)."""
        if st.tp == 1 or st.tp_objective != "time":
            return False
        key = (st.tp, st.sequence_parallel)
        if key not in self.lean_pays:
            types = self.profiles.base.layers  # every layer of the model by type

            def kept(layout: TPLayout | None) -> float:
                assert layout is not None
                return sum(layout[t].local_params for t in types)

            lean = replace(st, tp_objective="memory")
            self.lean_pays[key] = kept(self(lean)) < (1 - LEAN_GAIN) * kept(self(st))
        return self.lean_pays[key]


__all__ = [
    "TPLayouts",
    "cache_key",
    "forward_passes",
    "layer_choices",
    "plan_table",
    "plan_tables",
    "tp_tables",
]
