"""Hugging Face transformers models from small configs: captured without model changes."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autopar import capture
from autopar.cost_models import closed_forms


def _gpt2() -> torch.nn.Module:
    cfg = GPT2Config(
        n_layer=6,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _llama() -> torch.nn.Module:
    cfg = LlamaConfig(
        num_hidden_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize(
    ("make", "blocks", "block_type"),
    [
        (_gpt2, "transformer.h", "GPT2Block"),
        (_llama, "model.layers", "LlamaDecoderLayer"),
    ],
)
def test_hf_model_captured_exactly(make, blocks: str, block_type: str) -> None:
    torch.manual_seed(0)
    model = make().eval()
    cap = capture(model, batch=2, seq=16)
    assert [layer.name for layer in cap.layers] == [
        "embed",
        *(f"{blocks}.{i}" for i in range(6)),
        "head",
    ]
    assert cap.layer_types()[block_type].count == 6
    assert cap.total_params == sum(p.numel() for p in model.parameters())
    assert sum(layer.params for layer in cap.layers) == cap.total_params
    idx = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(cap.gm(idx), model(idx, use_cache=False).logits)


def test_hf_gpt2_flops_equal_the_closed_form() -> None:
    cap = capture(_gpt2(), batch=2, seq=16)
    assert cap.step_flops == closed_forms.gpt_model_flops(B=2, s=16, l=6, h=64, V=128)


def test_hf_llama_on_meta_device() -> None:
    with torch.device("meta"):
        model = _llama()
    cap = capture(model, batch=1, seq=32)
    assert cap.layer_types()["LlamaDecoderLayer"].saved_bytes > 0
    assert cap.step_flops > 0
