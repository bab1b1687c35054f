"""The per-operator ILP: Megatron's layout emerges from the costs; its collectives match the
block cost model's."""

from __future__ import annotations

import pytest
import torch

from autopar import Cluster
from autopar.graph import capture
from autopar.tp_choice import choose_layer, layer_nodes, op_keys, plan_table
from autopar.zoo import GPT, GPTConfig


def _gpt(n_embd: int = 4096, n_head: int = 32, seq: int = 2048):
    """GPT-3 6.7B-sized blocks (two of them), where sharding pays on H100s."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=512, block_size=seq))
    return capture(model, batch=1, seq=seq)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_layout_emerges_for_gpt(tp: int) -> None:
    cap = _gpt()
    choice = choose_layer(cap.gm, 1, tp, Cluster.preset("dgx-h100"), dtype="bf16")
    assert choice.modules == {
        "blocks.0.attn.c_attn": "column",
        "blocks.0.attn": "heads",
        "blocks.0.attn.c_proj": "row",
        "blocks.0.mlp.c_fc": "column",
        "blocks.0.mlp.c_proj": "row",
    }
    kinds = sorted((c.kind, c.phase) for c in choice.collectives if c.kind == "all_reduce")
    # one all-reduce per sub-block each way (Shoeybi et al. 2019, Fig. 3: f and g) …
    assert kinds == [("all_reduce", "backward")] * 2 + [("all_reduce", "forward")] * 2
    # … and the fused QKV bias's gradient slices gathered (3·h elements)
    extra = [(c.kind, c.phase, c.size_bytes) for c in choice.collectives if c.kind != "all_reduce"]
    assert extra == [("all_gather", "backward", 3 * 4096 * 4)]  # fp32 parameters


def test_collectives_match_the_block_cost_model() -> None:
    from autopar.cost_models.profile import ModelProfile

    cap = _gpt()
    choice = choose_layer(cap.gm, 1, 4, Cluster.preset("dgx-h100"), dtype="bf16")
    block = ModelProfile.from_captured(cap).layer_types[cap.layers[1].type]
    for phase in ("forward", "backward"):
        moved = sum(c.size_bytes for c in choice.collectives if c.phase == phase and c.kind == "all_reduce")
        assert moved == block.tp_reduce_bytes  # what terms.py all-reduces per block per direction


def test_llama_swiglu_and_gqa() -> None:
    from autopar.zoo.llama import Llama, LlamaConfig

    with torch.device("meta"):
        llama = Llama(LlamaConfig(n_layer=2, dim=4096, n_head=32, n_kv_head=4, ffn_dim=14336, vocab_size=512))
    cap = capture(llama, batch=1, seq=2048)  # Llama-3 8B-sized blocks
    choice = choose_layer(cap.gm, 1, 4, Cluster.preset("dgx-h100"), dtype="bf16")
    names = {k.split(".", 2)[-1]: v for k, v in choice.modules.items()}
    wanted = {
        "attention.wq": "column",
        "attention.wk": "column",  # 4 KV heads split 4 ways
        "attention.wv": "column",
        "attention.wo": "row",
        "feed_forward.w1": "column",
        "feed_forward.w3": "column",
        "feed_forward.w2": "row",
    }
    assert {m: names.get(m) for m in wanted} == wanted, names


def test_plan_table_is_keyed_by_module_and_op() -> None:
    cap = _gpt()
    choice = choose_layer(cap.gm, 1, 2, Cluster.preset("dgx-h100"), dtype="bf16")
    table = dict((k, (n, o)) for k, n, o in plan_table(cap.gm, 1, "blocks.0", choice))
    assert table["attn.c_attn:linear#0"] == ("column", "S2")
    assert table["mlp.c_proj:linear#0"] == ("row", "R")
    keys1 = list(op_keys(layer_nodes(cap.gm, 1), "blocks.0").values())
    keys2 = list(op_keys(layer_nodes(cap.gm, 2), "blocks.1").values())
    assert keys1 == keys2  # the same names in every block
