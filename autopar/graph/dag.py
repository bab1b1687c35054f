"""Dependence in an fx graph through networkx: what is computed from what."""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx
from torch import fx


def digraph(graph: fx.Graph) -> nx.DiGraph:
    """The fx graph as a networkx DiGraph of its nodes: an edge from each input to its user."""
    g = nx.DiGraph()
    g.add_nodes_from(graph.nodes)
    g.add_edges_from((i, n) for n in graph.nodes for i in n.all_input_nodes)
    return g


def downstream(g: nx.DiGraph, sources: Iterable[fx.Node]) -> set[fx.Node]:
    """``sources`` and every node computed from one of them (one breadth-first search from all)."""
    return {n for layer in nx.bfs_layers(g, list(sources)) for n in layer}


def upstream(g: nx.DiGraph, sinks: Iterable[fx.Node]) -> set[fx.Node]:
    """``sinks`` and every node one of them is computed from."""
    return downstream(g.reverse(copy=False), sinks)


__all__ = ["digraph", "downstream", "upstream"]
