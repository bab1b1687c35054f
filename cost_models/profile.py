"""What the cost models need from a captured graph, summarised once per layer type.

``ModelProfile.from_captured(cap)`` reads the ``node.meta["autopar.*"]``
annotations of one capture (at micro-batch b, sequence s) and keeps, per
layer type, the per-op FLOPs and bytes (for the roofline), the saved-for-
backward bytes split the way tensor/sequence parallelism splits them
(Korthikanti et al. 2022, §4.2), and the bytes that Megatron-style tensor
parallelism all-reduces. Estimates then cost nothing but arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.cost_models.kernels import (
    OpCost,
    elem_bytes_of,
    fusion_groups,
    node_elem_bytes,
    numel,
    op_cost,
    shape_of,
)
from autopar.errors import AutoparError
from autopar.graph.dispatch import numbered

if TYPE_CHECKING:
    import torch.fx as fx

    from autopar.graph import CapturedModel
    from autopar.graph.experts import ExpertGroup


@dataclass(frozen=True, kw_only=True)
class CallCost:
    """One ATen call of a layer's forward below autograd (``graph.dispatch``): what a per-operator
    recompute policy keeps or recomputes."""

    key: str
    """``op#k``: the k-th call of operator ``op`` in the layer's forward (the policy's name for it)."""
    flops: int
    """FLOPs (split by TP)."""
    kernel_flops: int
    """FLOPs the kernel executes (a causal flash attention skips about half)."""
    mem_bytes: int
    """Bytes read and written (0 for a view)."""
    out_bytes: int
    """Bytes its outputs own: what keeping them costs."""
    keepable: bool
    """A policy may keep its output (new storage, no mutation)."""
    placement: str
    """How tensor parallelism splits its output: ``stream`` (residual stream: whole, ÷t under
    sequence parallelism), ``whole`` (a row-parallel matmul's partial sums: whole on every
    rank) or ``sharded`` (÷t: per head, column-parallel, the 4h MLP)."""


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer type at the captured micro-batch and sequence length."""

    name: str
    """Layer type name."""
    ops: tuple[OpCost, ...]
    """Forward kernels in order."""
    fwd_flops: int
    """Forward FLOPs."""
    bwd_flops: int
    """Backward FLOPs (model-FLOPs convention)."""
    params: int
    """Parameters of one layer."""
    saved_stream_bytes: int
    """Saved activations of the residual stream (b·s·h-sized and per-token statistics):
    Korthikanti's replicated 10·s·b·h under TP, divided by t with SP."""
    saved_sharded_bytes: int
    """Saved activations that tensor parallelism splits (heads, 4h MLP, …)."""
    saved_quadratic_bytes: int
    """Saved attention scores with two sequence dims (…, s, s): dropped by selective recompute."""
    quadratic_flops: int
    """Forward FLOPs of ops producing (…, s, s) tensors: redone by selective recompute."""
    tp_reduce_bytes: int
    """Bytes of the row-parallel outputs that TP all-reduces in forward (e.g. 2 per block)."""
    tp_reduce_count: int
    """How many row-parallel outputs (collectives) those bytes come in (e.g. 2 per block)."""
    fused_ops: tuple[OpCost, ...] = ()
    """Forward kernels as ``torch.compile`` fuses them (``fusion_groups``): each matmul or fused
    attention as in ``ops``, each chain of FLOP-free ops between them as one kernel. Empty for
    hand-built profiles (a compiled plan is then priced on ``ops``)."""
    calls: tuple[CallCost, ...] = ()
    """The forward's ATen calls that move bytes or compute, in order (empty for hand-built
    profiles): priced by per-operator recompute policies (``cost_models.recompute``)."""
    matrix_params: int = 0
    """Parameters in tensors of two or more dims (the weight matrices): what PowerSGD compresses."""
    matrix_sides: int = 0
    """Σ (rows + columns) over those tensors, each viewed as dim 0 × the rest (as torch's
    ``powerSGD_hook`` views them): PowerSGD at rank r sends r·(rows + columns) numbers for each."""
    experts: int = 0
    """Routed experts of the layer's MoE (``graph.experts``); 0 for a dense layer."""
    expert_params: int = 0
    """Parameters of those experts (their stacked weights): what expert parallelism splits."""
    saved_expert_bytes: int = 0
    """Saved activations of the experts' rows (the nodes from the rows' first grouped matmuls to
    the last, ``graph.experts.row_region``), apart from the three above: no TP rule splits them
    (every TP rank runs the experts whole), and the busiest EP rank holds its skew × of them."""
    tied_params: int = 0
    """Parameters the layer reads that an earlier layer owns (a head tied to the embedding): not
    in ``params``; a pipeline rank holding this layer without the owner holds its own copy."""
    weight_out_bytes: tuple[int, int, int] = (0, 0, 0)
    """Bytes of the outputs of the ops that meet a parameter and an activation (a linear's, a
    norm's), by how tensor parallelism splits them (``CallCost.placement``: stream, whole,
    sharded). Torch's split backward keeps their gradients from a pipeline chunk's input-gradient
    pass to its weight-gradient pass (``stage_backward_input``'s ``param_groups``): what a
    zero-bubble schedule holds beyond the saved activations (``memory.deferred_grad_bytes``)."""
    a2a_bytes: int = 0
    """Bytes of the rows entering the experts' first grouped matmul plus those leaving the last,
    per forward: what expert parallelism's dispatch and combine all-to-alls carry (k·b·s·h each
    for top-k routing; ``comm.all_to_all_time_s``)."""


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A captured model reduced to per-layer-type costs."""

    micro_batch: int
    """Batch of the capture (b)."""
    seq: int
    """Sequence length of the capture (s)."""
    hidden: int
    """Residual-stream width (h)."""
    heads: int | None
    """Attention heads (for TP divisibility)."""
    vocab: int
    """Width of the model's output (logits), for the loss."""
    act_bytes: int
    """Bytes per activation element (2 for bf16/fp16)."""
    layer_types: dict[str, LayerCost]
    """Costs by layer type name."""
    layers: tuple[str, ...]
    """Layer type of each layer in order: embed, blocks…, head."""
    layer_names: tuple[str, ...]
    """Name of each layer in order (``embed``, ``blocks.0``, …, ``head``)."""
    total_params: int
    """Unique parameters of the model."""
    kv_width: int | None = None
    """Key/value heads × head dim attention reads before a grouped-query repeat (what context
    parallelism exchanges, ``cost_models.context``); None: no attention found (priced as h)."""
    captured: CapturedModel | None = dataclasses.field(default=None, compare=False, repr=False)
    """The annotated graph this profile summarises (the planner chooses per-operator
    tensor-parallel strategies on it); None for hand-built profiles."""

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return max((lc.experts for lc in self.layer_types.values()), default=0)

    @property
    def blocks(self) -> int:
        """Number of repeated layers (all but embed and head)."""
        return len(self.layers) - 2

    def deepened(self, blocks: int | tuple[int, ...]) -> ModelProfile | None:
        """This profile, captured on a copy of the model with fewer blocks, as the model with
        ``blocks`` blocks: one count per run of alike blocks, in order (DeepSeek-V3: 3 dense,
        then 58 MoE); an int for one run. The costs are per layer type, so only the layer list,
        its names (continued by index: ``h.0``, ``h.1`` → ``h.2``, …) and the parameter count
        grow (by each added block's parameters). None when the captured blocks do not form that
        many runs of distinct types, or are not named ``<prefix><index>``: such a model must be
        captured whole."""
        counts = (blocks,) if isinstance(blocks, int) else blocks
        body, names = self.layers[1:-1], self.layer_names[1:-1]
        runs = [k for i, k in enumerate(body) if i == 0 or body[i - 1] != k]  # a type per run
        prefix = names[0][:-1] if names and names[0].endswith("0") else None
        if len(runs) != len(counts) or len(set(runs)) != len(runs) or prefix is None:
            return None
        if any(n != f"{prefix}{i}" for i, n in enumerate(names)):
            return None
        added = [c - body.count(k) for k, c in zip(runs, counts, strict=True)]
        assert min(added) >= 0, (counts, names)
        return dataclasses.replace(
            self,
            layers=(
                self.layers[0],
                *[k for k, c in zip(runs, counts, strict=True) for _ in range(c)],
                self.layers[-1],
            ),
            layer_names=(
                self.layer_names[0],
                *(f"{prefix}{i}" for i in range(sum(counts))),
                self.layer_names[-1],
            ),
            total_params=self.total_params
            + sum(a * self.layer_types[k].params for k, a in zip(runs, added, strict=True)),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the graph left out); ``ModelProfile.from_dict`` inverts it."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "captured"}
        d["layer_types"] = {k: dataclasses.asdict(v) for k, v in self.layer_types.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        """A profile from ``to_dict`` (JSON lists back to tuples; no graph)."""
        types = {
            name: LayerCost(
                **{
                    **lc,
                    "ops": tuple(OpCost(**op) for op in lc["ops"]),
                    "fused_ops": tuple(OpCost(**op) for op in lc["fused_ops"]),
                    "calls": tuple(CallCost(**c) for c in lc["calls"]),
                    "weight_out_bytes": tuple(lc.get("weight_out_bytes", (0, 0, 0))),
                }
            )
            for name, lc in d["layer_types"].items()
        }
        return cls(
            **{
                **d,
                "layer_types": types,
                "layers": tuple(d["layers"]),
                "layer_names": tuple(d["layer_names"]),
            }
        )

    @property
    def step_model_flops_per_sequence(self) -> float:
        """Forward + backward FLOPs per sequence."""
        total = sum(self.layer_types[t].fwd_flops + self.layer_types[t].bwd_flops for t in self.layers)
        return total / self.micro_batch

    @property
    def input_bytes(self) -> int:
        """One layer's input (b·s·h elements): what full recomputation keeps per layer."""
        return self.micro_batch * self.seq * self.hidden * self.act_bytes

    @classmethod
    def from_captured(cls, cap: CapturedModel) -> ModelProfile:
        """Summarise ``cap`` (needs a model with blocks and a residual stream)."""
        if cap.hidden_size is None or len(cap.layers) < 3:
            raise AutoparError(
                "the cost model needs a model with repeated blocks between an embedding and a head "
                "(a ModuleList of blocks and a residual stream)"
            )
        h, s = cap.hidden_size, cap.seq
        nodes = {n.name: n for n in cap.gm.graph.nodes}
        types: dict[str, LayerCost] = {}
        # each type's last layer: the first also saves what every block reads (rope tables, masks)
        last = {layer.type: layer for layer in cap.layers}
        from autopar.graph.experts import expert_groups, row_region  # torch: imported when capturing

        groups = expert_groups(cap.gm)
        rows = set().union(*(row_region(cap.gm, g) for g in groups)) if groups else set()
        for name, layer in last.items():
            members = [nodes[n] for n in layer.nodes]
            types[name] = _layer_cost(name, members, h, s, layer.params, _experts(groups, members), rows)
        out = next(n for n in cap.gm.graph.nodes if n.op == "output")
        head_out = [a for a in out.all_input_nodes if a.meta.get("autopar.shape")]
        vocab = int(head_out[0].meta["autopar.shape"][-1]) if head_out else h
        dtype = _stream_dtype(cap.gm, h)
        return cls(
            micro_batch=cap.batch,
            seq=s,
            hidden=h,
            heads=cap.attention_heads,
            kv_width=cap.kv_width,
            vocab=vocab,
            act_bytes=elem_bytes_of(dtype),
            layer_types=types,
            layers=tuple(layer.type for layer in cap.layers),
            layer_names=tuple(layer.name for layer in cap.layers),
            total_params=cap.total_params,
            captured=cap,
        )


def _stream_dtype(gm: fx.GraphModule, h: int) -> str:
    """The residual stream's dtype: the embedding's output that the first block reads (else the
    first computing node's, else bf16)."""
    for n in gm.graph.nodes:
        feeds = any(u.meta.get("autopar.layer") == 1 for u in n.users)
        if n.meta.get("autopar.layer") == 0 and feeds and shape_of(n)[-1:] == (h,):
            return str(n.meta.get("autopar.dtype", "bfloat16"))
    computing = (n.meta["autopar.dtype"] for n in gm.graph.nodes if n.meta.get("autopar.fwd_flops"))
    return next(computing, "bfloat16")


def _experts(groups: list[ExpertGroup], members: list[fx.Node]) -> dict[str, int]:
    """``LayerCost.experts``, ``expert_params`` and ``a2a_bytes`` of a layer's MoE (none: {})."""
    mine = set(members)
    found = [g for g in groups if g.first in mine]
    if not found:
        return {}
    return {
        "experts": found[0].experts,
        "expert_params": sum(numel(shape_of(w)) for g in found for w in g.weights),
        "a2a_bytes": sum(
            numel(shape_of(n)) * node_elem_bytes(n) for g in found for n in (g.first.args[0], g.last)
        ),
    }


def _layer_cost(
    name: str,
    members: list[fx.Node],
    h: int,
    s: int,
    params: int,
    experts: dict[str, int],
    rows: set[fx.Node] | frozenset[fx.Node] = frozenset(),
) -> LayerCost:
    """One layer type's costs; ``rows``: the graph's expert row regions (their saved bytes are
    kept apart, ``LayerCost.saved_expert_bytes``)."""
    ops, stream_b, sharded_b, quad_b, quad_f, tp_bytes, tp_count, expert_b = [], 0, 0, 0, 0, 0, 0, 0
    placements: list[tuple[fx.Node, str]] = []
    for n in members:
        if n.op != "call_function":
            continue
        shape, flops = shape_of(n), int(n.meta.get("autopar.fwd_flops", 0))
        mem = int(n.meta.get("autopar.mem_bytes", 0))
        if flops or mem:
            ops.append(op_cost(n, h))
        if any(_is_square(shape_of(a), s) for a in (n, *n.all_input_nodes)):
            quad_f += flops  # QKᵀ and scores·V: what selective recompute redoes
        # Megatron TP: a matmul with a weight that writes the residual width h is row-parallel
        # (its input is sharded, its output all-reduced); the others are column-parallel.
        row_parallel = bool(flops) and shape[-1:] == (h,) and _reads_weight(n) and _sharded_input(n, h)
        if row_parallel:
            tp_bytes += numel(shape) * node_elem_bytes(n)
            tp_count += 1
        placements.append((n, _placement(shape, flops, h, row_parallel)))
        # Saved tensors on the residual stream stay whole under TP: the inputs of norms and
        # residual dropouts, and the inputs of column-parallel matmuls. A row-parallel
        # matmul's input is sharded, as are per-head tensors and the 4h MLP activations.
        for saved_shape, nbytes in n.meta.get("autopar.saved", ()):
            if n in rows:
                expert_b += nbytes
            elif _is_square(saved_shape, s):
                quad_b += nbytes
            elif saved_shape and saved_shape[-1] in (h, 1) and not row_parallel:
                stream_b += nbytes
            else:
                sharded_b += nbytes
    return LayerCost(
        name=name,
        ops=tuple(ops),
        fwd_flops=sum(int(n.meta.get("autopar.fwd_flops", 0)) for n in members),
        bwd_flops=sum(int(n.meta.get("autopar.bwd_flops", 0)) for n in members),
        params=params,
        saved_stream_bytes=stream_b,
        saved_sharded_bytes=sharded_b,
        saved_quadratic_bytes=quad_b,
        saved_expert_bytes=expert_b,
        quadratic_flops=quad_f,
        tp_reduce_bytes=tp_bytes,
        tp_reduce_count=tp_count,
        weight_out_bytes=_weight_out_bytes(placements),
        fused_ops=fusion_groups(members, h),
        calls=_calls(placements),
        **_parameters(members),
        **experts,
    )


def _parameters(members: list[fx.Node]) -> dict[str, int]:
    """``LayerCost.matrix_params`` and ``matrix_sides`` of a layer's parameters (its get_attr
    nodes that read parameter bytes), and its ``tied_params``."""
    shapes = [shape_of(n) for n in members if n.op == "get_attr" and n.meta.get("autopar.param_bytes")]
    matrices = [sh for sh in shapes if len(sh) >= 2]
    return {
        "matrix_params": sum(math.prod(sh) for sh in matrices),
        "matrix_sides": sum(sh[0] + math.prod(sh[1:]) for sh in matrices),
        "tied_params": sum(numel(shape_of(n)) for n in _tied(members).values()),
    }


def _placement(shape: tuple[int, ...], flops: int, h: int, row_parallel: bool) -> str:
    """``CallCost.placement`` of a node's outputs: a row-parallel matmul's partial sums are whole;
    FLOP-free (…, h) or per-token (…, 1) tensors of rank ≤ 3 are on the residual stream; the
    rest (heads, column-parallel outputs, the 4h MLP) are split by tensor parallelism."""
    if row_parallel:
        return "whole"
    if not flops and 1 <= len(shape) <= 3 and shape[-1] in (h, 1):
        return "stream"
    return "sharded"


def _calls(placements: list[tuple[fx.Node, str]]) -> tuple[CallCost, ...]:
    """The layer's ATen calls (``autopar.dispatch``) numbered per operator, those that cost
    nothing to recompute or keep (views, size queries) dropped after numbering. Keeping the
    layer's output costs nothing: the next layer holds it as its input."""
    flat = [(c, n, where) for n, where in placements for c in n.meta.get("autopar.dispatch", ())]
    keys = numbered([c for c, _, _ in flat])
    members = {n for n, _ in placements}
    outputs = {
        max(i for i, (_, m, _) in enumerate(flat) if m is n)
        for n in members
        if n.meta.get("autopar.dispatch") and any(u not in members for u in n.users)
    }
    out = []
    for i, (key, (c, n, where)) in enumerate(zip(keys, flat, strict=True)):
        if not (c.flops or c.mem_bytes):
            continue
        fwd = n.meta.get("autopar.fwd_flops", 0)
        share = n.meta.get("autopar.kernel_flops", fwd) / fwd if fwd else 1.0  # causal attention
        out.append(
            CallCost(
                key=key,
                flops=c.flops,
                kernel_flops=round(c.flops * share),
                mem_bytes=c.mem_bytes,
                out_bytes=0 if i in outputs else c.out_bytes,
                keepable=c.keepable,
                placement=where,
            )
        )
    return tuple(out)


def _is_square(shape: tuple[int, ...], s: int) -> bool:
    """An attention-score-like tensor (…, s, s)."""
    return len(shape) >= 2 and shape[-1] == s and shape[-2] == s


def _sharded_input(n: fx.Node, h: int) -> bool:
    """Does ``n`` read a tensor-parallel-sharded activation (per-head or wider than h)?

    Follows the first input back through reshapes and copies (no FLOPs, same
    element count) to the op that made it: attention output (b, a, s, d) or an
    MLP activation (…, 4h) is sharded; a norm's (…, h) output is not.
    """
    a = next((x for x in n.all_input_nodes if x.op != "get_attr"), None)
    while a is not None and a.op == "call_function" and not a.meta.get("autopar.fwd_flops"):
        inputs = [x for x in a.all_input_nodes if x.op != "get_attr"]
        if len(inputs) != 1 or len(inputs) != len(a.all_input_nodes):
            break
        if numel(shape_of(inputs[0])) != numel(shape_of(a)):
            break
        a = inputs[0]
    shape: tuple[int, ...] = shape_of(a) if a is not None else ()
    return bool(shape) and (shape[-1] != h or len(shape) >= 4)


def _reads_weight(n: fx.Node) -> bool:
    return any(a.op == "get_attr" for a in n.all_input_nodes)


def _tied(members: list[fx.Node]) -> dict[str, fx.Node]:
    """The parameters the layer's operations read that an earlier layer's read too
    (``LayerCost.tied_params``; the earliest reader owns them), by name."""
    out = {}
    for n in members:
        if n.op != "call_function":
            continue
        here = n.meta.get("autopar.layer", 0)
        for a in n.all_input_nodes:
            if _is_parameter(a) and any(u.meta.get("autopar.layer", here) < here for u in a.users):
                out[str(a.target)] = a
    return out


def _weight_out_bytes(placements: list[tuple[fx.Node, str]]) -> tuple[int, int, int]:
    """``LayerCost.weight_out_bytes``: (stream, whole, sharded) bytes of the outputs of the
    layer's nodes that meet a parameter and an activation."""
    out = dict.fromkeys(("stream", "whole", "sharded"), 0)
    for n, where in placements:
        if _meets_parameter(n):
            out[where] += numel(shape_of(n)) * node_elem_bytes(n)
    return out["stream"], out["whole"], out["sharded"]


def _meets_parameter(n: fx.Node) -> bool:
    """Does ``n`` read a parameter and an activation (``LayerCost.weight_out_bytes``): the node
    torch's ``get_param_groups`` takes as a parameter group's intermediate."""
    inputs = n.all_input_nodes
    return any(_is_parameter(a) for a in inputs) and any(a.op != "get_attr" for a in inputs)


def _is_parameter(n: fx.Node) -> bool:
    """A get_attr of a parameter (a tied one too), not a buffer (``graph.annotate``)."""
    return n.op == "get_attr" and bool(n.meta.get("autopar.param"))
