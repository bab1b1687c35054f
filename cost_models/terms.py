"""The cost model as linear terms: what one block costs under each recompute choice.

For one choice of the "outer" knobs (tp, pp, dp, ZeRO, micro-batch, schedule, sequence
parallelism, dtype) every per-rank quantity the estimate needs — time per micro-batch,
parameters, activation bytes, data-parallel traffic — is linear in how many blocks of each
recompute kind the rank holds. ``Terms`` holds those coefficients. ``estimate`` evaluates them
for a given layout and the planner's ILP minimises over layouts with the very same
coefficients, so a plan's ILP objective equals its estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster, DeviceSpec
from autopar.cost_models import comm
from autopar.cost_models import memory as mem
from autopar.cost_models import recompute as rc
from autopar.cost_models.compression import compress_s_per_param
from autopar.cost_models.compute import (
    layer_backward_s,
    layer_forward_s,
    loss_time_s,
    measured_timing,
    optimizer_s_per_param,
    weight_grad_s,
)
from autopar.cost_models.context import cp_phases_s, kv_extra_bytes
from autopar.cost_models.dp_comm import dp_terms
from autopar.cost_models.experts import (
    ep_backward_s,
    ep_forward_s,
    ep_link,
    expert_factors,
    expert_skew_s,
    skew,
)
from autopar.cost_models.pipeline import bubble_rounds
from autopar.cost_models.profile import LayerCost, ModelProfile
from autopar.errors import AutoparError
from autopar.measurements import ComputeProfile, LayerTiming
from autopar.strategy import Strategy

CUDA_CONTEXT_BYTES = 2**30
"""Memory the CUDA context and NCCL take before any tensor (~1 GiB)."""
FRAGMENTATION = 0.05
"""Share of device memory kept back for allocator fragmentation."""


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One layer with one recompute choice, per micro-batch, on one GPU."""

    fwd_s: float
    """Forward compute."""
    bwd_compute_s: float
    """Backward compute without recomputation (measured, or 2× forward)."""
    recompute_s: float
    """Compute redone in backward (a forward for full, the attention core for selective, the
    calls a per-operator policy does not keep)."""
    tp_s: float
    """Tensor-parallel collectives: forward + backward, + forward again when the block is
    checkpointed whole (full or a per-operator policy: its recomputed forward issues them)."""
    act_bytes: float
    """Activations kept until backward."""
    act_full_bytes: float
    """Activations without recompute (rematerialised for one layer at a time under full)."""
    params: float
    """Parameters on this GPU (÷ tp)."""
    wgrad_s: float
    """The weight-gradient part of ``bwd_compute_s`` (``compute.weight_grad_s``): what a
    zero-bubble schedule runs apart from the rest of the backward."""
    fwd_flops: float
    """Forward FLOPs (whole layer, for throughput)."""
    recompute_flops: float
    """FLOPs redone in backward (whole layer)."""
    ep_s: float = 0.0
    """The expert-parallel all-to-alls (dispatch and combine, forward and backward, and the
    forward's again when the block is checkpointed whole): part of ``tp_s``, the model-parallel
    communication on the critical path."""
    expert_params: float = 0.0
    """Routed-expert parameters on this GPU under expert parallelism (ep > 1: E/ep experts'),
    part of ``params``; their states shard over the dp / ep ranks holding the same experts."""
    deferred_bytes: float = 0.0
    """What a zero-bubble schedule keeps from a chunk's I to its W beyond ``act_bytes``: the
    weight-op output gradients (``memory.deferred_grad_bytes``) and what recompute rebuilt."""

    @property
    def compute_s(self) -> float:
        """Forward + backward (backward ≈ 2× forward, Narayanan et al. SC'21 §3.5, unless measured)."""
        return self.fwd_s + self.bwd_compute_s

    @property
    def bwd_s(self) -> float:
        """Backward including recomputation."""
        return self.bwd_compute_s + self.recompute_s

    @property
    def time_s(self) -> float:
        """Everything on the critical path of one micro-batch."""
        return self.compute_s + self.recompute_s + self.tp_s


@dataclass(frozen=True, kw_only=True)
class Terms:
    """Coefficients of every per-rank quantity for one set of outer knobs."""

    strategy: Strategy
    block: dict[str, Unit]
    """By recompute choice (``Strategy.choices``): none, selective, full, the policies."""
    embed: Unit
    head: Unit
    block_type: str
    p2p_s: float
    """Point-to-point per micro-batch on every rank (2v sends when pp > 1)."""
    inflight: tuple[float, ...]
    """Micro-batches of activations each rank holds at peak."""
    deferred: tuple[float, ...]
    """Micro-batches of deferred weight gradients held at that peak (``memory.deferred_stage_copies``)."""
    bubble_rounds: float
    """The schedule's bubble in micro-batch times of a rank (``pipeline.bubble_rounds``, at a
    block's ratio of forward, input-gradient and weight-gradient time)."""
    state_bytes_per_param: float
    """Weights + gradients + optimizer bytes per parameter on a GPU after ZeRO sharding."""
    weight_bytes: int
    grad_bytes: float
    """Bytes per parameter the DP reductions send (``compression.wire_bytes_per_param``)."""
    lat_s: float
    """Latency of one all-gather over the DP group (ring: (dp−1)·α)."""
    s_per_byte: float
    """Seconds per byte of one all-gather over the DP group (ring: (dp−1)/(dp·β))."""
    rs_lat_s: float
    """The same for one reduce-scatter (equal on a ring; measured separately)."""
    rs_s_per_byte: float
    """Seconds per byte of one reduce-scatter."""
    ar_lat_s: float
    """Latency of one all-reduce over the DP group (ring: 2(dp−1)·α)."""
    ar_s_per_byte: float
    """Seconds per byte of one all-reduce (ring: 2(dp−1)/(dp·β))."""
    overlap: float
    """Share of compute time that can hide DP collectives (1 unless measured lower)."""
    overlap_slowdown: float
    """Compute seconds lost per second of DP communication hidden (``DeviceSpec.overlap_slowdown``)."""
    ddp_buckets: int
    """ZeRO 0–1: DDP's all-reduces per step, one per gradient bucket (``buckets.ddp_buckets``)."""
    last_bucket_s: float
    """ZeRO 0–1: the all-reduce of DDP's last gradient bucket, which starts when backward ends
    (min(``Strategy.bucket_mb``, the rank's gradients): all of them for a small model)."""
    opt_s_per_param: float
    """Optimizer seconds per parameter on a GPU (÷ dp under ZeRO ≥ 1), plus the gradient
    compression kernels (``compression.compress_s_per_param``): both once per step, per parameter."""
    loss_bytes: float
    """The loss's fp32 buffers on the last rank (``memory.loss_bytes``)."""
    buffers: tuple[float, ...]
    """Communication buffers per rank."""
    reserve_bytes: float
    dp_crosses_nodes: bool
    tp_crosses_nodes: bool
    expert_state: float = 1.0
    expert_optimizer: float = 1.0
    expert_comm: float = 1.0
    """ep > 1: what one local expert parameter weighs against a dense one in the per-parameter
    terms of model states (ZeRO shards it over the dp/ep ranks holding the same experts, not
    over dp), the optimizer and the DP gradient reduction (over those dp/ep ranks):
    ``cost_models.experts.expert_factors``."""

    def held_bytes(self, rank: int, act_bytes: Any, deferred_bytes: Any) -> Any:
        """Rank ``rank``'s peak activations and deferred gradients from per-micro-batch bytes of
        its layers (``Unit.act_bytes``, ``Unit.deferred_bytes``). Linear, for the ILP too."""
        return self.inflight[rank] * act_bytes + self.deferred[rank] * deferred_bytes

    def weighted(self, params: Any, expert: Any, term: str) -> Any:
        """``params`` (of which ``expert`` are local expert parameters) as dense parameters for
        ``term`` (state, optimizer, comm): params + (factor − 1)·expert. Linear, for the ILP too."""
        return params + (getattr(self, f"expert_{term}") - 1.0) * expert


HIDDEN = "backward, hidden"
"""Phase of a collective issued in backward behind compute and priced at no time: the re-gather
of a saved sequence-parallel shard, which Megatron-LM issues asynchronously just before the
reader's input-gradient GEMM and waits for after it (Korthikanti et al. 2022 §4.2.2;
``LinearWithGradAccumulationAndAsyncCommunication.backward``), the program the corpus measured.
autopar's runtime issues it when backward reads the tensor, not yet overlapped."""


@dataclass(frozen=True, kw_only=True)
class TPLayer:
    """What the per-operator tensor-parallel choice of one layer type costs (chosen by
    ``planner.tp_ilp``, summed up by ``cost_models.tp_layout.layout_of``)."""

    collectives: tuple[tuple[str, str, float], ...]
    """(kind, phase forward/backward, bytes per sequence) of each collective it issues per
    micro-batch (the once-per-step partial-gradient all-reduce is not priced)."""
    local_params: float
    """Parameters one rank holds (a weight the choice keeps replicated counts whole)."""
    stream_share: float = 1.0
    """Share of the residual-stream ops' bytes (``OpCost.stream``) one rank moves: 1 run whole,
    1/t split over the sequence (as sequence parallelism does, with or without the flag)."""


TPLayout = dict[str, TPLayer]
"""Layer type → its TP choice at one width (empty at tp 1)."""

Units = tuple[dict[str, Unit], Unit, Unit]
"""Block units by recompute choice, the embedding's, the head's."""


def layer_units(
    profile: ModelProfile,
    cluster: Cluster,
    st: Strategy,
    tp_layout: TPLayout | None = None,
) -> Units:
    """Per-layer units; they depend only on tp, sequence parallelism, dtype and the profile.

    Where the cluster carries a measured compute profile covering the layer type at this
    micro-batch, width and dtype, its forward and backward times replace the roofline.
    Tensor-parallel communication per layer: with ``tp_layout`` (the per-operator choice), the
    collectives it issues, sized for this micro-batch; else Megatron's count, the forward's
    all-reduces and backward's (an all-gather + reduce-scatter each under sequence
    parallelism). Full recompute repeats the forward's. Parameters per GPU: the layout's, else
    the layer's ÷ t."""
    device = cluster.device
    rate = device.achievable_flops(st.dtype)
    tp_link = comm.group_link(cluster, st.dims.axis("tp"))
    block_types = set(profile.layers[1:-1])
    if len(block_types) != 1:
        raise AutoparError(
            f"the cost model and planner handle one repeated block type; this model has {sorted(block_types)}"
        )
    (block_type,) = block_types
    ctx = _UnitContext(
        profile=profile,
        device=device,
        st=st,
        rate=rate,
        tp_link=tp_link,
        measured=cluster.compute_profile,
        tp_layout=tp_layout,
        ep_link=ep_link(cluster, st),
        cp_s=cp_phases_s(profile, cluster, st),
    )
    blocks = {r: _unit(ctx, block_type, r) for r in st.choices}
    return blocks, _unit(ctx, "embed", "none"), _unit(ctx, "head", "none")


@dataclass(frozen=True, kw_only=True)
class _UnitContext:
    """What every unit of ``layer_units`` is priced with."""

    profile: ModelProfile
    device: DeviceSpec
    st: Strategy
    rate: float
    """Achievable FLOP/s of the device at the strategy's dtype."""
    tp_link: comm.GroupLink
    """The link the TP group's collectives run over."""
    measured: ComputeProfile | None
    """The cluster's measured compute profile, if any."""
    tp_layout: TPLayout | None
    ep_link: comm.GroupLink
    """The link an expert-parallel group's all-to-alls run over."""
    cp_s: tuple[float, float]
    """A block's context-parallel collectives, forward and backward (``context.cp_phases_s``)."""


def _collective_s(ctx: _UnitContext, name: str, size: float, k: int = 1) -> float:
    """Time of ``k`` TP collectives ``name`` of ``size`` bytes each (α + β·size)."""
    a, b = comm.coefficients(name, ctx.st.tp, ctx.tp_link, size)
    return k * (a + b * size)


def _tp_phases_s(ctx: _UnitContext, name: str, lc: LayerCost, chosen: TPLayer | None) -> tuple[float, float]:
    """Forward and backward tensor-parallel communication of one layer per micro-batch.

    With the per-operator choice: the collectives it issues. Else Megatron's pattern. A
    block: one collective per row-parallel output in forward and its conjugate in backward
    (all-reduces; an all-gather + reduce-scatter each under SP). The vocabulary-parallel
    embedding all-reduces its partial output (reduce-scatters under SP). The head's input
    gradient is all-reduced in backward (under SP its input is all-gathered and the gradient
    reduce-scattered), and the vocabulary-parallel cross-entropy all-reduces three values
    per row (max, sum of exp, target logit)."""
    st, profile = ctx.st, ctx.profile
    t, sp = st.tp, st.sequence_parallel
    if t == 1:
        return 0.0, 0.0
    if chosen is not None:
        phase = {"forward": 0.0, "backward": 0.0}
        for kind, when, per_sequence in chosen.collectives:
            if when != HIDDEN:
                phase[when] += _collective_s(ctx, kind, per_sequence * st.micro_batch / st.cp)
        return phase["forward"], phase["backward"]
    out = st.rank_tokens * profile.hidden * profile.act_bytes
    if name == "embed":
        return _collective_s(ctx, "reduce_scatter" if sp else "all_reduce", out), 0.0
    if name == "head":
        loss = _collective_s(ctx, "all_reduce", st.rank_tokens * 4, 3)
        if sp:
            return _collective_s(ctx, "all_gather", out) + loss, _collective_s(ctx, "reduce_scatter", out)
        return loss, _collective_s(ctx, "all_reduce", out)
    kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    each = lc.tp_reduce_bytes / max(1, lc.tp_reduce_count)
    one = sum(
        lc.tp_reduce_count * a + b * lc.tp_reduce_bytes
        for a, b in (comm.coefficients(k, t, ctx.tp_link, each) for k in kinds)
    )
    return one, one


LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy")
"""ATen calls of a loss inside the captured graph (a model that computes its own, nanoGPT's
``forward(idx, targets)``): the graph's ops already price it."""


def _loss_s(ctx: _UnitContext, name: str, chosen: TPLayer | None) -> tuple[float, float]:
    """The loss's forward and backward seconds on the head's rank (``compute.loss_time_s``) over
    its micro_batch·seq·vocab logits, split as the head's weight is (vocabulary-parallel: ÷ tp,
    or the per-operator choice's share); 0 off the head or where the graph holds the loss."""
    lc = ctx.profile.layer_types[name]
    if name != "head" or any(c.key.split("#")[0].lstrip("_").startswith(LOSS_OPS) for c in lc.calls):
        return 0.0, 0.0
    st = ctx.st
    share = chosen.local_params / lc.params if chosen is not None and lc.params else 1 / st.tp
    return loss_time_s(st.rank_tokens * ctx.profile.vocab * share, ctx.device)


def _unit(ctx: _UnitContext, name: str, choice: str) -> Unit:
    """The unit of layer type ``name`` under recompute choice ``choice``."""
    profile, st, tp_layout = ctx.profile, ctx.st, ctx.tp_layout
    t, sp = st.tp, st.sequence_parallel
    lc = profile.layer_types[name]
    # the blocks are compiled, but a TP block with selective recompute compiles only its
    # checkpointed attention and runs the rest eagerly (``passes/compile.py``): priced eager
    compiled = st.compile == "block" and not (t > 1 and choice == "selective")
    got = measured_timing(ctx.measured, name, st, compiled)  # a compiled profile times the edges eager
    chosen = tp_layout.get(name) if tp_layout and t > 1 else None
    share = chosen.stream_share if chosen is not None else None
    compiled = compiled and name not in ("embed", "head")
    skew_s = expert_skew_s(lc, st, ctx.device)  # the busiest EP rank's extra expert rows
    fwd = skew_s + (
        got.forward_s
        if got
        else layer_forward_s(lc, ctx.device, st.dtype, tp=t, sp=sp, stream_share=share, compiled=compiled)
    )
    loss_fwd, loss_bwd = _loss_s(ctx, name, chosen) if got is None else (0.0, 0.0)  # measured: timed with it
    fwd += loss_fwd
    tp_fwd, tp_bwd = _tp_phases_s(ctx, name, lc, chosen)
    block = name not in ("embed", "head")
    cp_fwd, cp_bwd = ctx.cp_s if block else (0.0, 0.0)
    ep_fwd, ep_bwd = ep_forward_s(lc, st, ctx.ep_link), ep_backward_s(lc, st, ctx.ep_link)
    redo_s, act, redo_flops = _redone(ctx, lc, choice, fwd, stream_share=share, measured=got)
    whole_block = choice == "full" or st.policy(choice) is not None  # its forward's collectives again
    bwd = (
        got.backward_s + 2 * skew_s
        if got
        else layer_backward_s(lc, ctx.device, st.dtype, tp=t, fwd_s=fwd - loss_fwd) + loss_bwd
    )
    experts = lc.expert_params / st.ep  # E/ep experts whole on the rank (TP replicates them)
    dense = (lc.params - lc.expert_params) / t if chosen is None else chosen.local_params - lc.expert_params
    if name == "head" and st.head_rank != 0:  # its own copy of a tied embedding (÷ t: vocab-parallel)
        dense += lc.tied_params / t
    params = dense + experts
    tokens = st.rank_tokens
    kv = kv_extra_bytes(profile, st) if block else 0.0  # cp: the whole sequence's keys and values
    full = kv + mem.layer_activation_bytes(
        lc, tp=t, sp=sp, recompute="none", input_bytes=profile.input_bytes, expert_skew=skew(st)
    )
    return Unit(
        fwd_s=fwd,
        bwd_compute_s=bwd,
        wgrad_s=weight_grad_s(
            params, tokens=tokens, device=ctx.device, dtype=st.dtype, backward_s=bwd - loss_bwd
        ),
        recompute_s=redo_s,
        tp_s=(tp_fwd + ep_fwd + cp_fwd) * (2 if whole_block else 1) + tp_bwd + ep_bwd + cp_bwd,
        ep_s=ep_fwd * (2 if whole_block else 1) + ep_bwd,
        expert_params=experts if st.ep > 1 else 0.0,
        act_bytes=act + (kv if choice == "none" else 0.0),
        deferred_bytes=mem.deferred_grad_bytes(lc, tp=t, sp=sp) + full - act,  # + what I rebuilt
        act_full_bytes=full,
        params=params,
        fwd_flops=float(lc.fwd_flops),
        recompute_flops=redo_flops,
    )


def _redone(
    ctx: _UnitContext,
    lc: LayerCost,
    choice: str,
    fwd_s: float,
    *,
    stream_share: float | None,
    measured: LayerTiming | None,
) -> tuple[float, float, float]:
    """(recompute seconds, activation bytes kept, recompute FLOPs) of one layer per micro-batch.

    none, selective, full: ``memory.layer_activation_bytes``; selective redoes the attention
    core's FLOPs, full the forward. A per-operator policy: ``cost_models.recompute``, its
    recompute time a share of a measured forward where the cluster has one (the roofline's
    share of the calls it redoes), its kept bytes as measured where the profile has them."""
    st, input_bytes = ctx.st, ctx.profile.input_bytes
    t, sp = st.tp, st.sequence_parallel
    policy = st.policy(choice)
    if policy is None:
        flops = {"none": 0.0, "selective": float(lc.quadratic_flops), "full": float(lc.fwd_flops)}[choice]
        act = mem.layer_activation_bytes(
            lc, tp=t, sp=sp, recompute=choice, input_bytes=input_bytes, expert_skew=skew(st)
        )
        return (fwd_s if choice == "full" else flops / t / ctx.rate), act, flops
    return rc.policy_costs(
        lc,
        frozenset(policy.keep),
        ctx.device,
        st.dtype,
        tp=t,
        sp=sp,
        stream_share=stream_share if stream_share is not None else (1 / t if sp else 1.0),
        input_bytes=input_bytes,
        measured_fwd_s=fwd_s if measured else None,
        measured_bytes=dict(measured.call_bytes) if measured else None,
    )


def _bubble_rounds(st: Strategy, u: Unit) -> float:
    """``pipeline.bubble_rounds`` at a block's F (forward and its TP half), W and B (the rest)."""
    fwd = u.fwd_s + u.tp_s / 2
    return bubble_rounds(st, fwd_s=fwd, bwd_input_s=u.time_s - fwd - u.wgrad_s, wgrad_s=u.wgrad_s)


def build_terms(
    profile: ModelProfile,
    cluster: Cluster,
    st: Strategy,
    *,
    reserve_bytes: float | None = None,
    units: Units | None = None,
    tp_layout: TPLayout | None = None,
) -> Terms:
    """The coefficients for ``st``'s outer knobs (its layout is ignored)."""
    t = st.tp
    tp_link = comm.group_link(cluster, st.dims.axis("tp"))
    blocks, embed, head = units or layer_units(profile, cluster, st, tp_layout)
    block_type = profile.layers[1]
    p, v, m = st.pp, st.virtual_stages, st.micro_batches
    p2p_bytes = st.rank_tokens * profile.hidden * profile.act_bytes / t  # scatter/gather: ÷t
    dp_link = comm.group_link(cluster, st.dims.axis("dp_cp"))  # the ranks reducing gradients
    rank_params = (profile.blocks * blocks["none"].params + embed.params + head.params) / p  # DDP: p = 1
    ratio = blocks["none"].deferred_bytes / max(blocks["none"].act_bytes, 1.0)  # a block's G / A
    held = [
        mem.deferred_stage_copies(st.schedule, stage=r, pp=p, micro_batches=m, virtual=v, ratio=ratio)
        for r in range(p)
    ]
    return Terms(
        strategy=st,
        block=blocks,
        embed=embed,
        head=head,
        block_type=block_type,
        p2p_s=p2p_s(profile, cluster, st),
        inflight=tuple(a for a, _ in held),
        deferred=tuple(d for _, d in held),
        bubble_rounds=_bubble_rounds(st, blocks["none"]),
        state_bytes_per_param=mem.state_bytes_per_param(st),
        weight_bytes=mem.STATE_BYTES[st.dtype][0],
        **dp_terms(profile, cluster, st, blocks["none"].params, rank_params),
        opt_s_per_param=optimizer_s_per_param(cluster, st) / (st.dp_shard if st.zero >= 1 else 1)
        + compress_s_per_param(cluster, st),
        loss_bytes=mem.loss_bytes(micro_batch=st.micro_batch, seq=st.seq // st.cp, vocab=profile.vocab, tp=t),
        buffers=mem.comm_buffer_bytes(
            st,
            block_params=blocks["none"].params,
            edge_params=(embed.params, head.params),
            p2p_bytes=p2p_bytes,
        ),
        reserve_bytes=reserve_bytes if reserve_bytes is not None else _default_reserve_bytes(cluster.device),
        dp_crosses_nodes=dp_link.crosses_nodes and st.dims.dp_cp > 1,
        tp_crosses_nodes=tp_link.crosses_nodes,
        **expert_factors(cluster, st),
    )


def p2p_s(profile: ModelProfile, cluster: Cluster, st: Strategy) -> float:
    """A pipeline rank's sends per micro-batch on ``cluster``'s pipeline link: 2v activations or
    gradients of b·s/cp tokens × hidden, split over the t TP ranks (scatter/gather); 0 at pp 1."""
    if st.pp == 1:
        return 0.0
    size = st.rank_tokens * profile.hidden * profile.act_bytes / st.tp
    return 2 * st.virtual_stages * comm.p2p_time_s(size, comm.group_link(cluster, st.dims.axis("pp")))


def _default_reserve_bytes(device: DeviceSpec) -> float:
    """Memory kept back per GPU by default: the CUDA context plus a share for fragmentation."""
    return CUDA_CONTEXT_BYTES + FRAGMENTATION * device.memory_bytes
