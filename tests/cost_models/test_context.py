"""Context parallelism's price (``cost_models.context``): a cp rank is the profile at b/cp
sequences plus the keys and values it gathers (before the grouped-query repeat) and keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import Cluster
from autopar.cost_models import context
from autopar.planner import ModelProfiles
from autopar.planner.pricing import Pricer
from autopar.strategy import Strategy
from autopar.zoo import Llama, LlamaConfig

SEQ = 4096
CFG = LlamaConfig(n_layer=4, dim=512, n_head=8, n_kv_head=2, ffn_dim=1024, vocab_size=4096, max_seq_len=SEQ)


@pytest.fixture(scope="module")
def pricer() -> Pricer:
    with torch.device("meta"):
        model = Llama(CFG).to(torch.bfloat16)
    return Pricer(ModelProfiles.of(model, dtype="bf16", seq=SEQ), Cluster.preset("dgx-h100"), dtype="bf16")


def _st(cp: int, **knobs) -> Strategy:
    return Strategy(dp=8 // cp, cp=cp, global_batch=16, micro_batch=2, seq=SEQ, dtype="bf16", zero=3, **knobs)


def test_a_cp_rank_is_the_profile_at_b_over_cp(pricer: Pricer) -> None:
    """FLOPs, tokens and kept activations of a cp-2 rank are those of b/2 whole sequences; the
    K/V gather is the model's 2 key/value heads' width (1/4 of the query width), priced on the
    critical path forward and backward, and attention keeps the whole sequence's keys."""
    one, two = pricer.terms(_st(1)), pricer.terms(_st(2))
    prof = pricer.profiles.at(1)
    assert prof.kv_width == 2 * 64 and pricer.profiles.at(1.0 / 2).micro_batch == 0.5
    assert two.block["none"].fwd_flops == pytest.approx(one.block["none"].fwd_flops / 2, rel=1e-9)
    assert two.head.fwd_flops == pytest.approx(one.head.fwd_flops / 2, rel=1e-9)
    gathered = context.kv_gathered_bytes(prof, _st(2))
    assert gathered == 2 * 2 * SEQ * 128 * 2  # K and V, b·s·w elements each, bf16
    fwd, bwd = context.cp_phases_s(prof, pricer.cluster, _st(2))
    assert fwd > 0 and bwd > 0
    assert two.block["none"].tp_s == pytest.approx(fwd + bwd)  # no TP: the block's only collectives
    extra = context.kv_extra_bytes(prof, _st(2))
    assert extra == pytest.approx(2 * 2 * SEQ * 512 * 2 / 2)  # repeated to 8 heads, half of it new
    assert one.block["none"].act_bytes / 2 < two.block["none"].act_bytes < one.block["none"].act_bytes
    assert two.block["full"].tp_s == pytest.approx(2 * fwd + bwd)  # recompute gathers again


def test_cp_halves_each_micro_batch_and_reduces_gradients_over_dp_cp(pricer: Pricer) -> None:
    """The step of cp 2 × dp 4 runs half the work per micro-batch of dp 8 on twice the
    micro-batches, its gradients reduced over the same 8 ranks: the same order of step time;
    its memory per rank lower (half of each micro-batch's activations)."""
    dp8, cp2 = pricer.estimate(_st(1)), pricer.estimate(_st(2))
    assert cp2.strategy.dims.dp_cp == dp8.strategy.dims.dp_cp == 8
    assert cp2.breakdown_s["compute"] == pytest.approx(dp8.breakdown_s["compute"], rel=0.05)
    assert cp2.memory[0].activations < dp8.memory[0].activations
    assert cp2.tokens_per_s == pytest.approx(cp2.strategy.global_batch * SEQ / cp2.step_time_s)
    no_gqa = dataclasses.replace(pricer.profiles.at(1), kv_width=None)
    assert context.kv_gathered_bytes(no_gqa, _st(2)) == 4 * context.kv_gathered_bytes(
        pricer.profiles.at(1), _st(2)
    )
