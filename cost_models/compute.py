"""Compute time of a layer: per-op roofline (a measured profile, where the cluster has one,
replaces it in ``terms.layer_units``).

Roofline (Williams et al. 2009): a kernel takes
max(FLOPs / achievable FLOP/s, bytes / HBM bandwidth), where achievable
FLOP/s = peak(dtype) × matmul_efficiency of the device. Under tensor
parallelism t every op's FLOPs and its sharded tensors' bytes divide by t;
ops on the residual stream (norms, residual adds) are replicated unless
sequence parallelism splits them too (Korthikanti et al. 2022, §4.2.2).
Backward ≈ 2× forward (Narayanan et al. SC'21, §3.5) unless measured, but for fused
attention kernels: they run at the device's attention efficiency (``DeviceSpec``), and their
backward recomputes the scores, 5 matmuls to the forward's 2 (``FLASH_BACKWARD_RATIO``).
"""

from __future__ import annotations

from autopar.cluster import Cluster, DeviceSpec
from autopar.cost_models.profile import LayerCost
from autopar.measurements import ComputeProfile, LayerTiming
from autopar.strategy import Strategy

FLASH_BACKWARD_RATIO = 2.5
"""Backward ÷ forward FLOPs of a flash attention kernel: "2 matmuls in the forward pass and 5
matmuls in the backward pass, due to recomputation" (Dao 2023, FlashAttention-2, §4.1)."""
ADAM_BYTES_PER_PARAM = 30
"""Adam step traffic: read fp32 master, m, v, grad (16 B); write master, m, v, 16-bit weight (14 B)."""


LOSS_BYTES_PER_LOGIT = (22, 30)
"""HBM bytes the language-model loss moves per logit, forward and backward, as
``runtime.loss.lm_loss`` runs it in eager kernels, each reading and writing its tensors once
(log_softmax reads its input twice: a max/sum pass, then the output pass). Forward: the shifted
slice made contiguous (read 2 + write 2 in bf16), the fp32 upcast (2 + 4), log_softmax (8 + 4),
NLL (one value per row) = 22. Backward: NLL's dense gradient (write 4), log_softmax's (read the
gradient and the output, write 4 + 4 + 4), the upcast's (4 + 2), the slice's into a zeroed
full-size gradient (2 + 2 + 2) + NLL zeroing (4) = 30."""


def loss_time_s(logits: float, device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of the loss over ``logits`` logits on one GPU: memory-bound,
    ``LOSS_BYTES_PER_LOGIT`` at the device's HBM bandwidth."""
    fwd, bwd = LOSS_BYTES_PER_LOGIT
    bw = device.hbm_bandwidth_bytes_per_s
    return logits * fwd / bw, logits * bwd / bw


def roofline_time_s(flops: float, mem_bytes: float, *, flops_per_s: float, bytes_per_s: float) -> float:
    """max(flops / flops_per_s, mem_bytes / bytes_per_s)."""
    return max(flops / flops_per_s, mem_bytes / bytes_per_s)


def layer_forward_s(
    layer: LayerCost,
    device: DeviceSpec,
    dtype: str,
    *,
    tp: int,
    sp: bool,
    stream_share: float | None = None,
    compiled: bool = False,
) -> float:
    """Forward seconds of one layer on one GPU: Σ over its kernels of the roofline time (FLOPs as
    the kernels execute them: ``OpCost.kernel_flops``). Kernels
    on the residual stream move all their bytes on every rank, or 1/tp of them under sequence
    parallelism; ``stream_share``: the share a per-operator TP choice gives them instead.
    ``compiled``: the kernels ``torch.compile`` runs (``LayerCost.fused_ops``: each chain of
    elementwise and reduction ops one kernel), else the eager ones. A routed experts' grouped
    matmul (``OpCost.expert``) stays whole on every TP rank (replicated: no TP rule splits it)."""
    bw = device.hbm_bandwidth_bytes_per_s
    share = stream_share if stream_share is not None else (1 / tp if sp else 1.0)
    total = 0.0
    for op in layer.fused_ops if compiled and layer.fused_ops else layer.ops:
        rate = device.achievable_flops(dtype, attention=op.attention)
        split = 1 if op.expert else tp  # no TP rule splits a grouped matmul: every TP rank runs it whole
        total += max(op.kernel_flops / split / rate, op.mem_bytes * (share if op.stream else 1 / split) / bw)
    return total


def attention_forward_s(layer: LayerCost, device: DeviceSpec, dtype: str, *, tp: int) -> float:
    """Forward seconds of the layer's fused attention kernels on one GPU (heads ÷ tp)."""
    rate = device.achievable_flops(dtype, attention=True)
    return sum(op.kernel_flops / tp / rate for op in layer.ops if op.attention)


def expert_forward_s(layer: LayerCost, device: DeviceSpec, dtype: str) -> float:
    """Forward seconds of the layer's routed experts' grouped matmuls on one GPU (roofline, at
    an even share of rows: ``OpCost.expert``)."""
    rate = device.achievable_flops(dtype)
    bw = device.hbm_bandwidth_bytes_per_s
    return sum(max(op.kernel_flops / rate, op.mem_bytes / bw) for op in layer.ops if op.expert)


def layer_backward_s(layer: LayerCost, device: DeviceSpec, dtype: str, *, tp: int, fwd_s: float) -> float:
    """Backward seconds of one layer on one GPU: 2× its forward ``fwd_s``, and for each fused
    attention kernel (FLASH_BACKWARD_RATIO − 2) × its forward more: 2·F + 0.5·A."""
    return 2 * fwd_s + (FLASH_BACKWARD_RATIO - 2) * attention_forward_s(layer, device, dtype, tp=tp)


def weight_grad_s(params: float, *, tokens: int, device: DeviceSpec, dtype: str, backward_s: float) -> float:
    """The weight-gradient part W of a layer's backward on one GPU: its matmuls' weight
    gradients, dW = dYᵀ·X, 2 FLOPs per parameter per token (the same FLOPs as their forward; the
    input gradient B is the rest: Qi et al. 2024 §2), at the device's matmul rate, at most half
    of ``backward_s`` (a measured or roofline backward: what has no weights splits to B)."""
    return min(2 * tokens * params / device.achievable_flops(dtype), backward_s / 2)


def optimizer_s_per_param(cluster: Cluster, st: Strategy) -> float:
    """Optimizer seconds per parameter a GPU updates: measured where the cluster has a compute
    profile for this dtype (on DTensor parameters when the runtime makes them DTensors: under
    TP, and under FSDP2 for ZeRO ≥ 2 or any data-parallel pipeline), else memory-bound Adam,
    ADAM_BYTES_PER_PARAM / HBM bandwidth."""
    measured = cluster.compute_profile
    if measured is None or measured.dtype != st.dtype:
        return ADAM_BYTES_PER_PARAM / cluster.device.hbm_bandwidth_bytes_per_s
    dtensor = st.tp > 1 or (st.dims.dp_cp > 1 and (st.zero >= 2 or st.pp > 1))
    if dtensor and measured.optimizer_dtensor_s_per_param is not None:
        return measured.optimizer_dtensor_s_per_param
    return measured.optimizer_s_per_param


def measured_timing(
    measured: ComputeProfile | None, name: str, st: Strategy, compiled: bool
) -> LayerTiming | None:
    """A measured compute profile's timing of layer type ``name`` at ``st``'s micro-batch, seq,
    TP width, sequence parallelism and dtype, compiled or eager, if it has one."""
    if measured is None or st.cp > 1:  # timed on whole sequences: not a cp rank's share
        return None
    return measured.timing(
        name,
        micro_batch=st.micro_batch,
        seq=st.seq,
        tp=st.tp,
        sp=st.sequence_parallel,
        dtype=st.dtype,
        compiled=compiled,
    )
