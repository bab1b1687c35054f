"""The decisions a cost model prices: parallel degrees, ZeRO, micro-batching, schedule, recompute.

``Strategy`` is the knob set of one plan; ``check_strategy`` tells in one
line why a strategy is impossible for a model on a cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from autopar.errors import AutoparError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp32")
TP_OBJECTIVES = ("time", "memory")
SHARDING = ("column", "row", "heads", "vocab")
"""Names of the strategies that split an operator's weights or heads (the others replicate or
follow their inputs): what plans show per module."""


class StrategyError(AutoparError):
    """A strategy violates a constraint (the message names it)."""


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One parallel training configuration (what a plan decides)."""

    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis, inside a node when it fits)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    dp: int = 1
    """Data-parallel degree."""
    zero: int = 0
    """ZeRO stage 0–3 over the data-parallel axis."""
    micro_batch: int = 1
    """Sequences per micro-batch (b)."""
    global_batch: int = 1
    """Sequences per optimizer step (B); B = dp · b · m."""
    seq: int = 2048
    """Sequence length (s)."""
    recompute: str = "none"
    """Activation recomputation of every block: none, selective (attention core) or full."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (v); > 1 only with the interleaved schedule."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism on the TP axis (norms and dropout sharded by sequence)."""
    dtype: str = "bf16"
    """Compute dtype; bf16/fp16 keep fp32 master weights and Adam states."""
    tp_objective: str = "time"
    """What the per-operator TP choice minimises (tp > 1): ``time``, the fastest layout, or
    ``memory``, the fastest of the leanest (e.g. a large embedding split by vocabulary where
    keeping it whole would save its collective)."""
    layout: tuple[tuple[int, int, int], ...] = ()
    """Blocks per pipeline rank as (no recompute, selective, full) counts, rank 0 first;
    empty: an even split with ``recompute`` for every block. The embedding runs on rank 0,
    the head on the last rank; with interleaving each rank's blocks form v equal chunks."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch", "seq", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StrategyError(f"{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise StrategyError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        for name, allowed in (
            ("recompute", RECOMPUTE),
            ("schedule", SCHEDULES),
            ("tp_objective", TP_OBJECTIVES),
            ("dtype", DTYPES),
        ):
            if getattr(self, name) not in allowed:
                raise StrategyError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        self._check_batch_and_layout()

    def _check_batch_and_layout(self) -> None:
        """The schedule, batch split, sequence parallelism and layout agree with the degrees."""
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise StrategyError(
                f"virtual stages {self.virtual_stages} need --schedule interleaved (got {self.schedule})"
            )
        per_replica, rem = divmod(self.global_batch, self.dp)
        if rem:
            raise StrategyError(f"global batch {self.global_batch} is not divisible by dp={self.dp}")
        if per_replica % self.micro_batch:
            raise StrategyError(
                f"micro-batch {self.micro_batch} does not divide the per-replica batch {per_replica}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise StrategyError("sequence parallel needs tp > 1")
        if self.layout and len(self.layout) != self.pp:
            raise StrategyError(f"layout has {len(self.layout)} stages but pp={self.pp}")
        for k, counts in enumerate(self.layout):
            if len(counts) != 3 or any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) < 1:
                raise StrategyError(
                    f"layout stage {k}: expected 3 non-negative block counts, at least one block; "
                    f"got {counts!r}"
                )

    @classmethod
    def for_world(
        cls, world_size: int, *, dp: int | None = None, virtual_stages: int | None = None, **knobs: Any
    ) -> Strategy:
        """A strategy for ``world_size`` GPUs from the knobs given: ``dp`` defaults to the GPUs
        tp·pp leave (world ÷ (tp·pp)), ``virtual_stages`` to 2 under the interleaved schedule
        (1 otherwise)."""
        tp, pp = knobs.get("tp", 1), knobs.get("pp", 1)
        if dp is None:
            dp, rem = divmod(world_size, tp * pp)
            if rem or dp == 0:
                raise StrategyError(f"tp·pp = {tp * pp} does not divide the cluster's {world_size} GPUs")
        if virtual_stages is None:
            virtual_stages = 2 if knobs.get("schedule") == "interleaved" else 1
        return cls(dp=dp, virtual_stages=virtual_stages, **knobs)

    @property
    def world_size(self) -> int:
        """GPUs the strategy uses: tp · pp · dp."""
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline per step: m = B / (dp · b)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def blocks_per_rank(self, blocks: int) -> list[tuple[int, int, int]]:
        """(none, selective, full) block counts per rank: the layout, or an even split
        (chunk c of p·v runs on rank c mod p) with ``recompute`` everywhere."""
        if self.layout:
            return list(self.layout)
        chunks = even_split(blocks, self.pp * self.virtual_stages)
        index = RECOMPUTE.index(self.recompute)
        totals = [sum(chunks[r :: self.pp]) for r in range(self.pp)]
        return [(n if index == 0 else 0, n if index == 1 else 0, n if index == 2 else 0) for n in totals]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        d = asdict(self)
        d["layout"] = [list(c) for c in self.layout]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Strategy:
        """Inverse of ``to_dict``."""
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise StrategyError(f"unknown plan field {unknown[0]!r}; expected {', '.join(sorted(known))}")
        d["layout"] = tuple(tuple(c) for c in d.get("layout", ()))
        return cls(**d)


def even_split(blocks: int, chunks: int) -> list[int]:
    """Blocks per chunk, as even as possible; the extras go to the middle chunks
    (the first holds the embedding and the most in-flight activations, the last the head)."""
    base, extra = divmod(blocks, chunks)
    middle = sorted(range(chunks), key=lambda c: abs(c - (chunks - 1) / 2))[:extra]
    return [base + (1 if c in middle else 0) for c in range(chunks)]


def check_strategy(
    strategy: Strategy,
    *,
    world_size: int,
    blocks: int,
    heads: int | None,
    seq_limit: int | None = None,
) -> None:
    """Raise ``StrategyError`` naming the first constraint ``strategy`` violates."""
    s = strategy
    if s.world_size != world_size:
        raise StrategyError(
            f"tp·pp·dp = {s.tp}·{s.pp}·{s.dp} = {s.world_size} but the cluster has {world_size} GPUs; "
            "change a degree or --nodes"
        )
    if heads is not None and heads % s.tp:
        raise StrategyError(f"tp={s.tp} does not divide {heads} heads")
    if s.pp * s.virtual_stages > blocks:
        raise StrategyError(f"pp·v = {s.pp * s.virtual_stages} stages exceed the model's {blocks} layers")
    if s.layout and sum(map(sum, s.layout)) != blocks:
        raise StrategyError(f"layout places {sum(map(sum, s.layout))} blocks but the model has {blocks}")
    if s.schedule == "interleaved":
        if s.virtual_stages < 2:
            raise StrategyError("the interleaved schedule needs --virtual-stages >= 2")
        if blocks % (s.pp * s.virtual_stages):
            raise StrategyError(
                f"interleaved: {blocks} layers do not split into pp·v = {s.pp * s.virtual_stages} "
                "equal chunks"
            )
        if s.micro_batches % s.pp:
            raise StrategyError(
                f"interleaved: {s.micro_batches} micro-batches are not a multiple of pp={s.pp}"
            )
        if s.layout and any(sum(c) != blocks // s.pp for c in s.layout):
            raise StrategyError("interleaved: every rank must hold the same number of blocks")
    if seq_limit is not None and s.seq > seq_limit:
        raise StrategyError(f"seq {s.seq} exceeds the model's maximum {seq_limit}")
