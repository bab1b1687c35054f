"""Collectives with Megatron's conjugate backward, for the tensor-parallel rewrite.

Each is an autograd Function over ``torch.distributed._functional_collectives`` (Shoeybi et
al. 2019, §3: ``f`` is the identity forward and an all-reduce backward, ``g`` the reverse):

- ``tp_copy`` (f): identity forward, all-reduce of the gradient;
- ``tp_reduce`` (g): all-reduce forward, identity backward;
- ``tp_reduce_scatter``: sequence-parallel g, reduce-scatter forward, all-gather backward;
- ``tp_gather`` / ``tp_slice``: all-gather forward and slice backward, and the reverse;
- ``regather_saved``: saved-tensor hooks under which a gathered tensor (a column-parallel
  input) is kept as this rank's shard and gathered again when backward reads it (Korthikanti
  et al. 2022 §4.2.2: sequence parallelism keeps s·b·h/t of each such input, not s·b·h);
- ``tp_chunks``: this rank's slice of every chunk of a fused replicated bias;
- ``vocab_embedding``: a lookup in this rank's rows of a vocabulary-parallel embedding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol


def _named(group: str) -> Any:
    """A process group by its registered name, as the functional collectives take it."""
    return group


def waited(x: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (a plain tensor passes through)."""
    return funcol.wait_tensor(x) if isinstance(x, funcol.AsyncCollectiveTensor) else x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return waited(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return waited(funcol.all_reduce(x.contiguous(), "sum", _named(group)))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _Gathered:
    """What a gathered column-parallel input is rebuilt from when backward reads it: this rank's
    shard, and the gathered buffer while the consumers that saved it (``pending``) have not read it
    (Q, K and V's projections read one gathered tensor: gathered once for the three)."""

    __slots__ = ("dim", "full", "group", "pending", "shard")

    def __init__(self, shard: torch.Tensor, dim: int, group: str) -> None:
        self.shard, self.dim, self.group = shard, dim, group
        self.pending = 0
        self.full: torch.Tensor | None = None

    def rebuilt(self, size: Any, stride: Any, offset: int) -> torch.Tensor:
        """The saved view (``size``, ``stride``, ``offset`` into the gathered buffer), gathered again:
        the collective fills a fresh buffer laid out as the first one was."""
        if self.full is None:
            out = waited(funcol.all_gather_tensor(self.shard, gather_dim=self.dim, group=self.group))
            self.full = _buffer(out)
        return self.full.as_strided(size, stride, offset)


GATHERED = "_autopar_gathered"
"""Attribute of the buffer ``tp_gather`` made: its ``_Gathered``."""


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s memory (``t`` or the base it views)."""
    return t if t._base is None else t._base


def _pack(t: torch.Tensor) -> Any:
    source = getattr(_buffer(t), GATHERED, None)
    if source is None:
        return t
    source.pending += 1
    return source, t.size(), t.stride(), t.storage_offset()


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    source, size, stride, offset = packed
    out = source.rebuilt(size, stride, offset)
    source.pending -= 1
    if source.pending <= 0:  # its last reader has it: the next backward (retain_graph) gathers again
        source.full = None
    return out


def regather_saved() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks (a context manager) under which a tensor ``tp_gather`` made (a
    column-parallel input), or a view of it, is saved as this rank's shard and all-gathered again
    when backward reads it: per such input s·b·h·(1 − 1/t) bytes fewer kept per micro-batch, for
    one more all-gather in backward (Megatron's sequence parallelism, Korthikanti et al. 2022
    §4.2.2). Tensors saved inside recomputed blocks are the checkpoint's (innermost hooks win)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward takes this rank's slice, reduce-scattering first when the
    gradient is a partial sum (the gathered tensor feeds column-parallel weights). The gathered
    tensor is marked to be rebuilt from its shard where it is saved (``regather_saved``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str, rank: int, size: int, partial: bool) -> Any:
        ctx.args = dim, group, rank, size, partial
        shard = x.contiguous()
        out = waited(funcol.all_gather_tensor(shard, gather_dim=dim, group=_named(group)))
        # on the buffer: a gather of one sequence along dim 1 is a view of it
        setattr(_buffer(out), GATHERED, _Gathered(shard.detach(), dim, group))
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dim, group, rank, size, partial = ctx.args
        if partial:
            out = waited(funcol.reduce_scatter_tensor(g.contiguous(), "sum", scatter_dim=dim, group=group))
        else:
            out = g.chunk(size, dim=dim)[rank].contiguous()
        return out, None, None, None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str, rank: int, size: int) -> torch.Tensor:
        ctx.args = dim, group
        return x.chunk(size, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dim, group = ctx.args
        return (
            waited(funcol.all_gather_tensor(g.contiguous(), gather_dim=dim, group=group)),
            None,
            None,
            None,
            None,
        )


class _Chunks(torch.autograd.Function):
    """This rank's slice of each of k chunks of a replicated vector (a fused bias); backward
    all-gathers the slices' gradients so every rank holds the whole, identical gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, group: str, rank: int, size: int) -> torch.Tensor:
        ctx.args = k, group, size
        return x.view(k, size, -1)[:, rank].reshape(-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        k, group, _size = ctx.args
        parts = waited(funcol.all_gather_tensor(g.contiguous().view(1, k, -1), gather_dim=0, group=group))
        return parts.transpose(0, 1).reshape(-1), None, None, None, None  # (size, k, m) → (k, size, m)


def tp_chunks(x: torch.Tensor, k: int, group: str, rank: int, size: int) -> torch.Tensor:
    """Slices r of each of k chunks of a replicated vector; gradients all-gathered."""
    return _Chunks.apply(x, k, group, rank, size)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
        ctx.args = dim, group
        return waited(
            funcol.reduce_scatter_tensor(x.contiguous(), "sum", scatter_dim=dim, group=_named(group))
        )

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        dim, group = ctx.args
        return waited(funcol.all_gather_tensor(g.contiguous(), gather_dim=dim, group=group)), None, None


def tp_reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Sequence-parallel g: reduce-scatter partial sums along ``dim`` forward, all-gather backward."""
    return _ReduceScatter.apply(x, dim, group)


def vocab_embedding(
    weight: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, padding_idx: int = -1
) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows [lo, hi) of the embedding; other ids give zeros (the
    partial sums all ranks then add up: Megatron's vocabulary-parallel embedding). The row
    ``padding_idx`` (global; -1: none) gets no gradient, as ``nn.Embedding(padding_idx=)`` has it."""
    outside = (ids < lo) | (ids >= hi)
    local_pad = padding_idx - lo if lo <= padding_idx < hi else -1
    rows = torch.ops.aten.embedding.default(weight, (ids - lo).masked_fill(outside, 0), local_pad)
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron f: identity forward, all-reduce of the gradient."""
    return _Copy.apply(x, group)


def tp_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron g: all-reduce forward, identity backward."""
    return _Reduce.apply(x, group)


def tp_gather(x: torch.Tensor, dim: int, group: str, rank: int, size: int, partial: bool) -> torch.Tensor:
    """All-gather forward; slice (or reduce-scatter a partial gradient) backward."""
    return _Gather.apply(x, dim, group, rank, size, partial)


def tp_slice(x: torch.Tensor, dim: int, group: str, rank: int, size: int) -> torch.Tensor:
    """Keep this rank's slice forward; all-gather backward."""
    return _Slice.apply(x, dim, group, rank, size)


def tp_reslice(x: torch.Tensor, have: int, need: int, group: str, rank: int, size: int) -> torch.Tensor:
    """A tensor split along ``have`` split along ``need`` instead: gathered whole, then sliced (a
    layer's output leaves in the residual stream's placement and the next layer takes its slice,
    ``cost_models.tp.leave`` then ``reshard``)."""
    return tp_slice(tp_gather(x, have, group, rank, size, False), need, group, rank, size)


OURS = (tp_copy, tp_reduce, tp_reduce_scatter, tp_gather, tp_slice, tp_reslice, tp_chunks, vocab_embedding)
"""The functions the rewrite inserts (left alone when it walks the graph again)."""

__all__ = [
    "OURS",
    "regather_saved",
    "tp_chunks",
    "tp_copy",
    "tp_gather",
    "tp_reduce",
    "tp_reduce_scatter",
    "tp_reslice",
    "tp_slice",
    "vocab_embedding",
    "waited",
]
