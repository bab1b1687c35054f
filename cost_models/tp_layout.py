"""What a model's per-operator tensor-parallel choices (``cost_models.tp``, one per layer type,
chosen by ``planner.tp_ilp``) cost the outer cost model: per layer type its collectives, the
parameters one rank keeps, and the share of residual-stream work it runs (``terms.TPLayer``).
"""

from __future__ import annotations

from autopar.cost_models.kernels import is_stream_op
from autopar.cost_models.terms import TPLayer, TPLayout
from autopar.cost_models.tp import LOSS, LayerTP, param_numel, param_owners, param_split
from autopar.graph import CapturedModel, Layer
from autopar.passes.tp_graph import GraphIndex, index_graph


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
        shares = _stream_shares(cap, layers, index, choice)
        for name in types:
            out[name] = TPLayer(
                collectives=tuple(coll[name]), local_params=local[name], stream_share=shares[name]
            )
    return out


def _stream_shares(
    cap: CapturedModel, layers: tuple[Layer, ...], index: GraphIndex, choice: LayerTP
) -> dict[str, float]:
    """Per layer type, the byte-weighted compute share the choice gives its residual-stream
    operators (``profile.OpCost.stream``: no FLOPs, (…, h) outputs): 1 replicated, 1/t split."""
    shares: dict[str, float] = {}
    for layer in layers:
        moved = total = 0.0
        for n in index.layers.get(layer.index, ()):
            mem = n.meta.get("autopar.mem_bytes", 0)
            if is_stream_op(n, cap.hidden_size) and mem and n.name in choice.strategies:
                moved, total = moved + mem * choice.strategies[n.name].compute_fraction, total + mem
        shares[layer.type] = moved / total if total else 1.0
    return shares


__all__ = ["layout_of"]
