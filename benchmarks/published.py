"""Published measured training runs, to check the cost model against (shared/REFERENCES.md).

Each run names the model shape as the paper ran it (Megatron-LM in 2021–22:
explicit masked-softmax attention, dropout 0.1, V = 51200), the cluster,
the strategy and the measured figure in the paper's own convention.
``predict(run)`` returns the cost model's figure in that convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.cluster import Cluster
from autopar.cost_models import closed_forms
from autopar.cost_models.estimate import Estimate, estimate
from autopar.cost_models.profile import ModelProfile
from autopar.graph import capture
from autopar.strategy import Strategy
from autopar.zoo.gpt import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One measured run."""

    name: str
    """Short label."""
    source: str
    """Paper and section."""
    model: GPTConfig
    """Model shape as run."""
    cluster: str
    """Preset name."""
    nodes: int
    """Nodes used."""
    strategy: Strategy
    """Parallel configuration as run."""
    metric: str
    """``step_time_s`` or ``hardware_tflops_per_gpu`` (Narayanan Eq. 3 convention)."""
    measured: float
    """The published figure."""


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
    ),
)


def profile_of(run: PublishedRun) -> ModelProfile:
    """Capture the run's model on the meta device at its micro-batch and sequence length."""
    with torch.device("meta"):
        model = GPT(run.model).to(torch.bfloat16)
    return ModelProfile.from_captured(capture(model, batch=run.strategy.micro_batch, seq=run.strategy.seq))


def predict(run: PublishedRun, profile: ModelProfile | None = None) -> tuple[float, Estimate]:
    """The cost model's figure for ``run`` in the run's convention, and the full estimate."""
    est = estimate(profile or profile_of(run), Cluster.preset(run.cluster, nodes=run.nodes), run.strategy)
    if run.metric == "step_time_s":
        return est.step_time_s, est
    # Narayanan's Eq. 3 counts hardware FLOPs of full recomputation with V/(16lh).
    cfg, st = run.model, run.strategy
    flops = closed_forms.gpt_hardware_flops_full_recompute(
        B=st.global_batch, s=st.seq, l=cfg.n_layer, h=cfg.n_embd, V=cfg.vocab_size
    )
    return flops / est.step_time_s / st.world_size / 1e12, est
