"""What a per-operator TP strategy keeps on one rank: which parameters it splits and the bytes it
holds (model states and saved activations), the memory term of ``tp_choice``'s ILP."""

from __future__ import annotations

import math

from torch import fx

from autopar.passes.tp_rules import (
    LINEAR_ARGS,
    OpStrategy,
    R,
    out_shape,
    shard_dim,
    tensor_args,
)


def param_placement(s: OpStrategy, n: fx.Node, pos: int) -> str:
    """Placement strategy ``s`` of node ``n`` gives the parameter at argument ``pos``."""
    if n.target in LINEAR_ARGS:
        _, wi, bi, _ = LINEAR_ARGS[n.target]
        role = "weight" if pos == wi else "bias" if pos == bi else ""
    else:
        role = "weight" if pos == 0 and s.name == "vocab" else ""
    return s.params.get(role, R)


def param_owners(nodes: list[fx.Node]) -> dict[tuple[str, int], fx.Node]:
    """(node, argument position) → the parameter's ``get_attr`` node, for the first reader of each
    parameter among ``nodes``: a weight read twice (tied embedding and head) is held, and
    counted, once."""
    found: dict[tuple[str, int], fx.Node] = {}
    seen: set[str] = set()
    for n in nodes:
        for pos, arg in enumerate(n.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) not in seen:
                seen.add(str(arg.target))
                found[n.name, pos] = arg
    return found


def param_numel(n: fx.Node) -> int:
    """Elements of the parameter ``get_attr`` node ``n`` reads."""
    return math.prod(tuple(n.meta.get("autopar.shape") or n.meta["val"].shape))


def param_split(s: OpStrategy, n: fx.Node, pos: int) -> bool:
    """Whether strategy ``s`` of node ``n`` splits the parameter at argument ``pos`` t ways."""
    return shard_dim(param_placement(s, n, pos)) is not None


def op_memory_bytes(
    n: fx.Node, s: OpStrategy, t: int, *, state_bytes_per_param: int, owners: dict[tuple[str, int], fx.Node]
) -> float:
    """Bytes one rank holds for operator ``n`` under strategy ``s``.

    Model states: each parameter ``n`` owns (``param_owners``) at ``state_bytes_per_param``
    (16: 16-bit weight and gradient, fp32 master, momentum and variance; ZeRO, SC'20 §3.1) ÷ t
    where ``s`` splits it. Saved activations (``autopar.saved``, at the captured micro-batch): a
    saved tensor shaped like an input or output the strategy splits counts ÷ t, one shaped like
    a replicated input or output counts whole (a column-parallel linear keeps its whole input),
    any other (softmax statistics) ÷ t where the operator's work is split."""
    state = 0.0
    for pos in range(len(n.args)):
        if (n.name, pos) in owners:
            split = param_split(s, n, pos)
            state += param_numel(owners[n.name, pos]) * state_bytes_per_param / (t if split else 1)
    placed = [(out_shape(n), s.out)] + [
        (out_shape(u), s.inputs[i] if i < len(s.inputs) else R) for i, u in enumerate(tensor_args(n))
    ]
    saved = 0.0
    for shape, nbytes in n.meta.get("autopar.saved", ()):
        places = [p for sh, p in placed if sh == tuple(shape)]
        split = any(shard_dim(p) is not None for p in places) if places else s.compute_fraction < 1
        saved += nbytes / (t if split else 1)
    return state + saved


__all__ = [
    "op_memory_bytes",
    "param_numel",
    "param_owners",
    "param_placement",
    "param_split",
]
