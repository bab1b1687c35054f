"""Memory per GPU: model states under ZeRO, activations under TP/SP/recompute, in-flight micro-batches."""

from __future__ import annotations

from autopar.cost_models.buckets import ddp_bucket_bytes
from autopar.cost_models.compression import POWERSGD_STATE_BYTES_PER_PARAM
from autopar.cost_models.profile import LayerCost
from autopar.strategy import Strategy

# Bytes per parameter (Rajbhandari et al. SC'20, §3.1, mixed-precision Adam):
# 2 (16-bit weight) + 2 (16-bit gradient) + K = 12 (fp32 master weight, momentum, variance).
# fp32 training: 4 + 4 + 8 (momentum, variance; the weights are the master copy).
STATE_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}


def model_state_bytes(params: float, *, zero: int, dp: int, dtype: str) -> dict[str, float]:
    """Weights, gradients and optimizer states per GPU for ``params`` parameters on it.

    ZeRO (Rajbhandari et al. SC'20, Fig. 1) with N_d = dp: stage 0 keeps all
    (16Ψ); stage 1 shards optimizer states (4Ψ + 12Ψ/N_d); stage 2 also
    gradients (2Ψ + 14Ψ/N_d); stage 3 also weights (16Ψ/N_d).
    """
    w, g, k = STATE_BYTES[dtype]
    return {
        "weights": params * w / (dp if zero >= 3 else 1),
        "gradients": params * g / (dp if zero >= 2 else 1),
        "optimizer": params * k / (dp if zero >= 1 else 1),
    }


def layer_activation_bytes(
    layer: LayerCost, *, tp: int, sp: bool, recompute: str, input_bytes: int, expert_skew: float = 1.0
) -> float:
    """Bytes one layer keeps for backward per micro-batch on one GPU.

    Korthikanti et al. 2022: without parallelism sbh(34 + 5as/h) (Eq. 1); with
    TP the residual-stream part stays whole and the rest divides by t (Eq. 2:
    sbh(10 + 24/t + 5as/(ht))); with SP everything divides by t (Eq. 4);
    selective recompute drops the s² attention terms; full recompute keeps
    only the layer input, 2sbh (÷t with SP). Here the split comes from the
    captured graph's saved tensors, not from the formula. A MoE layer's expert rows
    (``LayerCost.saved_expert_bytes``) stay whole under TP and, under expert parallelism, the
    busiest rank receives ``expert_skew`` × an even share of them (``experts.skew``).
    """
    if recompute == "full":
        return input_bytes / (tp if sp else 1)
    stream = layer.saved_stream_bytes / (tp if sp else 1)
    quadratic = 0 if recompute == "selective" else layer.saved_quadratic_bytes / tp
    return stream + layer.saved_sharded_bytes / tp + quadratic + expert_skew * layer.saved_expert_bytes


def inflight_stage_copies(schedule: str, *, stage: int, pp: int, micro_batches: int, virtual: int) -> float:
    """How many micro-batches' worth of a stage's activations stage ``stage`` holds at peak.

    GPipe: all m (Huang et al. 2019). 1F1B: stage i holds min(p − i, m)
    (Narayanan et al. SC'21, §2.2.1). Interleaved 1F1B with v chunks: rank i
    runs min(2(p − i − 1) + (v − 1)·p, m·v − 1) warm-up chunk forwards before
    its first backward (Megatron-LM schedule), so it holds that many plus one
    chunks, each 1/v of the stage (exact when its chunks are equal; a rank's chunks differ
    by at most a block, ``Strategy.chunk_blocks``). Zero-bubble schedules keep a chunk's
    activations until its deferred weight gradient W: every rank holds p stages' worth under
    interleaved-zb and ZBV (Qi et al. 2024: ZB-H1 and ZB-V at 1F1B's peak p·M_B), p + ½ under
    DualPipeV (2p + 1 chunks); the peaks of torch's own orders (``pipeline.simulate_orders``,
    checked in the tests).
    """
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "1f1b":
        return float(min(pp - stage, micro_batches))
    if schedule in ("interleaved-zb", "zbv"):  # every rank, from the deferred W passes
        return float(pp)
    if schedule == "dualpipev":
        return pp + 0.5
    warmup = min(2 * (pp - stage - 1) + (virtual - 1) * pp, micro_batches * virtual - 1)
    return (warmup + 1) / virtual


def deferred_grad_bytes(layer: LayerCost, *, tp: int, sp: bool) -> float:
    """Bytes of one layer's weight-op output gradients per micro-batch on one GPU: what torch's
    split backward keeps from a chunk's input-gradient pass (I) to its weight-gradient pass (W)
    beyond the saved activations (``stage_backward_input`` keeps the gradient reaching each
    op that meets a parameter and an activation, ``param_groups``, for ``stage_backward_weight``).
    A GPT block: its two norms' and four linears' outputs, (1 + 1 + 3 + 1 + 4 + 1)·b·s·h
    elements; under TP the column-parallel ones ÷t, the row-parallel partial sums whole, the
    norms' ÷t with SP (``LayerCost.weight_out_bytes``)."""
    stream, whole, sharded = layer.weight_out_bytes
    return stream / (tp if sp else 1) + whole + sharded / tp


def deferred_stage_copies(
    schedule: str, *, stage: int, pp: int, micro_batches: int, virtual: int, ratio: float
) -> tuple[float, float]:
    """(activations, deferred gradients) of a stage that rank ``stage`` holds at its peak, each in
    micro-batches' worth of the stage, where one chunk's deferred gradients
    (``deferred_grad_bytes``) weigh ``ratio`` × its activations.

    A zero-bubble schedule keeps a chunk's deferred gradients from its I to its W; the first
    chunk's I computes nothing (torch runs its whole backward at W). In torch's orders
    (``pipeline.simulate_orders``, checked in the tests): interleaved-zb rank i peaks holding p
    stages' activations with i + 1 chunks past I (i on the first rank at one chunk per rank);
    ZBV peaks either at 2p chunks with one past I, or later on the V's far side at p + i chunks
    with 2i + 1 past I, whichever weighs more (exact from 2p micro-batches); DualPipeV's peak
    (2p + 1 chunks) has none past I. Every other schedule defers nothing
    (``inflight_stage_copies``)."""
    held = inflight_stage_copies(schedule, stage=stage, pp=pp, micro_batches=micro_batches, virtual=virtual)
    if schedule == "interleaved-zb":
        return held, (stage + 1 - (virtual == 1 and stage == 0)) / virtual
    if schedule == "zbv":
        return max((held, 0.5), ((pp + stage) / 2, stage + 0.5), key=lambda c: c[0] + ratio * c[1])
    return held, 0.0


PIPELINE_GRAD_BYTES = 4
"""Bytes per gradient element FSDP2 accumulates unsharded across a pipeline step (fp32)."""


FP32_SHARD_BYTES = 4
"""Bytes per parameter of FSDP2's sharded fp32 parameter, kept beside the gathered copy while the
weights stay gathered (ZeRO 0–2, or any stage under a pipeline). Mixed precision counts it in
``STATE_BYTES``' K (the master weight); fp32 training has no master apart from the weights."""


def rank_state_bytes(params: float, st: Strategy, *, shard: int | None = None) -> dict[str, float]:
    """Weights, gradients and optimizer states at the peak of a GPU holding ``params``.

    ``model_state_bytes`` (ZeRO), except FSDP2 under a pipeline (pp > 1):
    ``torch.distributed.pipelining`` runs every backward but the step's last with FSDP2's
    gradient sync and reshard-after-backward off (``_PipelineStageBase.backward_maybe_with_nosync``),
    so each GPU accumulates its stage's gradients unsharded, upcast to the fp32 reduce dtype
    (``FSDPParam.to_accumulated_grad_if_needed``: 4 B each), and keeps the gathered weights
    (w B each) from its first backward to the end of the step. A plan that runs on FSDP2 (every
    data-parallel plan but DDP's, ``Strategy.uses_ddp``) keeps, in fp32, the sharded weights
    beside the gathered ones (``FP32_SHARD_BYTES``; measured: a tiny Llama's ZeRO-2 rank,
    ``autopar dryrun``). FSDP2 shards a ZeRO-0 plan's optimizer states too; they are priced whole,
    as the published ZeRO-0 runs hold them (``benchmarks/published_runs.py``). PowerSGD adds its
    error feedback to the gradients' bytes. ``shard``: the ranks ZeRO shards over, if not
    ``Strategy.dp_shard`` (routed experts under expert parallelism: dp / ep).
    """
    dp = st.dp_shard if shard is None else shard  # HSDP: ÷ its group
    states = model_state_bytes(params, zero=st.zero, dp=dp, dtype=st.dtype)
    if st.pp > 1 and st.uses_fsdp:
        states["weights"] = params * STATE_BYTES[st.dtype][0]
        states["gradients"] = params * PIPELINE_GRAD_BYTES
    if st.uses_fsdp and st.dtype == "fp32" and (st.zero < 3 or st.pp > 1):
        states["weights"] += params * FP32_SHARD_BYTES / dp
    if st.powersgd_rank:  # its error-feedback buffer (compression.POWERSGD_STATE_BYTES_PER_PARAM)
        states["gradients"] += params * POWERSGD_STATE_BYTES_PER_PARAM
    return states


def state_bytes_per_param(st: Strategy, *, shard: int | None = None) -> float:
    """Weights + gradients + optimizer bytes per parameter on a GPU (``rank_state_bytes``)."""
    return sum(rank_state_bytes(1.0, st, shard=shard).values())


def comm_buffer_bytes(
    st: Strategy, *, block_params: float, edge_params: tuple[float, float], p2p_bytes: float
) -> tuple[float, ...]:
    """Communication buffers of each pipeline rank: two DDP buckets (ZeRO 0–1, ``bucket_mb``
    each), two pipeline send/receive buffers, the pipeline's per-micro-batch ones
    (``pipeline_buffer_bytes``), and under ZeRO-3 without a pipeline two gathered
    copies of the rank's biggest layer (a block's parameters on one GPU, or the embedding's on
    the first rank, the head's on the last)."""
    t, p = st.tp, st.pp
    w = STATE_BYTES[st.dtype][0]
    embed, head = edge_params
    ddp = st.uses_ddp  # every other data-parallel plan runs on FSDP2: no DDP buckets
    base_buffers = 2 * ddp_bucket_bytes(st) * ddp + 2 * p2p_bytes * t * (t > 1)
    gathered = st.zero == 3 and p == 1  # under a pipeline the weights stay gathered (rank_state_bytes)
    buffers = []
    for rank in range(p):
        biggest = max(block_params, embed if rank == 0 else 0.0, head if rank == st.head_rank else 0.0)
        pipe = pipeline_buffer_bytes(st, rank=rank, p2p_bytes=p2p_bytes)
        buffers.append(base_buffers + pipe + (2 * biggest * w if gathered else 0.0))
    return tuple(buffers)


def pipeline_buffer_bytes(st: Strategy, *, rank: int, p2p_bytes: float) -> float:
    """Bytes of pipeline rank ``rank``'s receive buffers, held through a step.

    torch's stages allocate a receive buffer per micro-batch up front, for the activations of
    every chunk but the first and the gradients of every chunk but the last
    (``_prepare_forward_infra``, ``_setup_backward_recv_info``): m · (chunks' inputs + outputs)
    buffers of ``p2p_bytes``. Measured by ``autopar dryrun``: 128 buffers of one micro-batch's
    activations on the middle rank of PP4 × v2 at m = 32, 32 at m = 8."""
    if st.pp == 1:
        return 0.0
    last = st.pp * st.virtual_stages - 1
    return st.micro_batches * sum((c != 0) + (c != last) for c in st.rank_chunks(rank)) * p2p_bytes


LOSS_BYTES_PER_LOGIT = 12
"""Peak bytes per logit while the loss runs: three fp32 logit-sized buffers (``loss_bytes``)."""


def loss_bytes(*, micro_batch: int, seq: int, vocab: int, tp: int) -> float:
    """Bytes the language-model loss adds to the peak at the end of the forward, per GPU.

    The cross-entropy computes its softmax in fp32 whatever the logits' dtype
    (``runtime.loss.lm_loss``, and torchtitan's ``cross_entropy(pred.float(), …)``).
    With N = micro_batch·seq·vocab/tp logits on the GPU (÷ tp: the head's output and
    the loss are split over the vocabulary), the forward holds the logits (2N bytes in
    bf16), their fp32 copy (4N) and the log-softmax (4N, saved for backward) = 10N;
    the backward of the loss holds the saved log-softmax, its gradient and the logits'
    gradient, all fp32 = 12N, the larger of the two. Measured: 12.0 bytes per predicted
    token's logit for bf16 and fp32 logits (``measure.saved.peak_bytes`` over
    ``lm_loss`` forward and backward, tests/cost_models/test_memory.py).
    """
    return micro_batch * seq * vocab / tp * LOSS_BYTES_PER_LOGIT
