"""Context parallelism: each sequence split over cp ranks, attention exact over the whole of it.

``context_parallel(gm, cp=, rank=, group=, seq=)`` rewrites a graph captured at the local length
s / cp (``runtime.steps.capture_graph``) so that this rank computes its share of every sequence:

- Load balance (torchtitan's head-tail balancer; Llama 3, Dubey et al. 2024 §3.3.2): the
  sequence is cut into 2·cp chunks of c = s / (2·cp) positions and rank r holds chunks r and
  2·cp − 1 − r. Under a causal mask chunk g attends to (g + ½)·c keys on average, so every rank
  does (r + ½ + 2·cp − 1 − r + ½)·c² = 2·cp·c² of the s²/2 attention: exactly 1/cp of it.
- The token input: the runtime feeds whole sequences; the graph keeps this rank's positions
  (``index_select`` on the sequence dim), and so does the loss (``runtime.loss.context_loss``).
- Positions: an ``arange`` of the local length (position ids, Hugging Face's ``cache_position``)
  becomes this rank's positions; a slice [0, s/cp) of a buffer (a rotary table sliced to the
  input's length) becomes the rows at this rank's positions.
- Attention: every ``scaled_dot_product_attention`` becomes ``cp_attention``: keys and values
  all-gathered over the cp group (back to sequence order), each local query chunk g attending to
  the keys of positions < (g + 1)·c under a lower-right causal mask. The gather's backward is a
  reduce-scatter of the keys' and values' gradients; they are gathered as the model holds them
  before a grouped-query repeat (``graph.attention.unrepeated``) and repeated once gathered.
  This is Llama 3's all-gather form (§3.3.2,
  chosen there for GQA's small K/V), built on functional collectives so it runs on gloo and CPU
  as well as NCCL: torch's ``context_parallel`` ring attention dispatches to CUDA-only flash and
  efficient-attention kernels. A mask the model builds from positions alone is evaluated once
  (on a capture at ``MASK_PROBE`` positions where one is given): causal (or none) is run as
  above, anything else is refused, as is a softmax over the sequence written by hand (attention
  this pass cannot see).

The weights' gradients are partial over the cp ranks (each saw its positions): the runtime sums
them with the data-parallel ones (``ParallelDims.dp_cp``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import fx

from autopar.errors import AutoparError
from autopar.graph.attention import SDPA, unrepeated
from autopar.passes.tp_collectives import waited

aten = torch.ops.aten

POSITIONS = "_autopar_cp_positions"
"""The GraphModule buffer holding this rank's positions (int64, s / cp of them)."""


def chunk_size(seq: int, cp: int) -> int:
    """Positions per chunk: s / (2·cp)."""
    if seq % (2 * cp):
        raise AutoparError(f"cp {cp} needs a sequence length divisible by 2·cp = {2 * cp}; got {seq}")
    return seq // (2 * cp)


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` holds: r and 2·cp − 1 − r (head and tail)."""
    return rank, 2 * cp - 1 - rank


def local_positions(rank: int, cp: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's positions in the order it holds them: chunk r's, then chunk 2·cp − 1 − r's."""
    c = chunk_size(seq, cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in rank_chunks(rank, cp)])


def sequence_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """An all-gather of every rank's two chunks (rank order along ``dim``: r's chunks r and
    2·cp − 1 − r) in sequence order: the ranks' first chunks in rank order, then their second
    chunks in reverse rank order. Views, a flip and one copy: no index tensor."""
    ranked = x.unflatten(dim, (cp, 2, x.shape[dim] // (2 * cp)))
    return torch.cat([ranked.select(dim + 1, 0), ranked.select(dim + 1, 1).flip(dim)], dim).flatten(
        dim, dim + 1
    )


def rank_order(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The inverse of ``sequence_order``: a whole sequence along ``dim`` as every rank's two
    chunks in rank order (what a reduce-scatter hands back to each rank)."""
    halves = x.unflatten(dim, (2, cp, x.shape[dim] // (2 * cp)))
    return torch.stack([halves.select(dim, 0), halves.select(dim, 1).flip(dim)], dim + 1).flatten(
        dim, dim + 2
    )


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` over the cp group, then into sequence order; backward: the
    gradient back into rank order, reduce-scattered (each rank's keys feed every rank's queries)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str, cp: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.cp = dim, group, cp
        out = waited(funcol.all_gather_single(x.contiguous(), gather_dim=dim, group=group))
        return sequence_order(out, dim, cp)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ranked = rank_order(g, ctx.dim, ctx.cp).contiguous()
        out = waited(funcol.reduce_scatter_single(ranked, "sum", scatter_dim=ctx.dim, group=ctx.group))
        return out, None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: str, cp: int) -> torch.Tensor:
    """Every rank's part of ``x`` along ``dim``, in sequence order (differentiable)."""
    return _GatherSeq.apply(x, dim, group, cp)  # type: ignore[no-any-return]


def visible_keys(chunk: int, size: int) -> int:
    """Keys the queries of chunk ``chunk`` (of ``size`` positions) may see under a causal mask:
    every position before the chunk's end, (chunk + 1)·size."""
    return (chunk + 1) * size


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
    group: str,
    rank: int,
    cp: int,
    repeat: int = 1,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of this rank's queries (…, s / cp, d) over the whole
    sequence's keys and values: gathered, then for each of the rank's two chunks g the keys of
    positions < (g + 1)·c, the last c of them under a causal mask (lower-right: the chunk's
    queries are the last c positions of those keys). ``repeat``: k and v are the model's keys
    and values before a grouped-query repeat, repeated here once gathered."""
    dim = q.dim() - 2
    keys, values = gather_sequence(k, dim, group, cp), gather_sequence(v, dim, group, cp)
    if repeat > 1:  # the model's grouped-query repeat, after the gather (``graph.attention``)
        keys, values = (
            keys.repeat_interleave(repeat, dim=dim - 1),
            values.repeat_interleave(repeat, dim=dim - 1),
        )
    c = q.shape[dim] // 2
    outs = []
    for j, g in enumerate(rank_chunks(rank, cp)):
        qj = q.narrow(dim, j * c, c)
        if causal:
            n = visible_keys(g, c)
            kj, vj = keys.narrow(dim, 0, n), values.narrow(dim, 0, n)
            outs.append(lower_right_attention(qj, kj, vj, scale=scale, enable_gqa=enable_gqa))
        else:
            outs.append(F.scaled_dot_product_attention(qj, keys, values, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(outs, dim=dim)


def lower_right_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None, enable_gqa: bool
) -> torch.Tensor:
    """Causal attention of queries that are the last of the keys' positions (query i sees keys
    ≤ n − c + i). On a CUDA device in flash attention's dtypes, flash's own causal mode, which
    aligns the mask to the lower right when there are fewer queries than keys (what torch's
    ``CausalBias`` dispatches to; not run here: this machine has no GPU); elsewhere a boolean
    mask of c × n (CPU, and the verify runs)."""
    c, n = q.shape[-2], k.shape[-2]
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and not enable_gqa
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=scale)[0]
    mask = torch.ones(c, n, dtype=torch.bool, device=q.device).tril(diagonal=n - c)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}


MASK_PROBE = 64
"""Positions of the probe capture whose attention masks are evaluated (``probe``): a mask built
at the real length is b·(s/cp)² elements (4 GiB of booleans per sequence at 65,536 positions per
rank), and its evaluation holds several such tensors."""


def context_parallel(
    gm: fx.GraphModule,
    *,
    cp: int,
    rank: int,
    group: str,
    seq: int,
    probe: fx.GraphModule | None = None,
    device: torch.device | str = "cpu",
) -> fx.GraphModule:
    """Rewrite ``gm`` (captured at s / cp positions) to run rank ``rank``'s positions of whole
    sequences of length ``seq`` over the cp process group ``group`` (its registered name).
    ``probe``: the same model captured at ``MASK_PROBE`` positions, whose attention masks are
    evaluated in place of ``gm``'s (None: ``gm``'s own, for small graphs); ``device``: where the
    positions live (the tokens' device)."""
    local = seq // cp
    positions = local_positions(rank, cp, seq, device)
    gm.register_buffer(POSITIONS, positions, persistent=False)
    graph = gm.graph
    _refuse_hand_softmax(graph, local)
    attentions = [n for n in graph.nodes if n.target is SDPA]
    if not attentions:
        raise AutoparError(
            "context parallelism rewrites attention written with scaled_dot_product_attention; this "
            "model has none (attention by hand, or none at all): plan cp 1"
        )
    causal = _causal(gm, attentions, local, probe)  # masks read before positions change
    pos = _positions_node(graph)
    _slice_inputs(graph, pos, local, seq)
    found = _positions(gm, pos, local, seq)
    for n, is_causal in zip(attentions, causal, strict=True):
        _attention(n, is_causal, group=group, rank=rank, cp=cp)
    if not found:
        raise AutoparError(
            f"context parallelism found no positions in the model (an arange or a table sliced to the "
            f"input's {local} positions): it cannot give this rank's tokens their positions; plan cp 1"
        )
    _drop_dead(graph)
    graph.lint()
    gm.recompile()
    return gm


def _drop_dead(graph: fx.Graph) -> None:
    """Dead code out, with the metadata asserts export left on values nothing else reads (the
    attention mask a model built, which attention no longer takes: its indices are positions
    that now run past the local length)."""
    while True:
        graph.eliminate_dead_code()
        asserts = [
            n
            for n in graph.nodes
            if n.target == aten._assert_tensor_metadata.default
            and all(u.target == aten._assert_tensor_metadata.default for u in n.args[0].users)
            and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "call_function"
        ]
        if not asserts:
            return
        for n in asserts:
            graph.erase_node(n)


def _positions_node(graph: fx.Graph) -> fx.Node:
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        pos = graph.get_attr(POSITIONS)
    pos.meta["autopar.layer"] = 0
    return pos


def _slice_inputs(graph: fx.Graph, pos: fx.Node, local: int, seq: int) -> None:
    """Each input of shape (batch, s / cp, …) is fed whole sequences; it keeps this rank's
    positions."""
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[1] != local:
            continue
        with graph.inserting_after(pos):
            mine = graph.call_function(aten.index_select.default, (ph, 1, pos))
        ph.replace_all_uses_with(mine, delete_user_cb=lambda u, mine=mine: u is not mine)
        mine.meta = {"val": val, "autopar.layer": 0}
        ph.meta["val"] = val.new_empty((val.shape[0], seq, *val.shape[2:]))


def _positions(gm: fx.GraphModule, pos: fx.Node, local: int, seq: int) -> int:
    """Aranges of the local length become this rank's positions; slices [0, s/cp) of a buffer on
    a dim of at least s rows become its rows at those positions. Returns how many it rewrote."""
    graph, count = gm.graph, 0
    for n in list(graph.nodes):
        if n.target in ARANGES and _arange_range(n) == (0, local):
            dtype = n.kwargs.get("dtype")
            with graph.inserting_after(n):
                new = graph.call_function(aten._to_copy.default, (pos,), {"dtype": dtype} if dtype else {})
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            count += 1
        elif n.target == aten.slice.Tensor and _is_table_slice(gm, n, local, seq):
            dim = int(n.args[1]) if len(n.args) > 1 else 0
            with graph.inserting_after(n):
                new = graph.call_function(aten.index_select.default, (n.args[0], dim, pos))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            count += 1
    return count


def _arange_range(n: fx.Node) -> tuple[Any, Any] | None:
    args = list(n.args)
    if n.target == aten.arange.default:
        return (0, args[0])
    step = args[2] if len(args) > 2 else 1
    return (args[0], args[1]) if step == 1 else None


def _is_table_slice(gm: fx.GraphModule, n: fx.Node, local: int, seq: int) -> bool:
    args = list(n.args) + [0, None, None][len(n.args) - 1 :]
    source, dim, start, end = args[0], int(args[1]), args[2], args[3]
    if (
        not (isinstance(source, fx.Node) and source.op == "get_attr")
        or start not in (0, None)
        or end != local
    ):
        return False
    rows = getattr(source.meta.get("val"), "shape", None)
    rows = rows[dim] if rows is not None else _attr(gm, str(source.target)).shape[dim]
    if rows < seq:
        raise AutoparError(
            f"the table {source.target!r} has {rows} rows, fewer than the sequence's {seq} positions: "
            "context parallelism reads a rank's rows from all of them"
        )
    return True


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    out: Any = gm
    for part in target.split("."):
        out = getattr(out, part)
    return out  # type: ignore[no-any-return]


def _causal(
    gm: fx.GraphModule, attentions: list[fx.Node], local: int, probe: fx.GraphModule | None
) -> list[bool]:
    """Whether each attention is causal (else full), read on ``probe`` where given (its attentions
    in the same order)."""
    if probe is None:
        return [_is_causal(gm, n, local) for n in attentions]
    probed = [n for n in probe.graph.nodes if n.target is SDPA]
    if len(probed) != len(attentions):
        raise AutoparError(
            f"the model runs {len(attentions)} attentions at {local} positions but {len(probed)} at "
            f"{MASK_PROBE}: context parallelism cannot read their masks; plan cp 1"
        )
    length = int(probed[0].args[0].meta["val"].shape[-2]) if probed else MASK_PROBE  # type: ignore[union-attr]
    for n in attentions:  # dropout as the real graph runs it
        _is_causal(gm, n, local, masks=False)
    return [_is_causal(probe, n, length) for n in probed]


def _is_causal(gm: fx.GraphModule, n: fx.Node, local: int, *, masks: bool = True) -> bool:
    """Whether attention ``n`` is causal (``is_causal``, or a mask that evaluates causal) or full;
    refused otherwise, and with dropout."""
    bound = dict(zip(SDPA_ARGS, n.args, strict=False)) | dict(n.kwargs)
    if bound.get("dropout_p", 0.0) not in (0, 0.0):
        raise AutoparError(
            f"context parallelism runs attention without dropout; {n.name} drops {bound['dropout_p']}: "
            "set the model's attention dropout to 0 or plan cp 1"
        )
    mask = bound.get("attn_mask")
    kind = _mask_kind(gm, mask, local) if isinstance(mask, fx.Node) and masks else "full"
    if kind == "other":
        raise AutoparError(
            f"{n.name}'s attention mask is neither causal nor full (a sliding window, padding or "
            "a document mask): context parallelism runs causal or full attention; plan cp 1"
        )
    return bool(bound.get("is_causal", False)) or kind == "causal"


def _attention(n: fx.Node, causal: bool, **where: Any) -> None:
    """Replace one scaled_dot_product_attention by ``cp_attention`` (its mask dropped: causal
    or full, as ``_is_causal`` read it), on the keys and values before a grouped-query repeat
    where the model repeats them (``graph.attention.unrepeated``): those are what is gathered."""
    bound = dict(zip(SDPA_ARGS, n.args, strict=False)) | dict(n.kwargs)
    (key, rep), (value, rep_v) = unrepeated(bound["key"]), unrepeated(bound["value"])
    if rep != rep_v:
        (key, rep), value = (bound["key"], 1), bound["value"]
    n.target = cp_attention
    n.args = (bound["query"], key, value)
    n.kwargs = {
        "repeat": rep,
        "causal": causal,
        "scale": bound.get("scale"),
        "enable_gqa": bool(bound.get("enable_gqa", False)),
        **where,
    }


def _mask_kind(gm: fx.GraphModule, mask: fx.Node, local: int) -> str:
    """What a mask computed from positions alone is at the captured length: ``causal`` (lower
    triangular), ``full`` (everything visible) or ``other``. It is evaluated twice, on zeros
    and on other token ids, so a mask that reads the tokens (padding) is ``other``."""
    seen = [_evaluate(gm, mask, fill) for fill in (0, 1)]
    if any(m is None for m in seen) or not torch.equal(seen[0], seen[1]):  # type: ignore[arg-type]
        return "other"
    m = seen[0]
    assert m is not None
    allowed = m if m.dtype == torch.bool else m == 0
    allowed = allowed.expand(*allowed.shape[:-2], local, local).reshape(-1, local, local)
    tril = torch.ones(local, local, dtype=torch.bool).tril()
    if bool((allowed == tril).all()):
        return "causal"
    return "full" if bool(allowed.all()) else "other"


def _evaluate(gm: fx.GraphModule, target: fx.Node, fill: int) -> torch.Tensor | None:
    """``target``'s value computed by the nodes it depends on, real tensors on the CPU, every
    input filled with ``fill``; None where that needs a weight or fails."""
    needed: list[fx.Node] = []
    todo, seen = [target], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        needed.append(x)
        todo.extend(x.all_input_nodes)
    values: dict[fx.Node, Any] = {}
    try:
        for x in [n for n in gm.graph.nodes if n in seen]:
            if x.op == "placeholder":
                val = x.meta["val"]
                values[x] = torch.full(tuple(val.shape), fill, dtype=val.dtype)
            elif x.op == "get_attr":
                values[x] = _attr(gm, str(x.target)).detach().cpu()
            elif x.op == "call_function":
                args = fx.node.map_arg(x.args, lambda a: values[a])
                kwargs = fx.node.map_arg(x.kwargs, lambda a: values[a])
                kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
                values[x] = x.target(*args, **kwargs)  # type: ignore[operator]
            else:
                return None
    except (RuntimeError, NotImplementedError, TypeError, KeyError, IndexError):
        return None
    out = values[target]
    return out if isinstance(out, torch.Tensor) and not out.is_meta else None


def _refuse_hand_softmax(graph: fx.Graph, local: int) -> None:
    """A softmax over s / cp positions is attention this pass did not rewrite (scores computed
    by hand): run as it is, it would attend to this rank's positions only."""
    for n in graph.nodes:
        if n.target in SOFTMAX:
            val = n.meta.get("val")
            dim = int(n.args[1]) if len(n.args) > 1 else -1
            if isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[dim] == local:
                raise AutoparError(
                    f"{n.name} is a softmax over the sequence written by hand (attention scores): "
                    "context parallelism rewrites scaled_dot_product_attention only; plan cp 1"
                )


__all__ = [
    "POSITIONS",
    "context_parallel",
    "cp_attention",
    "gather_sequence",
    "local_positions",
    "lower_right_attention",
    "rank_order",
    "sequence_order",
    "visible_keys",
]
