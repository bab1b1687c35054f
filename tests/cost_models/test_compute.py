"""Compute pricing: fused attention kernels at the device's attention efficiency, their backward
at 2.5× their forward (FlashAttention-2 §4.1), hand-computed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import Cluster, ClusterSpecError
from autopar.cluster import HOPPER_FLASH_ATTENTION_EFFICIENCY
from autopar.cost_models.compute import FLASH_BACKWARD_RATIO, layer_backward_s, layer_forward_s
from autopar.cost_models.profile import LayerCost, OpCost
from autopar.planner import ModelProfiles
from autopar.zoo.gpt import GPT, GPTConfig


def _layer() -> LayerCost:
    """A 1 TFLOP matmul and a 1 TFLOP fused attention kernel."""
    return LayerCost(
        name="Block",
        ops=(
            OpCost(flops=10**12, kernel_flops=10**12, mem_bytes=0, stream=False),
            OpCost(flops=10**12, kernel_flops=10**12, mem_bytes=0, stream=False, attention=True),
        ),
        fwd_flops=2 * 10**12,
        bwd_flops=4 * 10**12,
        params=0,
        saved_stream_bytes=0,
        saved_sharded_bytes=0,
        saved_quadratic_bytes=0,
        quadratic_flops=0,
        tp_reduce_bytes=0,
        tp_reduce_count=0,
    )


def test_attention_at_its_efficiency_and_backward_by_hand() -> None:
    # H100: 989 TFLOP/s; matmuls at 0.64 (633.0 TFLOP/s), fused attention at 0.35 (346.15 TFLOP/s)
    dev = Cluster.preset("dgx-h100").device
    assert dev.attention_efficiency == HOPPER_FLASH_ATTENTION_EFFICIENCY == 0.35
    matmul_s, attention_s = 1e12 / (989e12 * 0.64), 1e12 / (989e12 * 0.35)
    fwd = layer_forward_s(_layer(), dev, "bf16", tp=1, sp=False)
    assert fwd == pytest.approx(matmul_s + attention_s)  # 1.580 ms + 2.889 ms
    # backward: 2× the forward, and the attention's 2.5× instead of 2×: 2F + 0.5·A
    assert FLASH_BACKWARD_RATIO == 2.5
    bwd = layer_backward_s(_layer(), dev, "bf16", tp=1, fwd_s=fwd)
    assert bwd == pytest.approx(2 * matmul_s + 2.5 * attention_s)
    # split over 4 GPUs by heads: every term ÷ 4
    assert layer_forward_s(_layer(), dev, "bf16", tp=4, sp=False) == pytest.approx(fwd / 4)
    assert layer_backward_s(_layer(), dev, "bf16", tp=4, fwd_s=fwd / 4) == pytest.approx(bwd / 4)


def test_without_an_attention_efficiency_attention_runs_at_the_matmul_rate() -> None:
    dev = Cluster.preset("dgx-a100-80g").device  # FlashAttention-2 on A100 ≈ the matmuls
    assert dev.attention_efficiency is None
    rate = 312e12 * 0.64
    assert layer_forward_s(_layer(), dev, "bf16", tp=1, sp=False) == pytest.approx(2e12 / rate)
    assert dev.achievable_flops("bf16", attention=True) == dev.achievable_flops("bf16")


def test_attention_efficiency_in_yaml(tmp_path) -> None:
    data = Cluster.preset("dgx-a100-80g").to_dict()
    data["device"]["attention_efficiency"] = 0.5
    cluster = Cluster.from_dict(data)
    assert cluster.device.attention_efficiency == 0.5
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    data["device"]["attention_efficiency"] = 1.5
    with pytest.raises(ClusterSpecError, match=r"device\.attention_efficiency: expected a fraction"):
        Cluster.from_dict(data)
    plain = dataclasses.replace(Cluster.preset("dgx-h100").device, attention_efficiency=None)
    assert plain.achievable_flops("bf16", attention=True) == plain.achievable_flops("bf16")


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_the_capture_marks_fused_attention_kernels(attention: str) -> None:
    """scaled_dot_product_attention is one fused kernel; explicit attention is matmuls."""
    with torch.device("meta"):
        model = GPT(
            GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32, attention=attention)
        )
    profile = ModelProfiles.of(model, dtype="fp32", seq=32).base
    block = profile.layer_types[profile.layers[1]]
    assert sum(op.attention for op in block.ops) == (1 if attention == "sdpa" else 0)


def test_the_loss_is_priced_on_the_head_once() -> None:
    """A model that returns logits: the head's forward is its kernels plus the cross-entropy's
    memory-bound pass, 22 bytes per logit at HBM bandwidth (``LOSS_BYTES_PER_LOGIT``), its
    backward + 30; a model whose graph holds its own loss (nanoGPT's ``forward(idx, targets)``:
    ``_log_softmax``, ``nll_loss_forward`` in the head) is not charged again."""
    from pathlib import Path

    from autopar.cost_models.compute import LOSS_BYTES_PER_LOGIT, loss_time_s
    from autopar.cost_models.terms import layer_units
    from autopar.planner import ModelProfiles
    from autopar.strategy import Strategy
    from autopar.zoo.spec import build_model

    cluster = Cluster.preset("dgx-a100-80g")
    dev = cluster.device
    gpt = ModelProfiles.of("gpt2", dtype="bf16", seq=1024).at(1)
    st = Strategy(dp=8, global_batch=8, seq=1024)
    _, _, head = layer_units(gpt, cluster, st)
    logits = 1024 * gpt.vocab
    assert loss_time_s(logits, dev) == pytest.approx(
        (logits * 22 / dev.hbm_bandwidth_bytes_per_s, logits * 30 / dev.hbm_bandwidth_bytes_per_s)
    )
    assert LOSS_BYTES_PER_LOGIT == (22, 30)
    kernels = layer_forward_s(gpt.layer_types["head"], dev, "bf16", tp=1, sp=False)
    assert head.fwd_s == pytest.approx(kernels + loss_time_s(logits, dev)[0])
    nanogpt = Path(__file__).parents[1] / "autopar" / "runtime" / "nanogpt.py"
    own = ModelProfiles.of(build_model(f"{nanogpt}:nanogpt"), dtype="bf16", seq=16).at(1)
    assert any(c.key.startswith("_log_softmax") for c in own.layer_types["head"].calls)
    _, _, own_head = layer_units(own, cluster, Strategy(dp=8, global_batch=8, seq=16))
    assert own_head.fwd_s == pytest.approx(
        layer_forward_s(own.layer_types["head"], dev, "bf16", tp=1, sp=False)
    )
