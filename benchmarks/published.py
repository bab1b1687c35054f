"""Published measured training runs, to check the cost model against (shared/REFERENCES.md).

Each run names the model shape as the paper ran it (Megatron-LM in 2021–22:
explicit masked-softmax attention, dropout 0.1, V = 51200), the cluster,
the strategy and the measured figure in the paper's own convention.
``predict(run)`` returns the cost model's figure in that convention, priced the way ``autopar
estimate`` and ``autopar plan`` price it (``planner.Pricer``: tensor parallelism by the
per-operator layout the TP ILP chooses for the captured graph, not by closed forms).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from autopar.cluster import Cluster
from autopar.cost_models import closed_forms
from autopar.cost_models.estimate import Estimate
from autopar.planner import ModelProfiles, Pricer
from autopar.recompute_policy import RecomputePolicy
from autopar.strategy import Strategy
from autopar.zoo.gpt import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One measured run."""

    name: str
    """Short label."""
    source: str
    """Paper and section."""
    model: GPTConfig | str
    """Model shape as run: a Megatron-style GPT, or a zoo name (``llama3-70b``)."""
    cluster: str
    """Preset name."""
    nodes: int
    """Nodes used."""
    strategy: Strategy
    """Parallel configuration as run."""
    metric: str
    """``step_time_s``, ``hardware_tflops_per_gpu`` (Narayanan Eq. 3 convention) or
    ``tokens_per_s_per_gpu`` (torchtitan's convention: the global batch's tokens per second ÷ GPUs)."""
    measured: float
    """The published figure."""
    in_sample: str = ""
    """Why the run is not a held-out check, where it isn't: what was set or corrected with it."""
    keep: tuple[str, ...] = ()
    """A per-operator recompute policy the run used, as the calls each block keeps (priced as
    ``sac1`` instead of ``strategy.recompute``)."""


def _megatron(l: int, h: int, a: int) -> GPTConfig:  # noqa: E741
    return GPTConfig(
        n_layer=l,
        n_embd=h,
        n_head=a,
        vocab_size=51200,
        block_size=2048,
        attention="math",
        dropout=0.1,
    )


CALIBRATED = "matmul_efficiency 0.70 was calibrated on the Megatron runs"
ATTENTION_TERMS = (
    "its error (+17.9% / +20.1% held out) led to pricing fused attention at FlashAttention-2's "
    "H100 efficiency with a 2.5× backward (published constants, not fitted)"
)

TORCHTITAN_OP_SAC = ("mm#0", "mm#2", "sdpa#0", "mm#4", "mm#6")
"""torchtitan's per-op selective AC on a Llama block (``_apply_op_sac``): every matmul output
but every second one (wq and wv kept, wk and wo recomputed; w1 and w2 kept, w3 recomputed), and
the attention kernel's outputs; everything else recomputed."""


def _torchtitan_8b(gpus: int) -> dict[str, Any]:
    """What torchtitan's Llama-3.1 8B runs on ``gpus`` power-capped H100s share, for their
    throughput and their memory: FSDP over all of them, local batch 2, seq 8192, per-op SAC."""
    return {
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
        "model": "llama3-8b",
        "cluster": "h100-96g-500w",
        "nodes": gpus // 8,
        "strategy": Strategy(dp=gpus, zero=3, micro_batch=2, global_batch=2 * gpus, seq=8192),
        "keep": TORCHTITAN_OP_SAC,
    }


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="gpt3-175b 1024×A100 (Megatron 3D)",
        source="Narayanan et al. SC'21 §5.1, Table 1",
        model=_megatron(96, 12288, 96),
        cluster="dgx-a100-80g",
        nodes=128,
        strategy=Strategy(tp=8, pp=16, dp=8, micro_batch=1, global_batch=1536, seq=2048, recompute="full"),
        metric="hardware_tflops_per_gpu",
        measured=140.0,
        in_sample=CALIBRATED,
    ),
    PublishedRun(
        name="22B 8×A100 TP8, full recompute",
        source="Korthikanti et al. 2022, Table 4",
        model=_megatron(48, 6144, 64),
        cluster="dgx-a100-80g",
        nodes=1,
        strategy=Strategy(tp=8, micro_batch=4, global_batch=4, seq=2048, recompute="full"),
        metric="step_time_s",
        measured=1.42,
        in_sample=CALIBRATED,
    ),
    PublishedRun(
        name="22B 8×A100 TP8, SP + selective",
        source="Korthikanti et al. 2022, Table 4",
        model=_megatron(48, 6144, 64),
        cluster="dgx-a100-80g",
        nodes=1,
        strategy=Strategy(
            tp=8,
            micro_batch=4,
            global_batch=4,
            seq=2048,
            recompute="selective",
            sequence_parallel=True,
        ),
        metric="step_time_s",
        measured=1.10,
        in_sample=CALIBRATED,
    ),
    PublishedRun(
        name="llama3-70b 64×A100 FSDP64, full AC",
        source="torchtitan docs/performance.md (2024)",
        model="llama3-70b",
        cluster="dgx-a100-80g",
        nodes=8,
        strategy=Strategy(dp=64, zero=3, micro_batch=1, global_batch=64, seq=8192, recompute="full"),
        metric="tokens_per_s_per_gpu",
        measured=331.0,
        in_sample="its error (−13.5%) led to the ZeRO-3 gather count and causal-attention FLOPs terms",
    ),
    PublishedRun(
        name="llama3-70b 256×H100-500W FSDP32×TP8+SP",
        source="torchtitan docs/performance.md (2024)",
        model="llama3-70b",
        cluster="h100-96g-500w",
        nodes=32,
        strategy=Strategy(
            tp=8,
            dp=32,
            zero=3,
            micro_batch=16,
            global_batch=512,
            seq=8192,
            recompute="full",
            sequence_parallel=True,
        ),
        metric="tokens_per_s_per_gpu",
        measured=597.3,
        in_sample="the only check of the h100-96g-500w preset's power-cap assumption",
    ),
    *(
        PublishedRun(
            name=f"llama3.1-8b {gpus}×H100-500W FSDP{gpus} op-SAC",
            metric="tokens_per_s_per_gpu",
            measured=tokens,
            in_sample=ATTENTION_TERMS,
            **_torchtitan_8b(gpus),
        )
        for gpus, tokens in ((8, 5762.0), (128, 5605.0))
    ),
)


@dataclass(frozen=True, kw_only=True)
class MemoryRun:
    """A published peak memory: the measured peak must lie between autopar's predictions with
    no recompute and with full recompute, and where the run's recompute policy is a per-operator
    one autopar can state (``keep``), it is also priced as run."""

    name: str
    source: str
    model: str
    cluster: str
    nodes: int
    strategy: Strategy
    """As run, with ``recompute`` ignored (priced at none and at full)."""
    measured_gib: float
    policy: str
    """The recompute policy the run used."""
    keep: tuple[str, ...] = ()
    """That policy as the calls each block keeps (``op#k``, ``RecomputePolicy.keep``), if stated."""


MEMORY_RUNS: tuple[MemoryRun, ...] = tuple(
    MemoryRun(
        name=f"llama3.1-8b {gpus}×H100-500W FSDP{gpus} mb2",
        measured_gib=gib,
        policy="per-op selective checkpointing",
        **_torchtitan_8b(gpus),
    )
    for gpus, gib in ((8, 82.4), (128, 67.0))
)


def korthikanti_22b() -> GPT:
    """The 22B model of Korthikanti et al. 2022 (Table 4) as Megatron-LM ran it, on the meta
    device in bf16, for the CLI: ``autopar estimate benchmarks/published.py:korthikanti_22b
    --cluster dgx-a100-80g --tp 8 --micro-batch 4 --global-batch 4 --seq 2048 --recompute full``."""
    with torch.device("meta"):
        return GPT(RUNS[1].model).to(torch.bfloat16)


def profiles_of(run: PublishedRun | MemoryRun) -> ModelProfiles:
    """The run's model, on the meta device, captured at its sequence length (``ModelProfiles``)."""
    if isinstance(run.model, str):
        return ModelProfiles.of(run.model, dtype="bf16", seq=run.strategy.seq)
    with torch.device("meta"):
        model = GPT(run.model).to(torch.bfloat16)
    return ModelProfiles.of(model, dtype="bf16", seq=run.strategy.seq)


def with_policy(st: Strategy, profiles: ModelProfiles, keep: tuple[str, ...]) -> Strategy:
    """``st`` recomputing per operator, keeping ``keep`` in every block (``sac1``)."""
    block = profiles.base.layer_types[profiles.base.layers[1]]
    own = RecomputePolicy(name="sac1", keep=keep, calls=sum(c.keepable for c in block.calls))
    return dataclasses.replace(st, recompute="sac1", policies=(own,))


def predict(run: PublishedRun, profiles: ModelProfiles | None = None) -> tuple[float, Estimate]:
    """The cost model's figure for ``run`` in the run's convention, and the full estimate."""
    profiles = profiles or profiles_of(run)
    pricer = Pricer(profiles, Cluster.preset(run.cluster, nodes=run.nodes), dtype="bf16")
    st = with_policy(run.strategy, profiles, run.keep) if run.keep else run.strategy
    est = pricer.estimate(st)
    if run.metric == "step_time_s":
        return est.step_time_s, est
    if run.metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s / st.world_size, est
    # Narayanan's Eq. 3 counts hardware FLOPs of full recomputation with V/(16lh).
    cfg = run.model
    assert isinstance(cfg, GPTConfig), "Eq. 3 is for the Megatron GPT shapes"
    flops = closed_forms.gpt_hardware_flops_full_recompute(
        B=st.global_batch, s=st.seq, l=cfg.n_layer, h=cfg.n_embd, V=cfg.vocab_size
    )
    return flops / est.step_time_s / st.world_size / 1e12, est


def memory_bracket(run: MemoryRun) -> tuple[float, float, float | None]:
    """(peak GiB with no recompute, with full recompute, with the run's own per-operator policy
    where it states one) for ``run``: the largest stage's."""
    profiles = profiles_of(run)
    pricer = Pricer(profiles, Cluster.preset(run.cluster, nodes=run.nodes), dtype="bf16")
    peaks: list[float | None] = []
    for recompute in ("none", "full", "sac1"):
        if recompute == "sac1" and not run.keep:
            peaks.append(None)
            continue
        own = recompute == "sac1"
        st = (
            with_policy(run.strategy, profiles, run.keep)
            if own
            else dataclasses.replace(run.strategy, recompute=recompute)
        )
        est = pricer.estimate(st)
        peaks.append(max(m.peak_bytes for m in est.memory) / 2**30)
    none, full, policy = peaks
    assert none is not None and full is not None
    return none, full, policy
