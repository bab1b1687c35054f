"""Step time, throughput and memory of one strategy: the cost model the planner calls.

Step time (Narayanan et al. SC'21, Eq. 1 and §2.2):

    T = (m + (p − 1)/v) · (t_f + t_b + 2v·t_p2p)  +  exposed DP/ZeRO comm  +  optimizer

with t_f, t_b the slowest stage's per-micro-batch forward and backward
(compute + tensor-parallel collectives, which are on the critical path and
fully exposed; full recomputation adds a forward and its collectives to
t_b). Overlap rule for data parallelism: the gradient reduction of a stage
overlaps the backward of its last micro-batch except that of its first
layer (the last gradients produced); ZeRO-1/2's parameter all-gather after
the optimizer step is exposed; ZeRO-3's per-micro-batch parameter
all-gathers overlap the forward/backward compute they prefetch for and only
their excess is exposed. The optimizer is memory-bound: Adam reads and
writes ~30 bytes per parameter it owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models import comm
from autopar.cost_models.compute import MeasuredCompute, layer_forward_s
from autopar.cost_models.memory import (
    inflight_stage_copies,
    layer_activation_bytes,
    model_state_bytes,
)
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.strategy import Strategy, check_strategy

ADAM_BYTES_PER_PARAM = 30
"""Adam step traffic: read fp32 master, m, v, grad (16 B); write master, m, v, 16-bit weight (14 B)."""
GRAD_REDUCE_BYTES = {"bf16": 4, "fp16": 2, "fp32": 4}
"""Bytes per gradient element in the DP reduction (bf16 training reduces in fp32)."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP/FSDP gradient bucket (PyTorch default 25 MiB); two are in flight."""
CUDA_CONTEXT_BYTES = 2**30
"""Memory the CUDA context and NCCL take before any tensor (~1 GiB)."""
FRAGMENTATION = 0.05
"""Share of device memory kept back for allocator fragmentation."""


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Peak memory of one pipeline rank, by cause (bytes)."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    loss: float
    comm_buffers: float
    reserve: float

    @property
    def peak_bytes(self) -> float:
        """Sum of the terms."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.loss
            + self.comm_buffers
            + self.reserve
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "stage": self.stage,
            "peak_bytes": self.peak_bytes,
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "loss": self.loss,
            "comm_buffers": self.comm_buffers,
            "reserve": self.reserve,
        }


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted step time, throughput and memory of one strategy."""

    strategy: Strategy
    step_time_s: float
    breakdown_s: dict[str, float]
    tokens_per_s: float
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    memory: tuple[StageMemory, ...]
    memory_capacity_bytes: float
    stage_layers: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        """Every stage's peak fits in device memory."""
        return all(m.peak_bytes <= self.memory_capacity_bytes for m in self.memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.to_dict(),
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "fits": self.fits,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "breakdown_s": self.breakdown_s,
            "memory": [m.to_dict() for m in self.memory],
            "stage_layers": [list(s) for s in self.stage_layers],
            "notes": list(self.notes),
        }


def split_layers(layers: tuple[str, ...], chunks: int) -> list[list[int]]:
    """Contiguous layer indices per chunk: blocks split evenly (extras to the middle chunks),
    embedding with the first chunk, head with the last."""
    blocks = list(range(1, len(layers) - 1))
    base, extra = divmod(len(blocks), chunks)
    order = sorted(range(chunks), key=lambda c: abs(c - (chunks - 1) / 2))[:extra]
    out, start = [], 0
    for c in range(chunks):
        n = base + (1 if c in order else 0)
        out.append(blocks[start : start + n])
        start += n
    out[0].insert(0, 0)
    out[-1].append(len(layers) - 1)
    return out


def estimate(
    profile: ModelProfile,
    cluster: Cluster,
    strategy: Strategy,
    *,
    measured: MeasuredCompute | None = None,
    reserve_bytes: float | None = None,
) -> Estimate:
    """Price ``strategy`` for ``profile`` on ``cluster`` (see module doc for the model)."""
    st = strategy
    check_strategy(st, world_size=cluster.world_size, blocks=profile.blocks, heads=profile.heads)
    if st.seq != profile.seq or st.micro_batch != profile.micro_batch:
        raise ValueError(
            f"profile captured at micro-batch {profile.micro_batch}, seq {profile.seq}; "
            f"strategy has {st.micro_batch}, {st.seq}"
        )
    device, t, p, v, m = cluster.device, st.tp, st.pp, st.virtual_stages, st.micro_batches
    notes: list[str] = []

    # -- per layer type: forward compute, TP collectives, activations (one micro-batch) --
    tp_link = comm.group_link(cluster, size=t, stride=1)
    if tp_link.crosses_nodes:
        notes.append(f"tp={t} spans nodes: its collectives use the inter-node network")
    fwd_s, tp_s, act, recompute_s = {}, {}, {}, {}
    for name, lc in profile.layer_types.items():
        got = (
            measured.forward_s(name, micro_batch=st.micro_batch, seq=st.seq, tp=t, sp=st.sequence_parallel)
            if measured
            else None
        )
        fwd_s[name] = (
            got if got is not None else layer_forward_s(lc, device, st.dtype, tp=t, sp=st.sequence_parallel)
        )
        if measured is not None and got is None:
            notes.append(f"{name}: not in the measured profile, roofline used")
        tp_s[name] = comm.allreduce_time_s(lc.tp_reduce_bytes, t, tp_link)
        act[name] = layer_activation_bytes(
            lc,
            tp=t,
            sp=st.sequence_parallel,
            recompute=st.recompute,
            input_bytes=profile.input_bytes,
        )
        if st.recompute == "full" and name not in ("embed", "head"):
            recompute_s[name] = fwd_s[name]
        elif st.recompute == "selective":
            recompute_s[name] = lc.quadratic_flops / t / device.achievable_flops(st.dtype)
        else:
            recompute_s[name] = 0.0

    # -- stages: chunk c runs on rank c % p --
    chunks = split_layers(profile.layers, p * v)
    ranks: list[list[int]] = [[] for _ in range(p)]
    for c, idx in enumerate(chunks):
        ranks[c % p].extend(idx)
    types = profile.layers

    def total(values: dict[str, float], idx: list[int]) -> float:
        return sum(values[types[i]] for i in idx)

    per_rank = []
    for idx in ranks:
        f = total(fwd_s, idx)
        tpc = total(tp_s, idx)
        rc = total(recompute_s, idx)
        rc_tp = tpc if st.recompute == "full" else 0.0
        per_rank.append({"fwd": f, "bwd": 2 * f, "recompute": rc, "tp": 2 * tpc + rc_tp})
    slow = max(range(p), key=lambda r: sum(per_rank[r].values()))
    r = per_rank[slow]
    p2p_bytes = st.micro_batch * st.seq * profile.hidden * profile.act_bytes / t
    pp_link = comm.group_link(cluster, size=p, stride=t * st.dp)
    p2p_s = 2 * v * comm.p2p_time_s(p2p_bytes, pp_link) if p > 1 else 0.0
    t_mb = r["fwd"] + r["bwd"] + r["recompute"] + r["tp"] + p2p_s
    bubble = (p - 1) / v * t_mb

    # -- data parallel / ZeRO (per rank; the slowest rank's exposure counts) --
    dp_link = comm.group_link(cluster, size=st.dp, stride=t)
    dp_exposed, opt_s = 0.0, 0.0
    rank_params = [sum(profile.layer_types[types[i]].params for i in idx) / t for idx in ranks]
    for k, idx in enumerate(ranks):
        params, n_layers = rank_params[k], max(len(idx), 1)
        grad_bytes = params * GRAD_REDUCE_BYTES[st.dtype]
        weight_bytes = params * (4 if st.dtype == "fp32" else 2)
        work = per_rank[k]
        bwd_total = work["bwd"] + work["recompute"]
        overlap = bwd_total * (n_layers - 1) / n_layers  # all but the first layer's backward
        if st.zero == 0:  # one gradient all-reduce after the last micro-batch
            exposed = max(0.0, comm.allreduce_time_s(grad_bytes, st.dp, dp_link) - overlap)
        elif st.zero == 1:  # reduce-scatter once; all-gather the updated weights (exposed)
            exposed = max(0.0, comm.reduce_scatter_time_s(grad_bytes, st.dp, dp_link) - overlap)
            exposed += comm.allgather_time_s(weight_bytes, st.dp, dp_link)
        else:
            # Gradients are sharded, so every micro-batch's are reduce-scattered (layer by
            # layer, each paying the ring latency); ZeRO-3 also gathers each layer's weights
            # for forward, backward and any recomputed forward.
            lat = n_layers * (st.dp - 1) * dp_link.latency_s
            rs = comm.reduce_scatter_time_s(grad_bytes, st.dp, dp_link) + lat
            if st.zero == 2:
                exposed = m * max(0.0, rs - overlap) + comm.allgather_time_s(weight_bytes, st.dp, dp_link)
            else:
                ag = comm.allgather_time_s(weight_bytes, st.dp, dp_link) + lat
                bwd_gathers = 2 if st.recompute == "full" else 1
                exposed = m * (max(0.0, ag - work["fwd"]) + max(0.0, bwd_gathers * ag + rs - bwd_total))
        dp_exposed = max(dp_exposed, exposed)
        owned = params / (st.dp if st.zero >= 1 else 1)
        opt_s = max(opt_s, owned * ADAM_BYTES_PER_PARAM / device.hbm_bandwidth_bytes_per_s)
    if dp_link.crosses_nodes and st.dp > 1:
        notes.append(f"dp={st.dp} spans nodes ({dp_link.bandwidth_bytes_per_s / 1e9:.0f} GB/s per GPU)")

    breakdown = {
        "compute": m * (r["fwd"] + r["bwd"]),
        "recompute": m * r["recompute"],
        "tp_comm": m * r["tp"],
        "p2p": m * p2p_s,
        "bubble": bubble,
        "dp_comm": dp_exposed,
        "optimizer": opt_s,
    }
    step = sum(breakdown.values())

    # -- memory per rank --
    reserve = (
        reserve_bytes
        if reserve_bytes is not None
        else CUDA_CONTEXT_BYTES + FRAGMENTATION * device.memory_bytes
    )
    mem = []
    for k, idx in enumerate(ranks):
        states = model_state_bytes(rank_params[k], zero=st.zero, dp=st.dp, dtype=st.dtype)
        copies = inflight_stage_copies(st.schedule, stage=k, pp=p, micro_batches=m, virtual=v)
        activations = copies * sum(act[types[i]] for i in idx)
        if st.recompute == "full":  # one layer rematerialised during its backward
            activations += max(
                layer_activation_bytes(
                    profile.layer_types[types[i]],
                    tp=t,
                    sp=st.sequence_parallel,
                    recompute="none",
                    input_bytes=profile.input_bytes,
                )
                for i in idx
            )
        last = len(types) - 1 in idx
        loss = st.micro_batch * st.seq * profile.vocab / t * 8 if last else 0.0  # fp32 logits + grad
        buffers = 2 * DDP_BUCKET_BYTES * (st.dp > 1) + 2 * p2p_bytes * t * (t > 1)
        if st.zero == 3:
            biggest = max(profile.layer_types[types[i]].params for i in idx) / t
            buffers += 2 * biggest * (4 if st.dtype == "fp32" else 2)
        mem.append(
            StageMemory(
                stage=k,
                **states,
                activations=activations,
                loss=loss,
                comm_buffers=buffers,
                reserve=reserve,
            )
        )

    tokens = st.global_batch * st.seq
    model_flops = profile.step_model_flops_per_sequence * st.global_batch
    recompute_flops = 0.0
    for i in range(len(types)):
        lc = profile.layer_types[types[i]]
        if st.recompute == "full" and types[i] not in ("embed", "head"):
            recompute_flops += lc.fwd_flops
        elif st.recompute == "selective":
            recompute_flops += lc.quadratic_flops
    hardware_flops = model_flops + recompute_flops * st.global_batch / profile.micro_batch
    world = st.world_size
    peak = device.peak_flops.get(st.dtype, device.peak_flops["bf16"])
    tflops = model_flops / step / world / 1e12
    hw_tflops = hardware_flops / step / world / 1e12
    return Estimate(
        strategy=st,
        step_time_s=step,
        breakdown_s=breakdown,
        tokens_per_s=tokens / step,
        tflops_per_gpu=tflops,
        hardware_tflops_per_gpu=hw_tflops,
        mfu=tflops * 1e12 / peak,
        hfu=hw_tflops * 1e12 / peak,
        memory=tuple(mem),
        memory_capacity_bytes=float(device.memory_bytes),
        stage_layers=tuple(tuple(profile.layer_names[i] for i in idx) for idx in ranks),
        notes=tuple(notes),
    )
