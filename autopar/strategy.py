"""The decisions a cost model prices: parallel degrees, ZeRO, micro-batching, schedule, recompute.

``Strategy`` is the knob set of one plan; ``check_strategy`` tells in one
line why a strategy is impossible for a model on a cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

from autopar.errors import StrategyError
from autopar.knobs import field_problem, knob
from autopar.mesh import ParallelDims
from autopar.recompute_policy import RECOMPUTE, RecomputePolicy
from autopar.runs import ZERO_BUBBLE, runs_on_ddp, runs_with_policies, runs_with_zero, shares_problem
from autopar.splits import V_SHAPE, even_split, fewest_blocks, least_rank_blocks

SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
MULTI_CHUNK = ("interleaved", *ZERO_BUBBLE)
"""Schedules that may run more than one model chunk (virtual stage) per rank."""
DTYPES = ("bf16", "fp16", "fp32")
TP_OBJECTIVES = ("time", "memory")
GRAD_REDUCE = ("fp32", "bf16", "int8")
"""Dtypes the data-parallel gradient reduction may run in (``Strategy.grad_reduce``)."""
COMPILE = ("off", "block")
"""How a plan compiles its model (``Strategy.compile``): eager, or each block by ``torch.compile``."""
DDP_BUCKET_MB = 25.0
"""DDP's default gradient bucket cap in MiB (``DistributedDataParallel(bucket_cap_mb=...)``)."""
SHARDING = ("column", "row", "heads", "vocab")
"""Names of the strategies that split an operator's weights or heads (the others replicate or
follow their inputs): what plans show per module."""


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One parallel training configuration (what a plan decides)."""

    tp: int = knob(1, kind=int, least=1, help="tensor-parallel degree")
    """Tensor-parallel degree (innermost mesh axis, inside a node when it fits)."""
    pp: int = knob(1, kind=int, least=1, help="pipeline-parallel degree")
    """Pipeline-parallel degree (stages)."""
    dp: int = knob(1, kind=int, least=1, help="data-parallel degree", derived="the GPUs tp·pp·cp leave")
    """Data-parallel degree."""
    cp: int = knob(1, kind=int, least=1, help="context-parallel degree (each sequence split over cp ranks)")
    """Context-parallel degree: each micro-batch's sequences split over cp ranks, two chunks of
    s / (2·cp) positions each (chunks r and 2·cp − 1 − r: the same share of causal attention on
    every rank), keys and values all-gathered for attention; the weights' gradients summed over
    dp·cp ranks, ZeRO sharding over them (torchtitan's ``dp_shard_cp``). Between dp and tp in
    the mesh."""
    zero: int = knob(0, kind=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    """ZeRO stage 0–3 over the data-parallel axis."""
    micro_batch: int = knob(1, kind=int, least=1, help="micro-batch size (sequences)")
    """Sequences per micro-batch (b)."""
    global_batch: int = knob(1, kind=int, least=1, fixable=False, help="sequences per step")
    """Sequences per optimizer step (B); B = dp · b · m."""
    seq: int = knob(2048, kind=int, least=1, fixable=False, help="sequence length")
    """Sequence length (s)."""
    recompute: str = knob("none", kind=str, fixable=False, help="recompute of every block")
    """Activation recomputation of every block (when there is no ``layout``): none, selective
    (the attention core, Korthikanti et al. 2022), full, or one of ``policies`` by name."""
    schedule: str = knob("1f1b", kind=str, choices=SCHEDULES, help="pipeline schedule")
    """Pipeline schedule: gpipe, 1f1b, interleaved (1F1B over v chunks per rank), interleaved-zb
    (zero bubble ZB1P over v chunks; v = 1 is ZB-H1), zbv or dualpipev (zero bubble, two chunks
    per rank in a V)."""
    virtual_stages: int = knob(
        1,
        kind=int,
        least=1,
        help="model chunks per pipeline rank (v)",
        derived="2 under a multi-chunk schedule, else 1",
    )
    """Model chunks per pipeline rank (v); > 1 only with a multi-chunk schedule (``MULTI_CHUNK``),
    exactly 2 in a V (``V_SHAPE``)."""
    sequence_parallel: bool = knob(False, kind=bool, help="sequence parallelism")
    """Megatron sequence parallelism on the TP axis (norms and dropout sharded by sequence)."""
    dtype: str = knob("bf16", kind=str, choices=DTYPES, fixable=False, help="compute dtype")
    """Compute dtype; bf16/fp16 keep fp32 master weights and Adam states."""
    grad_reduce: str = knob("fp32", kind=str, choices=GRAD_REDUCE, help="dtype gradients are reduced in")
    """Dtype of the data-parallel gradient reduction (all-reduce, reduce-scatter): fp32, or bf16
    (half the bytes on the wire: DDP's ``bf16_compress_hook``, FSDP2's ``reduce_dtype``). On a
    bf16 plan each rank's gradient is rounded to the precision it was computed in; on an fp32
    or fp16 plan bf16 drops mantissa bits the plan keeps (``lossy_comm``)."""
    powersgd_rank: int = knob(0, kind=int, least=0, help="PowerSGD rank on a DDP plan (0: off; lossy)")
    """PowerSGD gradient compression at this rank (Vogels et al. 2019), through DDP's
    ``powerSGD_hook``: each gradient matrix (n × m) is all-reduced as two rank-r factors,
    r·(n + m) numbers instead of n·m, with error feedback (what compression dropped is added to
    the next step's gradient); vectors are all-reduced whole. 0: off. DDP plans only (tp = pp =
    1, ZeRO 0–1, fp32 reduction); always lossy (``lossy_comm``)."""
    ep: int = knob(
        1, kind=int, least=1, help="expert-parallel degree (MoE experts split over data-parallel ranks)"
    )
    """Expert-parallel degree: each MoE layer's routed experts split over ep consecutive ranks of
    the data-parallel axis, rows sent to their expert's rank and back by all-to-all; the expert
    weights' ZeRO group is the dp / ep ranks holding the same experts (torchtitan's, Megatron's).
    1: experts replicated like every other weight."""
    expert_skew: float = knob(
        1.0,
        kind=float,
        least=1,
        free=1.0,
        help="MoE load imbalance priced: busiest EP rank's rows over an even share",
    )
    """Routed rows the busiest expert-parallel rank receives over an even share (1: balanced,
    what a router's load-balancing loss aims at; at most ep: every row to one rank). Prices the
    experts' compute and the all-to-alls of ep > 1 plans (``cost_models.experts``); it changes
    nothing that runs. Set it from router statistics (``train_step``'s per-expert counts)."""
    dp_replicate: int = knob(
        1, kind=int, least=1, help="HSDP replica groups (ZeRO-2/3 shards within each; 1: none)"
    )
    """Hybrid sharding (HSDP): the data-parallel axis as ``dp_replicate`` groups of
    ``dp_shard`` = dp / dp_replicate consecutive ranks; ZeRO shards the model states within a
    group (inside a node when dp_shard · tp fits one), gradients are reduce-scattered within it
    and all-reduced across the groups (FSDP2 on a 2-D (replicate, shard) mesh; Zhao et al.
    2023, "PyTorch FSDP" §3.2.2). 1: every state sharded over all dp ranks. ZeRO-2/3 only."""
    bucket_mb: float = knob(
        DDP_BUCKET_MB, kind=float, least=0, unit="MiB", help="DDP gradient bucket cap in MiB on a DDP plan"
    )
    """DDP's gradient bucket cap in MiB (``bucket_cap_mb``; ZeRO 0–1 plans that run the model as
    written): backward's gradients are all-reduced a bucket at a time as each fills, so fewer,
    larger buckets pay the all-reduce's latency fewer times, and smaller ones leave less to
    reduce after backward ends (the last bucket). torch's default 25 on every other plan
    (FSDP2 reduces per block)."""
    compile: str = knob(
        "off",
        kind=str,
        choices=COMPILE,
        free="off",
        auto=True,
        help="compilation (off: eager; block: torch.compile each block)",
    )
    """``off``: eager kernels, as written. ``block``: regional compilation, each block compiled
    by ``torch.compile`` (inductor) after recompute wrapping and before data-parallel sharding,
    as torchtitan does; the cost model then prices each chain of elementwise and reduction ops
    between two matmuls as one fused kernel (``cost_models.profile.fusion_groups``)."""
    tp_objective: str = knob(
        "time", kind=str, choices=TP_OBJECTIVES, help="what the per-operator TP choice minimises"
    )
    """What the per-operator TP choice minimises (tp > 1): ``time``, the fastest layout, or
    ``memory``, the fastest of the leanest (e.g. a large embedding split by vocabulary where
    keeping it whole would save its collective)."""
    layout: tuple[tuple[int, ...], ...] = ()
    """Blocks per pipeline rank as counts per recompute choice (``choices``: none, selective,
    full, then each policy), rank 0 first; empty: an even split with ``recompute`` for every
    block. The embedding runs on rank 0, the head on the last rank; with interleaving each
    rank's blocks spread over its v chunks (``chunk_blocks``), so ranks may hold different
    numbers of blocks as 1F1B stages do."""
    policies: tuple[RecomputePolicy, ...] = ()
    """The per-operator recompute policies this strategy may use (selective activation
    checkpointing), after none, selective and full."""
    dp_shares: tuple[int, ...] = ()
    """Micro-batches each data-parallel replica runs per step, replica 0 first (a mixed cluster's
    faster replicas take more: ``runs.shares_problem`` says where that is exact); empty: every
    replica runs ``micro_batches``."""

    def __post_init__(self) -> None:
        if why := field_problem(Strategy, self):  # each knob's type, bounds and choices
            raise StrategyError(why)
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise StrategyError(f"recompute policies must have distinct names, got {names}")
        if self.recompute not in self.choices:
            raise StrategyError(f"recompute must be one of {', '.join(self.choices)}, got {self.recompute!r}")
        self._check_batch_and_layout()
        self._check_comm_knobs()
        shares = dict(dp=self.dp, micro_batch=self.micro_batch, global_batch=self.global_batch)
        if unshared := shares_problem(self.dp_shares, **shares, zero=self.zero, cp=self.cp, ep=self.ep):
            raise StrategyError(unshared)

    def _check_comm_knobs(self) -> None:
        """PowerSGD, INT8 reduction, DDP's bucket size and HSDP fit the plan's data-parallel runtime."""
        if self.grad_reduce == "int8" and not self.uses_ddp:
            raise StrategyError(
                "an int8 gradient reduction is a DDP comm hook (runtime.quantized): it needs dp > 1, "
                "tp = pp = ep = 1 and ZeRO 0 or 1"
            )
        if self.powersgd_rank and not (self.uses_ddp and self.grad_reduce == "fp32"):
            raise StrategyError(
                f"PowerSGD (rank {self.powersgd_rank}) compresses DDP's fp32 gradient all-reduce: it "
                "needs dp > 1, tp = pp = 1, ZeRO 0 or 1 and --grad-reduce fp32"
            )
        if self.bucket_mb != DDP_BUCKET_MB and not self.uses_ddp:
            raise StrategyError(
                f"bucket_mb {self.bucket_mb:g} sizes DDP's gradient buckets: it needs a plan on DDP "
                "(dp > 1, tp = pp = 1, ZeRO 0 or 1); FSDP2 reduces each block's gradients at once"
            )
        if self.ep > 1 and (self.dp % self.ep or self.dp_replicate > 1):
            raise StrategyError(
                f"ep {self.ep} takes its ranks from the data-parallel axis: it must divide dp = {self.dp}, "
                "and it runs without HSDP (dp_replicate = 1)"
            )
        if self.dp_replicate > 1 and (self.zero < 2 or self.dp % self.dp_replicate or self.dp_shard < 2):
            raise StrategyError(
                f"dp_replicate {self.dp_replicate} (HSDP) needs ZeRO-2 or 3 (got {self.zero}) and shard "
                f"groups of at least 2 ranks dividing dp = {self.dp}"
            )

    def _check_batch_and_layout(self) -> None:
        """The schedule, batch split, sequence parallelism and layout agree with the degrees."""
        if self.virtual_stages > 1 and self.schedule not in MULTI_CHUNK:
            raise StrategyError(
                f"virtual stages {self.virtual_stages} need a schedule of several chunks per rank "
                f"({', '.join(MULTI_CHUNK)}); got {self.schedule}"
            )
        if self.schedule in V_SHAPE and self.virtual_stages != 2:
            raise StrategyError(
                f"{self.schedule} runs exactly 2 chunks per rank (a V); "
                f"got --virtual-stages {self.virtual_stages}"
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
        if self.cp > 1 and self.seq % (2 * self.cp):
            raise StrategyError(
                f"cp {self.cp} splits each sequence into 2·cp = {2 * self.cp} equal chunks: "
                f"seq {self.seq} is not a multiple of it"
            )
        if self.cp > 1 and self.policies:
            raise StrategyError(
                f"cp {self.cp} runs without per-operator recompute policies (they name a block's calls as "
                "captured whole; context parallelism changes its attention's): use none, selective or full"
            )
        if self.cp > 1 and (self.ep > 1 or self.dp_replicate > 1):
            raise StrategyError(
                f"cp {self.cp} runs without expert parallelism and HSDP (got ep {self.ep}, "
                f"dp_replicate {self.dp_replicate}): cp ranks join the data-parallel shard group"
            )
        if self.layout and len(self.layout) != self.pp:
            raise StrategyError(f"layout has {len(self.layout)} stages but pp={self.pp}")
        width = len(self.choices)
        for k, counts in enumerate(self.layout):
            if (
                len(counts) != width
                or any(not isinstance(c, int) or c < 0 for c in counts)
                or sum(counts) < 1
            ):
                raise StrategyError(
                    f"layout stage {k}: expected {width} non-negative block counts "
                    f"({', '.join(self.choices)}), at least one block; got {counts!r}"
                )

    @classmethod
    def for_world(
        cls, world_size: int, *, dp: int | None = None, virtual_stages: int | None = None, **knobs: Any
    ) -> Strategy:
        """A strategy for ``world_size`` GPUs from the knobs given: ``dp`` defaults to the GPUs
        tp·pp·cp leave (world ÷ (tp·pp·cp)), ``virtual_stages`` to 2 under a multi-chunk schedule
        (1 otherwise)."""
        others = ParallelDims(tp=knobs.get("tp", 1), pp=knobs.get("pp", 1), cp=knobs.get("cp", 1))
        if dp is None:
            dp, rem = divmod(world_size, others.world_size)
            if rem or dp == 0:
                named = "tp·pp·cp" if others.cp > 1 else "tp·pp"
                raise StrategyError(
                    f"{named} = {others.world_size} does not divide the cluster's {world_size} GPUs"
                )
        if virtual_stages is None:
            virtual_stages = 2 if knobs.get("schedule") in MULTI_CHUNK else 1
        return cls(dp=dp, virtual_stages=virtual_stages, **knobs)

    @cached_property
    def choices(self) -> tuple[str, ...]:
        """The recompute choices a layout counts: none, selective, full, then the policies."""
        return RECOMPUTE + tuple(p.name for p in self.policies)

    def policy(self, name: str) -> RecomputePolicy | None:
        """The per-operator policy called ``name`` (None for none, selective and full)."""
        return next((p for p in self.policies if p.name == name), None)

    @property
    def lossy_comm(self) -> bool:
        """Whether a communication knob drops precision the plan's dtype keeps: a gradient
        reduction in bf16 of an fp32 or fp16 plan (fp16 has 3 more mantissa bits than bf16), in
        int8 (8-bit codes per chunk of 512), or PowerSGD (a low-rank approximation of every
        gradient matrix)."""
        return (self.grad_reduce != "fp32" and self.grad_reduce != self.dtype) or self.powersgd_rank > 0

    @property
    def uses_ddp(self) -> bool:
        """Whether the data-parallel axis runs on DDP (the model as written, tp = pp = 1, at
        ZeRO 0–1, dp > 1; every other data-parallel plan runs on FSDP2)."""
        return runs_on_ddp(tp=self.tp, pp=self.pp, dp=self.dims.dp_cp, zero=self.zero, ep=self.ep)

    @property
    def uses_fsdp(self) -> bool:
        """Whether the data-parallel axis runs on FSDP2 (dp > 1 but not DDP's plans,
        ``runtime.sharding``): gathered weights beside their shards, whatever the ZeRO stage."""
        return self.dims.dp_cp > 1 and not self.uses_ddp

    @cached_property
    def dims(self) -> ParallelDims:
        """The mesh these degrees lay out: its axes, strides and rank coordinates."""
        return ParallelDims(
            pp=self.pp, dp=self.dp, tp=self.tp, dp_replicate=self.dp_replicate, ep=self.ep, cp=self.cp
        )

    @property
    def dp_shard(self) -> int:
        """Ranks ZeRO shards the model states over: dp / dp_replicate (all of dp without HSDP),
        times cp (context-parallel ranks hold the same weights: ``ParallelDims.dp_cp``)."""
        return self.dp // self.dp_replicate * self.cp

    @property
    def world_size(self) -> int:
        """GPUs the strategy uses: tp · pp · dp · cp."""
        return self.dims.world_size

    @property
    def rank_sequences(self) -> float:
        """Sequences' worth of work one rank does per micro-batch: b, or b / cp under context
        parallelism (a rank's tokens and its share of causal attention both 1/cp of b
        sequences': what the cost model prices it as, ``cost_models.context``)."""
        return self.micro_batch if self.cp == 1 else self.micro_batch / self.cp

    @property
    def rank_tokens(self) -> int:
        """Tokens of one micro-batch on one rank: b · s / cp (each sequence split over cp)."""
        return self.micro_batch * self.seq // self.cp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline per step: m = B / (dp · b)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def replica_micro_batches(self, replica: int) -> int:
        """Micro-batches data-parallel replica ``replica`` runs per step (``dp_shares``)."""
        return self.dp_shares[replica] if self.dp_shares else self.micro_batches

    def replica_rows(self, replica: int) -> tuple[int, int]:
        """The rows [start, stop) of the global batch data-parallel replica ``replica`` trains on."""
        counts = [self.replica_micro_batches(d) for d in range(replica + 1)]
        return sum(counts[:-1]) * self.micro_batch, sum(counts) * self.micro_batch

    def chunk_rank(self, chunk: int) -> int:
        """The pipeline rank that runs model chunk ``chunk`` (of p·v): c mod p (looped: Megatron's
        interleaving, torch's ``ScheduleInterleaved*``), or in a V (``V_SHAPE``) c for c < p and
        2p − 1 − c after (torch's ``generate_stage_to_rank_mapping(style="v")``)."""
        p = self.pp
        if self.schedule in V_SHAPE:
            return chunk if chunk < p else 2 * p - 1 - chunk
        return chunk % p

    @cached_property
    def head_rank(self) -> int:
        """The pipeline rank of the last chunk (the head): p − 1, or 0 in a V."""
        return self.chunk_rank(self.pp * self.virtual_stages - 1)

    def rank_chunks(self, rank: int) -> list[int]:
        """The chunks pipeline rank ``rank`` runs, in model order."""
        return [c for c in range(self.pp * self.virtual_stages) if self.chunk_rank(c) == rank]

    def chunk_blocks(self, blocks: int) -> list[int]:
        """Blocks per pipeline chunk in model order (p·v chunks, chunk c on ``chunk_rank(c)``).

        Each rank's blocks (``blocks_per_rank``) spread as evenly as its v chunks allow; a rank
        with fewer than a multiple of v leaves the short chunks where the embedding (chunk 0) or
        the head (chunk p·v − 1) already runs, so a first or last stage one block lighter (Llama
        3's 405B layout, Dubey et al. 2024 §3.3.2) is chunks of one block and a chunk of the
        embedding alone."""
        p, v = self.pp, self.virtual_stages
        edges = (0, p * v - 1)
        chunks = [0] * (p * v)
        for rank, counts in enumerate(self.blocks_per_rank(blocks)):
            mine = self.rank_chunks(rank)
            order = [c for c in mine if c not in edges] + [c for c in mine if c in edges]
            base, extra = divmod(sum(counts), v)
            for j, c in enumerate(order):
                chunks[c] = base + (1 if j < extra else 0)
        return chunks

    def min_rank_blocks(self, rank: int) -> int:
        """Fewest blocks pipeline rank ``rank`` may hold: one per chunk, but the chunks of the
        embedding and the head may hold them alone (1 per rank without interleaving, and at
        least 1 always)."""
        return least_rank_blocks(rank, pp=self.pp, virtual_stages=self.virtual_stages, schedule=self.schedule)

    def blocks_per_rank(self, blocks: int) -> list[tuple[int, ...]]:
        """Block counts per rank by recompute choice (``choices``): the layout, or an even
        split over the ranks (``even_split``, each rank its ``min_rank_blocks`` at least) with
        ``recompute`` everywhere."""
        if self.layout:
            return list(self.layout)
        index = self.choices.index(self.recompute)
        totals = even_split(blocks, self.pp, [self.min_rank_blocks(k) for k in range(self.pp)])
        return [tuple(n if i == index else 0 for i in range(len(self.choices))) for n in totals]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        d = asdict(self)
        d["layout"] = [list(c) for c in self.layout]
        d["policies"] = [p.to_dict() for p in self.policies]
        d["dp_shares"] = list(self.dp_shares)
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
        d["policies"] = tuple(RecomputePolicy.from_dict(p) for p in d.get("policies", ()))
        d["dp_shares"] = tuple(d.get("dp_shares", ()))
        return cls(**d)


def remat(choice: str) -> bool:
    """Whether a recompute choice checkpoints the whole block (full, or a per-operator policy):
    its forward runs again in backward, which holds one block's activations while it runs."""
    return choice not in ("none", "selective")


def check_strategy(
    strategy: Strategy,
    *,
    world_size: int,
    blocks: int,
    heads: int | None,
    seq_limit: int | None = None,
    experts: int = 0,
) -> None:
    """Raise ``StrategyError`` naming the first constraint ``strategy`` violates (``experts``:
    routed experts per MoE layer, 0 for a dense model)."""
    s = strategy
    if s.ep > 1 and (experts == 0 or experts % s.ep):
        have = f"{experts or 'no'} routed experts per layer"
        raise StrategyError(f"ep={s.ep} must divide each MoE layer's experts; the model has {have}")
    if s.world_size != world_size:
        cp = f"·{s.cp}" if s.cp > 1 else ""
        raise StrategyError(
            f"tp·pp·dp{'·cp' if cp else ''} = {s.tp}·{s.pp}·{s.dp}{cp} = {s.world_size} but the cluster has "
            f"{world_size} GPUs; change a degree or --nodes"
        )
    if heads is not None and heads % s.tp:
        raise StrategyError(f"tp={s.tp} does not divide {heads} heads")
    chunks = s.pp * s.virtual_stages
    if fewest_blocks(pp=s.pp, virtual_stages=s.virtual_stages, schedule=s.schedule) > blocks:
        raise StrategyError(
            f"pp·v = {chunks} stages exceed the model's {blocks} layers"
            + (
                " (every chunk but the embedding's and the head's needs a block, and every rank one)"
                if s.virtual_stages > 1
                else ""
            )
        )
    if s.layout and sum(map(sum, s.layout)) != blocks:
        raise StrategyError(f"layout places {sum(map(sum, s.layout))} blocks but the model has {blocks}")
    _check_schedule(s)
    if seq_limit is not None and s.seq > seq_limit:
        raise StrategyError(f"seq {s.seq} exceeds the model's maximum {seq_limit}")


def _check_schedule(s: Strategy) -> None:
    """The micro-batch count and layout the pipeline schedule needs (torch's schedules refuse
    the rest)."""
    p = s.pp
    m = min(s.dp_shares or (s.micro_batches,))
    if s.schedule == "interleaved" and s.virtual_stages < 2:
        raise StrategyError("the interleaved schedule needs --virtual-stages >= 2")
    if s.schedule in ("interleaved", "interleaved-zb") and p > 1 and any(x % p for x in s.dp_shares or (m,)):
        raise StrategyError(f"{s.schedule}: {m} micro-batches are not a multiple of pp={p}")
    if s.schedule in V_SHAPE and m < 2 * p:
        raise StrategyError(
            f"{s.schedule}: {m} micro-batches are fewer than its 2·pp = {2 * p} chunks; "
            "raise the global batch or lower the micro-batch"
        )
    if s.policies and not runs_with_policies(s.schedule, p):
        names = ", ".join(x.name for x in s.policies)
        raise StrategyError(
            f"{s.schedule} cannot run per-operator recompute policies ({names}): "
            "it runs backward twice over each block and torch's selective checkpointing replays once; "
            "use --recompute none, selective or full, or another --schedule"
        )
    if not runs_with_zero(s.schedule, s.zero) and s.dp > 1 and p > 1:
        raise StrategyError(
            f"{s.schedule} cannot run with ZeRO-3: FSDP2 reshards the weights after each input-gradient "
            "pass, before torch's separate weight-gradient pass needs them; use --zero 2 or another "
            "--schedule"
        )
    short = [k for k, c in enumerate(s.layout) if s.virtual_stages > 1 and sum(c) < s.min_rank_blocks(k)]
    if short:
        k = short[0]
        raise StrategyError(
            f"{s.schedule}: rank {k} holds {sum(s.layout[k])} blocks but its {s.virtual_stages} chunks "
            f"need {s.min_rank_blocks(k)} (one each, but the embedding's and the head's)"
        )
