"""Expert load: how many rows each MoE layer's router sends to each expert, and how many it keeps.

Per layer (``graph.experts``), the pass inserts one ``ExpertCounter`` call after the router: it
adds, into the counter's (2, E) int64 buffer, the (token, choice) pairs the router's top-k sent
to each expert (a bincount of its indices) and how many of them it computes: no more than the
rows the grouped matmuls' ``offs`` give it. Dropless, the two are equal; under a capacity
(GShard/Switch: C rows per expert, padded) min(routed, C), and the difference is what was
dropped. The runtime reads the buffers once a step (``ParallelModel.last_expert_load``).

The op counts nothing while a backward runs: a block recomputed by activation checkpointing
routes the same tokens again, and they were counted in its forward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import networkx as nx
import torch
from torch import fx, nn

from autopar.graph.dag import digraph, upstream
from autopar.graph.experts import ExpertGroup, expert_groups, op_name

COUNTER = "autopar_expert_load"
"""Prefix of the counters' module names: ``autopar_expert_load_<k>`` for the k-th MoE layer."""


@torch.library.custom_op("autopar::count_expert_rows", mutates_args=("load",))
def count_expert_rows(chosen: torch.Tensor, offs: torch.Tensor, load: torch.Tensor) -> None:
    """``load[0] +=`` rows per expert in the router's indices ``chosen``; ``load[1] +=`` those the
    expert computes: no more than the rows ``offs`` (cumulative, (E,)) gives it. Nothing while a
    backward runs."""
    if torch._C._current_graph_task_id() != -1:  # a recompute inside backward
        return
    experts = load.shape[1]
    routed = torch.bincount(chosen.reshape(-1).long(), minlength=experts)[:experts]
    slots = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    load[0] += routed
    load[1] += torch.minimum(routed, slots)


@count_expert_rows.register_fake
def _count_fake(chosen: torch.Tensor, offs: torch.Tensor, load: torch.Tensor) -> None:
    return None


class ExpertCounter(nn.Module):
    """Holds one layer's (2, E) counts (a non-persistent buffer ``rows``: no checkpoint carries
    it) and adds a micro-batch's to them. A module, not a buffer read by the graph: a block that
    recomputes (``passes.recompute``) would take the buffer as an input, and checkpointing
    refuses an input changed in place before its backward."""

    _is_impure = True  # torch.fx: a call with no users that must run (Node.is_impure)

    def __init__(self, experts: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer(
            "rows", torch.zeros(2, experts, dtype=torch.int64, device=device), persistent=False
        )

    def forward(self, chosen: torch.Tensor, offs: torch.Tensor) -> None:
        count_expert_rows(chosen, offs, self.rows)


@dataclass(frozen=True)
class CountedLayer:
    """One MoE layer whose rows are counted."""

    path: str
    """The experts' module path (``ExpertGroup.path``)."""
    counter: str
    """The ``ExpertCounter``'s name on the graph (its buffer ``rows``: routed rows, then kept
    rows, per expert)."""
    experts: int
    top_k: int
    """Experts each token is routed to (the router top-k's width)."""


def router_choice(group: ExpertGroup, g: nx.DiGraph, topks: list[fx.Node]) -> fx.Node | None:
    """The indices output of the router's top-k that feeds the layer's rows: the last of
    ``topks`` (the graph's top-k nodes, in order; ``g`` its DAG) before the layer's first grouped
    matmul whose indices are (tokens, k) (DeepSeek-V3's group-limited routing runs one over the
    groups first); None if there is none."""
    up = upstream(g, [group.first])
    found = None
    for n in topks:
        if n in up:
            for user in n.users:
                val = user.meta.get("val")
                is_indices = user.target is operator.getitem and user.args[1] == 1
                if is_indices and isinstance(val, torch.Tensor) and val.dim() == 2:
                    found = user
    return found


def count_expert_load(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[CountedLayer]]:
    """Insert the row counts of every MoE layer of ``gm`` whose router's top-k is found (module
    doc); returns the graph and the layers counted, in graph order."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    device = next(iter([*gm.parameters(), *gm.buffers()]), torch.empty(0)).device
    g = digraph(gm.graph)  # once: every layer's router is looked up in it
    topks = [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) == "aten::topk"]
    counted = []
    for k, group in enumerate(expert_groups(gm)):
        chosen = router_choice(group, g, topks)
        if chosen is None:
            continue
        name = f"{COUNTER}_{k}"
        gm.add_submodule(name, ExpertCounter(group.experts, device))
        with gm.graph.inserting_after(max(chosen, group.offs, key=position.__getitem__)):
            call = gm.graph.call_module(name, (chosen, group.offs))
        if "autopar.layer" in chosen.meta:  # runs in the router's layer (``passes.pipeline_split``)
            call.meta["autopar.layer"] = chosen.meta["autopar.layer"]
        top_k = int(chosen.meta["val"].shape[-1])
        counted.append(CountedLayer(path=group.path, counter=name, experts=group.experts, top_k=top_k))
    gm.recompile()
    return gm, counted


__all__ = [
    "COUNTER",
    "CountedLayer",
    "ExpertCounter",
    "count_expert_load",
    "count_expert_rows",
    "router_choice",
]
