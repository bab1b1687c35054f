"""What the per-operator TP choice (``tp_choice``) means for a whole model and for the planner.

``layer_choices`` runs one ``choose_layer`` ILP per block type and one for embedding and head;
``layout_of`` sums a choice up for the outer cost model (collectives per sequence, parameters
per rank); ``tp_tables`` writes it into the Plan; ``TPLayouts`` caches the layouts the planner's
search prices, and offers the leanest layout as a second candidate where it differs from the
fastest (the per-operator ILP trades time for memory; the outer search, which knows the
memory of the whole plan, decides which side of that trade it needs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import fx

from autopar.cluster import Cluster
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.strategy import Strategy
from autopar.cost_models.terms import TPLayer, TPLayout
from autopar.errors import AutoparError
from autopar.graph import CapturedModel, Layer
from autopar.tp_choice import (
    LOSS,
    GraphIndex,
    LayerTP,
    choose_layer,
    index_graph,
    layer_nodes,
    op_keys,
)
from autopar.tp_memory import param_numel, param_owners, param_split


def plan_table(
    gm: fx.GraphModule, layer: int, prefix: str, choice: LayerTP
) -> tuple[tuple[str, str, str], ...]:
    """Every operator's choice as (op key, strategy, output placement) for the Plan. At run time
    an operator the table doesn't name (a no-op traced only at another batch size) follows its
    inputs (``tp_rules.propagate``)."""
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
) -> list[tuple[int, tuple[Layer, ...], LayerTP]]:
    """Every ILP a model needs, as (times it runs per micro-batch, the layers one solve covers,
    choice): one per block type (solved on its first block), and one for embedding and head
    together (they may share a weight, which then takes one placement). ``fastest``: this
    function's answer for ``time`` (``choose_layer`` may reuse it for ``memory``)."""
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
            ),
        )
        for (repeats, layers), hint in zip(groups, hints, strict=True)
    ]


def layout_of(
    cap: CapturedModel,
    tp: int,
    choices: list[tuple[int, tuple[Layer, ...], LayerTP]],
    index: GraphIndex | None = None,
) -> TPLayout:
    """Per layer type, what the per-operator ``choices`` at width ``tp`` cost the outer cost
    model: their collectives (bytes per sequence of the captured micro-batch) and the parameters
    one rank keeps (a weight the choice leaves replicated counts whole)."""
    if tp == 1:
        return {}
    index = index or index_graph(cap.gm)
    layer_of = {n.name: cap.layers[i].type for i, nodes in index.layers.items() for n in nodes}
    out: dict[str, TPLayer] = {}
    for _, layers, choice in choices:
        types = {layer.type for layer in layers}
        coll: dict[str, list[tuple[str, str, float]]] = {name: [] for name in types}
        for c in choice.collectives:
            owner = layers[-1].type if c.at == LOSS else layer_of.get(c.at, layers[0].type)
            coll[owner].append((c.kind, c.phase, c.size_bytes / cap.batch))
        local: dict[str, float] = {name: 0.0 for name in types}
        nodes = [n for layer in layers for n in index.layers.get(layer.index, ())]
        by_name = {n.name: n for n in nodes}
        for (name, pos), param in param_owners(nodes).items():
            split = param_split(choice.strategies[name], by_name[name], pos)
            local[layer_of[name]] += param_numel(param) / (tp if split else 1)
        for name in types:
            out[name] = TPLayer(collectives=tuple(coll[name]), local_params=local[name])
    return out


def tp_tables(
    profile: ModelProfile,
    cluster: Cluster,
    tp: int,
    dtype: str,
    *,
    sp: bool = False,
    objective: str = "time",
    captured: CapturedModel | None = None,
) -> tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...]:
    """Per layer type, the per-operator TP strategies the ILPs choose (empty at tp 1)."""
    cap = captured if captured is not None else profile.captured  # best: the graph at the plan's b
    if tp == 1 or cap is None:
        return ()
    if profile.heads and profile.heads % tp:
        raise AutoparError(
            f"tp {tp}: no way to split {profile.heads} attention heads {tp} ways; "
            "choose a tp that divides the head count"
        )
    return tuple(
        (layer.type, plan_table(cap.gm, layer.index, layer.name, choice))
        for _, layers, choice in layer_choices(cap, cluster, tp, dtype, sp=sp, objective=objective)
        for layer in layers
    )


LEAN_GAIN = 0.01
"""The least saving of parameters per rank for which the leanest TP layout is searched too."""


class TPLayouts:
    """Strategy → the per-operator TP choice at its width (``layout_of``), solved once per
    (tp, sp, objective) on the graph captured at micro-batch 1 (collective sizes scale with the
    micro-batch); None at tp 1 or when no graph was captured. The outer search prices tensor
    parallelism with what the chosen operators issue and keep, not with Megatron's count."""

    def __init__(self, profile_at: Callable[[int], ModelProfile], cluster: Cluster, dtype: str) -> None:
        captured = getattr(profile_at, "captured", None)
        self.graph = captured(1) if captured is not None else profile_at(1).captured
        self.cluster, self.dtype = cluster, dtype
        self.index = index_graph(self.graph.gm) if self.graph is not None else None
        self.choices: dict[tuple[int, bool, str], list[tuple[int, tuple[Layer, ...], LayerTP]]] = {}
        self.solved: dict[tuple[int, bool, str], TPLayout] = {}
        self.lean_pays: dict[tuple[int, bool], bool] = {}

    def _choices(self, tp: int, sp: bool, objective: str) -> list[tuple[int, tuple[Layer, ...], LayerTP]]:
        assert self.graph is not None
        key = (tp, sp, objective)
        if key not in self.choices:
            fastest = self._choices(tp, sp, "time") if objective == "memory" else None
            self.choices[key] = layer_choices(
                self.graph,
                self.cluster,
                tp,
                self.dtype,
                sp=sp,
                objective=objective,
                fastest=fastest,
                index=self.index,
            )
        return self.choices[key]

    def __call__(self, st: Strategy) -> TPLayout | None:
        if st.tp == 1 or self.graph is None:
            return None
        key = (st.tp, st.sequence_parallel, st.tp_objective)
        if key not in self.solved:
            self.solved[key] = layout_of(self.graph, st.tp, self._choices(*key), self.index)
        return self.solved[key]

    def variants(self, st: Strategy) -> list[Strategy]:
        """``st`` with the fastest layout, and with the leanest where that keeps at least
        ``LEAN_GAIN`` fewer parameters per rank over the whole model (what the outer memory model
        sees of a layout; a smaller saving would double the search for nothing); a strategy
        already ``memory`` stays as it is."""
        if st.tp == 1 or self.graph is None or st.tp_objective != "time":
            return [st]
        lean = replace(st, tp_objective="memory")
        key = (st.tp, st.sequence_parallel)
        if key not in self.lean_pays:
            layers = self.graph.layers

            def kept(layout: TPLayout | None) -> float:
                assert layout is not None
                return sum(layout[layer.type].local_params for layer in layers)

            self.lean_pays[key] = kept(self(lean)) < (1 - LEAN_GAIN) * kept(self(st))
        return [st, lean] if self.lean_pays[key] else [st]


def lay(layouts: TPLayouts | None, st: Strategy) -> TPLayout | None:
    """The layout ``st`` is priced with: its per-operator choice, or None (Megatron's count)."""
    return layouts(st) if layouts else None


__all__ = ["TPLayouts", "lay", "layer_choices", "layout_of", "plan_table", "tp_tables"]
