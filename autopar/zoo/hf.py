"""Small Hugging Face models from config, for checks and examples (``transformers`` needed).

    autopar verify autopar.zoo.hf:llama --nproc 4 --pp 2

Both are the published architectures (``GPT2LMHeadModel``, ``LlamaForCausalLM``),
unmodified, with seeded random weights and dropout off so that runs compare exactly.
"""

from __future__ import annotations

import torch
from torch import nn


def gpt2(
    *, layers: int = 2, width: int = 64, heads: int = 4, vocab: int = 64, seq: int = 32, seed: int = 0
) -> nn.Module:
    """GPT-2 (Conv1D projections, fused QKV, tied head), dropout 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


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
