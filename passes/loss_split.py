"""Cut a model's own loss out of its captured graph, for pipelines.

A model that computes its loss (``forward(idx, targets)`` → ``(logits, loss)``) is captured with
the targets as a second input. Under a pipeline the targets would have to travel through every
stage as an activation, and ``torch.distributed.pipelining`` runs each stage once on
uninitialised buffers to learn its shapes — fine for activations, fatal for integer targets that
index a cross-entropy. So the nodes that depend on the targets (the loss tail: the targets'
views, the cross-entropy, anything added after it) leave the graph and become the pipeline's
loss function, which the schedule calls on the last stage with the real targets; the values the
tail reads from the model (the logits, a z-loss term) become extra graph outputs.

``split_loss(gm, target) -> (gm, loss_gm, kept)``: ``gm`` now ends at its original outputs that
are not the loss (``kept`` of them) followed by the tail's inputs; ``loss_gm(*tail_inputs,
targets)`` computes the model's loss exactly as the model wrote it.
"""

from __future__ import annotations

from torch import fx

from autopar.errors import AutoparError


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user.op != "output" and user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def split_loss(gm: fx.GraphModule, target: str) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """Move the loss tail of ``gm`` (nodes depending on the placeholder ``target``) into a graph
    of its own (see the module docstring). Returns (gm, loss graph, outputs kept)."""
    graph = gm.graph
    t = next((n for n in graph.nodes if n.op == "placeholder" and n.target == target), None)
    assert t is not None, f"the captured graph has no {target!r} input"
    tail = _descendants(t)
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    losses = [o for o in outs if isinstance(o, fx.Node) and o in tail]
    if len(losses) != 1:
        raise AutoparError(
            f"the model's {target}= reach {len(losses)} of its outputs; a pipeline needs exactly one loss"
        )
    inputs: list[fx.Node] = []  # what the tail reads from the rest of the graph, in graph order
    for n in graph.nodes:
        if n in tail:
            inputs.extend(a for a in n.all_input_nodes if a not in tail and a is not t and a not in inputs)
    loss_graph = fx.Graph()
    env = {a: loss_graph.placeholder(a.name) for a in inputs}
    env[t] = loss_graph.placeholder(t.name)
    for n in graph.nodes:
        if n in tail:
            env[n] = loss_graph.node_copy(n, lambda a: env[a])
    loss_graph.output(env[losses[0]])
    kept = [o for o in outs if o is not losses[0]]
    output.args = (tuple(kept + inputs),)
    for n in reversed(list(graph.nodes)):
        if n in tail:
            graph.erase_node(n)
    graph.erase_node(t)
    gm.recompile()
    return gm, fx.GraphModule(gm, loss_graph), len(kept)


__all__ = ["split_loss"]
