"""Mixture-of-experts models at their published shapes, as Hugging Face ships them (built on
meta): what ``benchmarks/plan_speed.py --moe`` plans. Needs ``transformers``.

    autopar plan benchmarks/hf_moe.py:mixtral_8x7b --cluster dgx-h100 --nodes 4 --global-batch 512 --seq 4096
"""

from __future__ import annotations

import torch
from torch import nn


def mixtral_8x7b() -> nn.Module:
    """Mixtral-8x7B (Jiang et al. 2024): 32 layers, hidden 4096, 8 experts of 14336, top-2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768,
    )  # fmt: skip
    with torch.device("meta"):
        return MixtralForCausalLM(cfg)


def deepseek_v3() -> nn.Module:
    """DeepSeek-V3's shape (DeepSeek-AI 2024): 61 layers, hidden 7168, 128 heads of multi-head
    latent attention, 256 routed experts of 2048 (top-8, 8 groups, top-4 groups) and one shared
    expert. Stand-in: every layer is a MoE layer (the model's first 3 are dense), so the blocks
    are alike and the planner handles one block type; multi-token prediction is left out."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=0,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(cfg)
