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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import Cluster
from autopar.cost_models import comm
from autopar.cost_models.bands import Band, band
from autopar.cost_models.compute import measured_timing
from autopar.cost_models.dp_overlap import dp_exposed_s
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.rank_load import RankLoad, optimizer_s, rank_load, rank_memory_terms
from autopar.cost_models.terms import Terms, TPLayout, build_terms
from autopar.cost_models.timeline import StageTime, stage_times
from autopar.gpus import arch_of
from autopar.strategy import Strategy, check_strategy


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
    stage_times: tuple[StageTime, ...] = field(default=())
    """Each pipeline rank's forward, backward, recompute, TP, DP and optimizer terms
    (``timeline.stage_times``): what ``autopar report`` lays out as the step's timeline."""
    p2p_hop_s: float = 0.0
    """One activation (or gradient) send between neighbouring pipeline ranks."""
    compute_basis: str = ""
    """What compute was priced with: the device's peak × matmul efficiency (a preset's datasheet or
    stated assumption, or the user's YAML), or the cluster's measured compute profile."""
    recompute_choices: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per recompute choice (``Strategy.choices``), what one block costs per micro-batch on one
    GPU: ``act_bytes`` kept for backward and ``recompute_s`` redone in backward."""
    band: Band | None = None
    """How far predictions of this regime have been from measured runs they never saw
    (``bands.band``); None where the cluster's measured compute profile prices the step."""
    stage_capacity_bytes: tuple[float, ...] = ()
    """Each pipeline rank's device memory where ranks differ (a mixed cluster: the smallest of
    its replicas'); empty: ``memory_capacity_bytes`` on every rank."""
    groups: tuple[dict[str, Any], ...] = ()
    """A mixed cluster's node groups: what each runs and how long its devices wait
    (``cost_models.mixed.group_summaries``)."""

    @property
    def fits(self) -> bool:
        """Every stage's peak fits in its device's memory."""
        caps = self.stage_capacity_bytes or (self.memory_capacity_bytes,) * len(self.memory)
        return all(m.peak_bytes <= c for m, c in zip(self.memory, caps, strict=True))

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
            "compute_basis": self.compute_basis,
            "stage_times": [t.to_dict() for t in self.stage_times],
            "p2p_hop_s": self.p2p_hop_s,
            "recompute_choices": {k: dict(v) for k, v in self.recompute_choices.items()},
            "band": self.band.to_dict() if self.band is not None else None,
            **(
                {"stage_capacity_bytes": list(self.stage_capacity_bytes)} if self.stage_capacity_bytes else {}
            ),
            **({"groups": [dict(g) for g in self.groups]} if self.groups else {}),
        }


def estimate(
    profile: ModelProfile,
    cluster: Cluster,
    strategy: Strategy,
    *,
    reserve_bytes: float | None = None,
    tp_layout: TPLayout | None = None,
) -> Estimate:
    """Price ``strategy`` for ``profile`` on ``cluster`` (see module doc for the model)."""
    st = strategy
    _check_inputs(profile, cluster, st)
    terms = build_terms(profile, cluster, st, reserve_bytes=reserve_bytes, tp_layout=tp_layout)
    notes = _topology_notes(terms, cluster, st)
    notes.extend(measurement_notes(profile, cluster, st))

    counts = st.blocks_per_rank(profile.blocks)
    loads = [rank_load(terms, k, c) for k, c in enumerate(counts)]
    breakdown = breakdown_s([terms] * st.pp, loads, p2p_s=terms.p2p_s)
    step = sum(breakdown.values())
    mem = tuple(StageMemory(stage=k, **rank_memory_terms(terms, k, load)) for k, load in enumerate(loads))

    tokens = st.global_batch * st.seq
    model_flops, hardware_flops = step_flops(profile, terms, st, counts)
    world = st.world_size
    peak = cluster.device.peak_flops.get(st.dtype, cluster.device.peak_flops["bf16"])
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
        memory=mem,
        memory_capacity_bytes=float(cluster.device.memory_bytes),
        stage_layers=tuple(tuple(names) for names in stage_layer_names(profile, st)),
        notes=tuple(notes),
        compute_basis=compute_basis(cluster, st.dtype),
        stage_times=stage_times(terms, counts, loads),
        p2p_hop_s=terms.p2p_s / (2 * st.virtual_stages),  # p2p_s: 2v sends per micro-batch
        recompute_choices={
            r: {"act_bytes": u.act_bytes, "recompute_s": u.recompute_s} for r, u in terms.block.items()
        },
        band=band(st, cluster.device.name) if cluster.compute_profile is None else None,
    )


def compute_basis(cluster: Cluster, dtype: str) -> str:
    """One line: the peak and efficiency the roofline prices ``dtype`` compute with, and where
    they come from; or that measured layer timings take their place."""
    dev = cluster.device
    peak = dev.peak_flops.get(dtype, dev.peak_flops["bf16"])
    attention = (
        f" (fused attention × {dev.attention_efficiency:.2f} = "
        f"{dev.achievable_flops(dtype, attention=True) / 1e12:,.0f} TFLOP/s)"
        if dev.attention_efficiency is not None
        else ""
    )
    roofline = (
        f"{peak / 1e12:,.0f} TFLOP/s {dtype} peak × matmul efficiency {dev.matmul_efficiency:.2f} = "
        f"{dev.achievable_flops(dtype) / 1e12:,.0f} TFLOP/s{attention}, "
        f"HBM {dev.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s ({dev.name}, cluster {cluster.name})"
    )
    if cluster.compute_profile is not None:
        return f"measured layer timings (autopar profile); roofline where missing: {roofline}"
    return roofline


def _check_inputs(profile: ModelProfile, cluster: Cluster, st: Strategy) -> None:
    """Raise if ``st`` is invalid on ``cluster`` or ``profile`` was captured at another shape."""
    check_strategy(
        st, world_size=cluster.world_size, blocks=profile.blocks, heads=profile.heads, experts=profile.experts
    )
    if st.seq != profile.seq or st.rank_sequences != profile.micro_batch:
        raise ValueError(
            f"profile captured at micro-batch {profile.micro_batch}, seq {profile.seq}; "
            f"strategy has {st.micro_batch}, {st.seq}"
        )


def _topology_notes(terms: Terms, cluster: Cluster, st: Strategy) -> list[str]:
    """Notes on TP or DP groups that span nodes."""
    notes: list[str] = []
    if terms.tp_crosses_nodes:
        notes.append(f"tp={st.tp} spans nodes: its collectives use the inter-node network")
    if terms.dp_crosses_nodes:
        axis = st.dims.axis("dp")
        group = comm.nccl_group(cluster, axis)
        per_node = axis.per_node(cluster.gpus_per_node)
        nic = cluster.inter_node.bandwidth_bytes_per_s / cluster.gpus_per_node
        bus = (
            group.bus_bytes_per_s if group is not None else min(nic, cluster.intra_node.bandwidth_bytes_per_s)
        )
        hsdp = st.dp_replicate > 1
        notes.append(
            f"dp={st.dp} spans nodes, {per_node} rank(s) per node: a ring over "
            f"{per_node if group is not None else 1} NIC(s) of {nic / 1e9:.0f} GB/s, {bus / 1e9:.0f} GB/s"
            + (f"; HSDP: {st.dp_replicate} replicas of {st.dp_shard}-rank shard groups" if hsdp else "")
        )
    return notes


def breakdown_s(rank_terms: Sequence[Terms], loads: Sequence[RankLoad], *, p2p_s: float) -> dict[str, float]:
    """Step time by term: the slowest rank's m micro-batches, the schedule's bubble in its
    micro-batch times (``pipeline.bubble_rounds``: (p − 1)/v for 1F1B and interleaving), and the
    worst rank's exposed DP/ZeRO communication and optimizer step. Each pipeline rank is priced
    by its own terms (a mixed cluster's ranks differ: ``cost_models.mixed``); ``p2p_s``: the
    slowest send per micro-batch between them."""
    st = rank_terms[0].strategy
    m, p = st.micro_batches, st.pp
    slow = max(range(p), key=lambda k: loads[k].time_s)
    r = loads[slow]
    t_mb = r.time_s + p2p_s
    ep = {"ep_comm": m * r.ep_s} if st.ep > 1 else {}  # the all-to-alls, apart from TP's
    return {
        "compute": m * r.compute_s,
        "recompute": m * r.recompute_s,
        "tp_comm": m * (r.tp_s - r.ep_s),
        **ep,
        "p2p": m * p2p_s,
        "bubble": rank_terms[slow].bubble_rounds * t_mb,
        "dp_comm": max(dp_exposed_s(t, load) for t, load in zip(rank_terms, loads, strict=True)),
        "optimizer": max(optimizer_s(t, load) for t, load in zip(rank_terms, loads, strict=True)),
    }


def step_flops(
    profile: ModelProfile, terms: Terms, st: Strategy, counts: list[tuple[int, ...]]
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs: model + recomputed) of one step."""
    sequences_per_micro_batch = profile.micro_batch
    model_flops = profile.step_model_flops_per_sequence * st.global_batch
    recompute_flops = sum(
        n * terms.block[r_].recompute_flops for c in counts for r_, n in zip(st.choices, c, strict=True)
    )
    hardware_flops = model_flops + recompute_flops * st.global_batch / sequences_per_micro_batch
    return model_flops, hardware_flops


def measurement_notes(profile: ModelProfile, cluster: Cluster, st: Strategy) -> list[str]:
    """What a cluster with measured profiles still prices analytically for ``st`` (empty when
    it has none: then everything is analytic, as the preset says)."""
    notes: list[str] = []
    measured = cluster.compute_profile
    if measured is not None:
        measured.check_model({k: v.params for k, v in profile.layer_types.items()}, seq=st.seq)
        missing = [
            name
            for name in profile.layer_types
            if measured_timing(measured, name, st, compiled=st.compile == "block") is None
        ]
        if missing:
            sp = " sp" if st.sequence_parallel and st.tp > 1 else ""
            how = "compiled" if st.compile == "block" else "eager"
            notes.append(
                f"compute of {', '.join(missing)} at micro-batch {st.micro_batch}, tp {st.tp}{sp}, "
                f"{st.dtype}, {how} not measured: roofline used"
            )
        if measured.dtype != st.dtype:
            notes.append(f"optimizer not measured for {st.dtype}: HBM-bandwidth model used")
    if cluster.comm_profile is not None:
        gaps = []
        dp_uses = {0: ("all_reduce",), 1: ("all_reduce", "all_gather")}.get(
            st.zero, ("all_gather", "reduce_scatter")
        )  # DDP; + ZeroRedundancyOptimizer's broadcast; FSDP2
        dp_axes = (
            (("dp_shard", dp_uses), ("dp_replicate", ("all_reduce",)))
            if st.dp_replicate > 1  # HSDP
            else (("dp", dp_uses),)
        )
        uses = (
            ("tp", ("all_reduce", "all_gather", "reduce_scatter")),  # the layout may use each
            *dp_axes,
            ("pp", ("send_recv",)),
        )
        for name, collectives in uses:
            axis = st.dims.axis(name)
            link = comm.group_link(cluster, axis)
            label = name.replace("_", " ")
            gaps += [f"{c} over {label} {axis.size}" for c in comm.unmeasured(link, axis.size, collectives)]
        if gaps:
            model = "NCCL's tuning model" if arch_of(cluster.device.name) else "alpha-beta model"
            notes.append(f"not measured, {model} used: {', '.join(gaps)}")
    return notes


def stage_chunks(profile: ModelProfile, st: Strategy) -> list[list[tuple[str, ...]]]:
    """Layer names per model chunk, per pipeline rank: the blocks of each chunk
    (``Strategy.chunk_blocks``; chunk c on ``Strategy.chunk_rank(c)``, one chunk per rank without
    interleaving), the embedding first in chunk 0 and the head last in the last chunk."""
    names = profile.layer_names
    blocks = list(names[1:-1])
    sizes = st.chunk_blocks(len(blocks))
    chunks, start = [], 0
    for size in sizes:
        chunks.append(blocks[start : start + size])
        start += size
    chunks[0].insert(0, names[0])
    chunks[-1].append(names[-1])
    return [[tuple(chunks[c]) for c in st.rank_chunks(k)] for k in range(st.pp)]


def stage_layer_names(profile: ModelProfile, st: Strategy) -> list[list[str]]:
    """Layer names per pipeline rank, its chunks in order (``stage_chunks``)."""
    return [[name for chunk in rank for name in chunk] for rank in stage_chunks(profile, st)]
