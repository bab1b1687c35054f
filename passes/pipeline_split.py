"""Pipeline split: cut a captured graph into stage GraphModules, and outline layers into submodules.

``split_stages(gm, layers, chunks)`` cuts the flat ATen graph of ``autopar.capture``
at the plan's stage boundaries. Each chunk (a pipeline stage, or one of the v
virtual stages of an interleaved schedule) becomes a GraphModule that

- takes the values live across its input boundary (the token ids on the first
  chunk; the residual stream — and anything else later layers read — after),
- recomputes what needs no input (causal masks, rotary tables, position ids:
  nodes that depend only on constants and buffers) wherever it is needed,
  instead of sending it down the pipe,
- returns the values live across its output boundary (the model's own output
  on the last chunk), passing through values a later chunk needs.

``outline(gm, groups)`` then turns each block's nodes into a call of a
GraphModule installed at the block's own path (``transformer.h.3``), so
parameter FQNs stay exactly the original model's (``transformer.h.3.attn.c_attn.weight``),
FSDP2 can shard blocks (their forward runs) and ``checkpoint_wrapper`` can
recompute them. The same pass outlines a block's attention for selective
recomputation.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from autopar.errors import AutoparError
from autopar.graph.dag import digraph, downstream, upstream
from autopar.graph.trace import graph_module

EDGE_LAYERS = ("embed", "head")
"""Layers that are not blocks of the model (no module of their own to outline)."""


def stage_chunks(
    layer_names: Sequence[str],
    ranks: Sequence[Sequence[Sequence[str]]],
    chunk_rank: Callable[[int], int] | None = None,
) -> list[list[str]]:
    """The plan's chunks per pipeline rank → all chunks (virtual stages) in execution order.

    ``layer_names`` is the model's layer order; ``ranks[k]`` the chunks of pipeline rank k in
    model order (each a list of layer names). Chunk c runs on rank ``chunk_rank(c)``
    (``Strategy.chunk_rank``: c mod p by default, ``torch.distributed.pipelining``'s placement
    of interleaved stages; in a V for ZBV and DualPipeV, where two neighbouring chunks share a
    rank); together the chunks must be the model's layers in order."""
    owner = {name: k for k, chunks in enumerate(ranks) for chunk in chunks for name in chunk}
    count = sum(len(chunk) for chunks in ranks for chunk in chunks)
    missing = [n for n in layer_names if n not in owner]
    if missing or count != len(layer_names) or len(owner) != count:
        what = missing[0] if missing else sorted(set(owner) - set(layer_names) or owner)[0]
        raise AutoparError(f"the plan's stages do not cover this model's layers exactly (e.g. {what!r})")
    p = len(ranks)
    where = chunk_rank or (lambda c: c % p)
    total = sum(len(chunks) for chunks in ranks)
    taken = [0] * p
    chunks: list[list[str]] = []
    for c in range(total):
        k = where(c)
        if taken[k] < len(ranks[k]):
            chunks.append(list(ranks[k][taken[k]]))
            taken[k] += 1
    flat = [name for chunk in chunks for name in chunk]
    if len(chunks) != total or flat != list(layer_names) or any(not chunk for chunk in chunks):
        raise AutoparError(
            f"the plan's chunks on ranks {[len(r) for r in ranks]} do not run the model's layers in "
            f"order with chunk c on rank {[where(c) for c in range(total)]}[c]"
        )
    return chunks


def _depends_on_input(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on a graph input (the others can be recomputed anywhere)."""
    return downstream(digraph(gm.graph), (n for n in gm.graph.nodes if n.op == "placeholder"))


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _persistent(root: nn.Module, target: str) -> bool:
    """Whether ``root.<target>`` is a buffer saved in state dicts (not a lifted constant or a
    non-persistent buffer such as a rotary table)."""
    owner, _, name = target.rpartition(".")
    mod = root.get_submodule(owner)
    return name in mod._buffers and name not in mod._non_persistent_buffers_set


def copy_attr(dst: nn.Module, src: nn.Module, target: str, as_target: str | None = None) -> None:
    """Install ``src.<target>`` in ``dst`` (at ``as_target``), keeping buffer persistence."""
    install(dst, as_target or target, _attr(src, target), persistent=_persistent(src, target))


def install(root: nn.Module, target: str, value: Any, *, persistent: bool = True) -> None:
    """Set ``root.<target>`` creating plain intermediate modules; tensors that are not
    parameters become buffers."""
    *path, name = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(name, value)
    elif isinstance(value, nn.Module):
        mod.add_module(name, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(name, value, persistent=persistent)
    else:
        setattr(mod, name, value)


def _single_or_tuple(graph: fx.Graph, values: list[fx.Node]) -> None:
    graph.output(values[0] if len(values) == 1 else tuple(values))


def split_stages(
    gm: fx.GraphModule,
    layer_of: Callable[[fx.Node], str],
    chunks: Sequence[Sequence[str]],
    *,
    keep: Sequence[int] | None = None,
) -> dict[int, fx.GraphModule]:
    """Chunk index → its stage GraphModule, for the chunks in ``keep`` (default all).

    ``layer_of(node)`` names the layer of a compute node (``node.meta["autopar.layer"]``
    mapped to names). Parameters read by several chunks (tied embedding and head) are the
    same Parameter object in each; the runtime sums their gradients across ranks."""
    chunk_of_layer = {name: c for c, names in enumerate(chunks) for name in names}
    nodes = list(gm.graph.nodes)
    last = len(chunks) - 1
    chunk: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            chunk[n] = 0
        elif n.op == "output":
            chunk[n] = last
        elif n.op != "get_attr":
            chunk[n] = chunk_of_layer[layer_of(n)]
    dep = _depends_on_input(gm)
    # live[b]: values made at or before chunk b (input-dependent ones) that a later chunk reads
    live: list[list[fx.Node]] = [[] for _ in range(last)]
    for n in nodes:
        if n not in chunk or n.op == "output" or n not in dep:
            continue
        readers = [chunk[u] for u in n.users if u in chunk]  # (readers of n depend on the input too)
        for b in range(chunk[n], max(readers, default=chunk[n])):
            live[b].append(n)
    stages: dict[int, fx.GraphModule] = {}
    for c in range(len(chunks)) if keep is None else keep:
        stages[c] = _build_chunk(gm, nodes, chunk, dep, live, c)
    return stages


def _build_chunk(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    chunk: dict[fx.Node, int],
    dep: set[fx.Node],
    live: list[list[fx.Node]],
    c: int,
) -> fx.GraphModule:
    """One chunk's GraphModule (see ``split_stages``)."""
    members = {n for n in nodes if chunk.get(n) == c and n.op not in ("placeholder", "output")}
    # recompute input-free values of other chunks here (masks, rotary tables) rather than send them
    todo = [i for n in members for i in n.all_input_nodes]
    while todo:
        i = todo.pop()
        if i.op == "get_attr" or i in members or i in dep:
            continue
        members.add(i)
        todo.extend(i.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in nodes if n.op == "placeholder"] if c == 0 else live[c - 1]
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    root = nn.Module()
    for n in nodes:
        if n.op == "get_attr" and any(u in members for u in n.users):
            env[n] = graph.get_attr(str(n.target))
            env[n].meta = dict(n.meta)
            copy_attr(root, gm, str(n.target))
    for n in nodes:
        if n in members:
            env[n] = graph.node_copy(n, lambda x: env[x])
            if n.op == "call_module":  # a module the graph calls (an expert counter)
                copy_attr(root, gm, str(n.target))
    if c == len(live):
        out = next(n for n in nodes if n.op == "output")
        graph.output(fx.map_arg(out.args[0], lambda x: env[x]))
    else:
        _single_or_tuple(graph, [env[n] for n in live[c]])
    return graph_module(root, graph, f"Stage{c}")


def outline(gm: fx.GraphModule, group_of: Callable[[fx.Node], str | None]) -> fx.GraphModule:
    """Move each group's nodes (``group_of(node)``: a module path, or None to stay) into a
    GraphModule installed at that path.

    A group's parameters (get_attr under its path) move inside it under relative names;
    anything else it reads is passed in. The call is placed where the group's last node
    was, so a group must be convex (nothing outside it reads its values before it ends)."""
    by_group: dict[str, list[fx.Node]] = {}
    groups: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        path = group_of(n) if n.op not in ("placeholder", "output", "get_attr") else None
        if path is not None:
            by_group.setdefault(path, []).append(n)
            groups[n] = path
    last_of = {members[-1]: path for path, members in by_group.items()}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = nn.Module()
    inside = {n for members in by_group.values() for n in members}
    built = {path: _subgraph(gm, members, path) for path, members in by_group.items()}
    for path, (sub, _, _) in built.items():
        install(root, path, sub)
    for n in gm.graph.nodes:
        if n in last_of:
            _, ins, outs = built[last_of[n]]
            call = graph.call_module(last_of[n], tuple(env[i] for i in ins))
            for k, o in enumerate(outs):
                env[o] = call if len(outs) == 1 else graph.call_function(operator.getitem, (call, k))
                env[o].meta = dict(o.meta)
            continue
        if n in inside:
            continue
        if n.op == "get_attr" and n.users and all(_owns(groups.get(u), n) for u in n.users):
            continue  # moved inside its group
        missing = [i for i in n.all_input_nodes if i not in env]
        if missing:
            raise AutoparError(
                f"cannot outline: {n.name} reads {missing[0].name} before its group ends (not convex)"
            )
        env[n] = graph.node_copy(n, lambda x: env[x])
        if n.op == "get_attr":
            copy_attr(root, gm, str(n.target))
        elif n.op == "call_module":  # outlined before (a MoE layer's experts under EP): kept
            install(root, str(n.target), gm.get_submodule(str(n.target)))
    return graph_module(root, graph, type(gm).__name__)


def _owns(path: str | None, attr: fx.Node) -> bool:
    """Whether the group at ``path`` holds the attribute ``attr`` reads (it lies under the path)."""
    return path is not None and str(attr.target).startswith(path + ".")


def _subgraph(
    gm: fx.GraphModule, members: list[fx.Node], path: str
) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The GraphModule of one group, its inputs (outer nodes) and outputs (its nodes read outside)."""
    mine = set(members)
    prefix = path + "."
    ins: list[fx.Node] = []
    for n in members:
        for i in n.all_input_nodes:
            if i not in mine and not (i.op == "get_attr" and _owns(path, i)) and i not in ins:
                ins.append(i)
    outs = [n for n in members if any(u not in mine for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in ins:
        env[i] = graph.placeholder(i.name)
        env[i].meta = dict(i.meta)
    root = nn.Module()
    for n in members:
        for i in n.all_input_nodes:
            if i.op == "get_attr" and str(i.target).startswith(prefix) and i not in env:
                rel = str(i.target)[len(prefix) :]
                env[i] = graph.get_attr(rel)
                env[i].meta = dict(i.meta)
                copy_attr(root, gm, str(i.target), rel)
        env[n] = graph.node_copy(n, lambda x: env[x])
        if n.op == "call_module":  # a module the graph calls (an expert counter) moves in too
            target = str(n.target)
            env[n].target = target[len(prefix) :] if target.startswith(prefix) else target
            copy_attr(root, gm, target, str(env[n].target))
    _single_or_tuple(graph, [env[o] for o in outs])
    return graph_module(root, graph, "Layer"), ins, outs


def fill_layers(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate ``autopar.layer`` on nodes a later pass inserted (tensor-parallel collectives,
    ``to_local`` reads): the earliest layer among their users (a placement change runs where
    its result is consumed); the last layer if no user has one."""
    nodes = list(gm.graph.nodes)
    last = max((int(n.meta.get("autopar.layer", 0)) for n in nodes), default=0)
    for n in reversed(nodes):
        if n.op in ("placeholder", "output", "get_attr") or "autopar.layer" in n.meta:
            continue
        users = [u.meta["autopar.layer"] for u in n.users if "autopar.layer" in u.meta]
        n.meta["autopar.layer"] = min(users, default=last)
    return gm


def outline_blocks(stage: fx.GraphModule, names: Sequence[str]) -> fx.GraphModule:
    """Outline every block of a stage into a GraphModule at the block's path (``names``: the
    captured model's layer names, indexed by ``autopar.layer``)."""

    def group(n: fx.Node) -> str | None:
        name = names[n.meta["autopar.layer"]]
        return None if name in EDGE_LAYERS else name

    return outline(stage, group)


def convex_hull(graph: fx.Graph, members: set[fx.Node]) -> set[fx.Node]:
    """``members`` plus every node both downstream and upstream of them (what must move with
    them for the group to be convex)."""
    g = digraph(graph)
    return members | (downstream(g, members) & upstream(g, members))


def is_attention(child: str) -> bool:
    """Whether a block's child module is its attention, by name (``attn``, ``self_attn``,
    ``attention``): what selective recomputation recomputes."""
    return "attn" in child or "attention" in child


def outline_attention(block: fx.GraphModule, path: str) -> tuple[fx.GraphModule, str | None]:
    """Outline the attention of the block at ``path`` (its first child module named like
    ``attn``/``attention``) for selective recomputation; returns the block and that child's name."""
    prefix = path + "."
    child = None
    for n in block.graph.nodes:
        owner = str(n.meta.get("autopar.module", ""))
        if owner.startswith(prefix):
            first = owner[len(prefix) :].split(".")[0]
            if is_attention(first):
                child = first
                break
    if child is None:
        return block, None
    inner = prefix + child
    members = {
        n
        for n in block.graph.nodes
        if n.op == "call_function" and (str(n.meta.get("autopar.module", "")) + ".").startswith(inner + ".")
    }
    members = convex_hull(block.graph, members)  # with the collectives TP put between its ops

    def group(n: fx.Node) -> str | None:
        return child if n in members else None

    return outline(block, group), child


__all__ = [
    "EDGE_LAYERS",
    "convex_hull",
    "fill_layers",
    "install",
    "is_attention",
    "outline",
    "outline_attention",
    "outline_blocks",
    "split_stages",
    "stage_chunks",
]
