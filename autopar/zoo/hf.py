"""Small Hugging Face models from config, for checks and examples (``transformers`` needed).

    autopar verify autopar.zoo.hf:llama --nproc 4 --pp 2

Both are the published architectures (``GPT2LMHeadModel``, ``LlamaForCausalLM``),
unmodified, with seeded random weights and dropout off so that runs compare exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def gpt2(
    *, layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 64, seq: int = 32, seed: int = 0
) -> nn.Module:
    """GPT-2 (Conv1D projections, fused QKV, tied head), dropout 0."""
    return family("gpt2", layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, seed=seed)


def llama(
    *,
    layers: int = 2,
    width: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 64,
    seq: int = 32,
    seed: int = 0,
) -> nn.Module:
    """Llama (GQA, RoPE, SwiGLU, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )
    return LlamaForCausalLM(cfg)


NODROP = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
"""GPT-2-style configs' dropout, off."""


def _dense(*, layers: int, width: int, heads: int, vocab: int, seq: int) -> dict[str, int]:
    """The config keys most decoder families share (Llama's names)."""
    return dict(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )


def _family_table(
    *, layers: int, width: int, heads: int, vocab: int, seq: int
) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Family → (config class, model class, config keys) at a tiny size, dropout off. Each
    family's attention form is what it ships with (``attn_implementation`` as its config
    defaults: SDPA where the family allows it, eager attention where it needs scores — Gemma-2's
    softcapping, BLOOM's ALiBi)."""
    dense = _dense(layers=layers, width=width, heads=heads, vocab=vocab, seq=seq)
    gqa = {**dense, "num_key_value_heads": max(1, heads // 2), "intermediate_size": 2 * width}
    gpt = dict(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq, **NODROP)
    return {
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", {**gpt, "bos_token_id": 0, "eos_token_id": 0}),
        "llama": ("LlamaConfig", "LlamaForCausalLM", gqa),
        "llama-eager": ("LlamaConfig", "LlamaForCausalLM", {**gqa, "attn_implementation": "eager"}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {**gqa, "sliding_window": seq // 4}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", gqa),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**gqa, "head_dim": width // heads}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {**gqa, "head_dim": width // heads}),
        "gemma2": (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {**gqa, "head_dim": width // heads, "sliding_window": seq // 4},
        ),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {**gqa, "pad_token_id": 0, "eos_token_id": 0}),
        "falcon": (  # Falcon-7B's layout: multi-query, fused QKV, parallel attention + MLP
            "FalconConfig",
            "FalconForCausalLM",
            {k: v for k, v in dense.items() if k != "max_position_embeddings"},
        ),
        "falcon-40b": (  # grouped heads laid out per group: [q … q k v] per KV head
            "FalconConfig",
            "FalconForCausalLM",
            {
                **{k: v for k, v in dense.items() if k != "max_position_embeddings"},
                "new_decoder_architecture": True,
                "num_kv_heads": max(1, heads // 2),
            },
        ),
        "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**dense, "intermediate_size": 2 * width}),
        "bloom": (
            "BloomConfig",
            "BloomForCausalLM",
            dict(n_layer=layers, hidden_size=width, n_head=heads, vocab_size=vocab),
        ),
        "opt": (
            "OPTConfig",
            "OPTForCausalLM",
            {**dense, "ffn_dim": 2 * width, "word_embed_proj_dim": width, "dropout": 0.0, "pad_token_id": 1},
        ),
        "gpt-bigcode": (  # StarCoder: multi-query attention behind one fused projection
            "GPTBigCodeConfig",
            "GPTBigCodeForCausalLM",
            {**gpt, "multi_query": True, "bos_token_id": 0, "eos_token_id": 0},
        ),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**gqa, "pad_token_id": 0, "eos_token_id": 0}),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM", gqa),
        "phi": ("PhiConfig", "PhiForCausalLM", {**dense, "intermediate_size": 2 * width}),
        "gptj": ("GPTJConfig", "GPTJForCausalLM", {**gpt, "rotary_dim": width // heads // 2}),
        **_moe_families(gqa, width),
    }


def _moe_families(gqa: dict[str, Any], width: int) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """The mixture-of-experts families: routed experts (top-2 of 4), run by Hugging Face's
    grouped experts (``torch._grouped_mm``): dropless, static shapes. Qwen2-MoE adds a gated
    shared expert; DeepSeek-V3 multi-head latent attention and group-limited routing."""
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": width // 2}
    mla = {
        "q_lora_rank": width // 2,
        "kv_lora_rank": width // 4,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
    }
    return {
        "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**gqa, **experts, "head_dim": 16}),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**gqa, **experts}),
        "deepseek-v3": (  # MLA, one shared expert, group-limited routing (2 groups, top-1 group)
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            {
                **gqa,
                **mla,
                "num_key_value_heads": gqa["num_attention_heads"],
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "n_group": 2,
                "topk_group": 1,
                "first_k_dense_replace": 0,
                "moe_intermediate_size": width // 2,
            },
        ),
        "mixtral": (
            "MixtralConfig",
            "MixtralForCausalLM",
            {**gqa, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "phimoe": (  # its router samples experts in training, under torch.no_grad()
            "PhimoeConfig",
            "PhimoeForCausalLM",
            {**gqa, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "granitemoe": (  # its forward takes use_cache only through **kwargs
            "GraniteMoeConfig",
            "GraniteMoeForCausalLM",
            {**gqa, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "qwen2-moe": (
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            {
                **gqa,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": width // 2,
                "shared_expert_intermediate_size": width,
            },
        ),
    }


FAMILIES = (
    "gpt2", "llama", "llama-eager", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "falcon",
    "falcon-40b", "gpt-neox", "bloom", "opt", "gpt-bigcode", "olmo2", "stablelm", "phi", "gptj",
    "mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3", "phimoe", "granitemoe",
)  # fmt: skip
"""The causal-LM families ``family`` builds (the suite runs each through capture, DP, TP and PP)."""
NO_FLOAT64 = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3", "phimoe", "granitemoe")
"""Families with no float64 forward (``torch._grouped_mm`` takes float32 and half precision):
their checks run in float32."""


def family(
    name: str,
    *,
    layers: int = 2,
    width: int = 64,
    heads: int = 4,
    vocab: int = 64,
    seq: int = 32,
    seed: int = 0,
    **config: Any,
) -> nn.Module:
    """A tiny ``name`` model (``FAMILIES``) from its published architecture, unmodified, with
    seeded random weights and dropout off; ``config``: more keys of its Hugging Face config
    (``tie_word_embeddings=True``, say)."""
    import transformers

    table = _family_table(layers=layers, width=width, heads=heads, vocab=vocab, seq=seq)
    if name not in table:
        raise ValueError(f"no Hugging Face family {name!r}: one of {', '.join(table)}")
    config_class, model_class, keys = table[name]
    cfg = getattr(transformers, config_class)(**keys, **config)
    torch.manual_seed(seed)
    model: nn.Module = getattr(transformers, model_class)(cfg)
    return model
