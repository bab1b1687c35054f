"""Gradient compression on the data-parallel all-reduce: what DDP's comm hooks send, the time
their kernels take on the compute stream, and what they keep in memory.

bf16 reduction (``Strategy.grad_reduce``) halves the bytes of every gradient collective; its
DDP hook casts each bucket (``DDP_COMPRESS_BYTES_PER_PARAM``). int8 reduction (DDP only,
``runtime.quantized``) all-gathers 8-bit codes with a minimum and scale per chunk of 512: about
a quarter of fp32's bytes from each rank, but an all-gather, whose bytes grow with the ranks.
PowerSGD at rank r (Vogels,
Karimireddy and Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", Algorithm 1; torch ``ddp_comm_hooks/powerSGD_hook.py``) views each gradient
matrix as n × m and all-reduces P = M·Q (n × r), then Q = Mᵀ·P (m × r) after orthogonalising
P, and rebuilds M ≈ P·Qᵀ; vectors (biases, norms) travel whole. Error feedback adds what the
approximation dropped to the next step's gradient.
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.cost_models.profile import ModelProfile
from autopar.strategy import Strategy

INT8_CHUNK = 512
"""Gradient elements per int8 quantization chunk (``runtime.quantized.CHUNK``), each with an fp32
minimum and scale."""

GRAD_REDUCE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 8 / INT8_CHUNK}
"""Bytes per gradient element of the data-parallel reductions, by ``Strategy.grad_reduce`` (int8:
a code, and a chunk's minimum and scale shared by 512 elements)."""

INT8_HBM_BYTES_PER_PARAM = 45
INT8_HBM_BYTES_PER_PARAM_PER_RANK = 33
"""HBM bytes per gradient element of the int8 hook (``runtime.quantized``): quantizing reads the
chunk twice for its minimum and maximum (8), subtracts and divides (read 4, write 4), rounds and
clamps in place (16), casts to uint8 (read 4, write 1), and the mean's division (read 4, write
4): 45; then per rank, dequantizing its copy (read 1, write 4; multiply and add, read 4 + write
4 twice: 21) and adding it to the sum (read 8, write 4: 12): 33."""

DDP_COMPRESS_BYTES_PER_PARAM = 16
"""HBM bytes per gradient element of DDP's ``bf16_compress_hook`` (torch
``ddp_comm_hooks/default_hooks.py``): ``buffer.to(bfloat16)`` reads 4 and writes 2,
``div_(world_size)`` reads and writes 2 each, and the copy back into the fp32 bucket reads 2
and writes 4: 4 + 2 + 2 + 2 + 2 + 4 = 16."""

POWERSGD_HBM_BYTES_PER_PARAM = 44
"""HBM bytes per matrix gradient element of torch's ``powerSGD_hook`` (error feedback and warm
start on): adding the error (read 4 + 4, write 4), cloning the input to measure the new error
(read 4, write 4), M·Q and Mᵀ·P (read 4 each), writing P·Qᵀ back (4), and the new error =
input − approximation (read 4 + 4, write 4): 12 + 8 + 8 + 4 + 12 = 44."""

POWERSGD_FLOPS_PER_PARAM_PER_RANK = 6
"""FLOPs per matrix gradient element per unit of rank: three n × m × r products (M·Q, Mᵀ·P,
P·Qᵀ) at 2 FLOPs per multiply-add = 6·r·n·m (orthogonalising P, 2·n·r², is left out)."""

POWERSGD_LATENCY_FACTOR = 3
"""Collectives per bucket in PowerSGD's chain: the vectors' all-reduce, P's, then Q's (each
waits on the one before; DDP's fp32 hook issues one)."""

POWERSGD_STATE_BYTES_PER_PARAM = 4
"""Memory per gradient element PowerSGD keeps across steps: the fp32 error-feedback buffer (its
P and Q factors, r·(n + m) each, are left out: under 1% of n·m at r ≤ 4 for n, m ≥ 1024)."""


def wire_bytes_per_param(profile: ModelProfile, st: Strategy) -> float:
    """Bytes the DP reductions send per parameter of the model: ``GRAD_REDUCE_BYTES`` of the
    plan's dtype, or under PowerSGD at rank r, 4·(r·Σ(n + m) + vector params) / params, over
    the model's layers (``LayerCost.matrix_sides``, ``matrix_params``)."""
    if not st.powersgd_rank:
        return GRAD_REDUCE_BYTES[st.grad_reduce]
    layers = [profile.layer_types[name] for name in profile.layers]
    params = sum(c.params for c in layers)
    sides = sum(c.matrix_sides for c in layers)
    vectors = params - sum(c.matrix_params for c in layers)
    return 4 * (st.powersgd_rank * sides + vectors) / params


def compress_s_per_param(cluster: Cluster, st: Strategy) -> float:
    """Seconds per parameter per step that gradient compression takes on the compute stream (the
    hooks run in backward's stream, so nothing hides them): DDP's bf16 hook at
    ``DDP_COMPRESS_BYTES_PER_PARAM`` / HBM bandwidth; PowerSGD at the larger of its FLOPs at
    the fp32 matmul rate and ``POWERSGD_HBM_BYTES_PER_PARAM`` / HBM bandwidth (memory bound
    at small r); the int8 hook at ``INT8_HBM_BYTES_PER_PARAM`` + p · ``…_PER_RANK`` / HBM
    bandwidth. 0 without compression, and under FSDP2, whose ``reduce_dtype`` cast replaces the
    fp32 upcast it makes otherwise (bf16 parameters)."""
    hbm = cluster.device.hbm_bandwidth_bytes_per_s
    if st.powersgd_rank:
        flops = POWERSGD_FLOPS_PER_PARAM_PER_RANK * st.powersgd_rank
        return max(flops / cluster.device.achievable_flops("fp32"), POWERSGD_HBM_BYTES_PER_PARAM / hbm)
    if st.uses_ddp and st.grad_reduce == "bf16":
        return DDP_COMPRESS_BYTES_PER_PARAM / hbm
    if st.grad_reduce == "int8":
        return (INT8_HBM_BYTES_PER_PARAM + INT8_HBM_BYTES_PER_PARAM_PER_RANK * st.dims.dp_cp) / hbm
    return 0.0


__all__ = [
    "DDP_COMPRESS_BYTES_PER_PARAM",
    "GRAD_REDUCE_BYTES",
    "INT8_CHUNK",
    "INT8_HBM_BYTES_PER_PARAM",
    "INT8_HBM_BYTES_PER_PARAM_PER_RANK",
    "POWERSGD_HBM_BYTES_PER_PARAM",
    "POWERSGD_STATE_BYTES_PER_PARAM",
    "compress_s_per_param",
    "wire_bytes_per_param",
]
