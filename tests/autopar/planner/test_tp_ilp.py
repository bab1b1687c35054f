"""The per-operator ILP: Megatron's layout emerges from the costs; its collectives match the
block cost model's."""

from __future__ import annotations

import pytest
import torch

from autopar import Cluster
from autopar.cost_models.terms import HIDDEN
from autopar.cost_models.tp import op_memory_bytes, param_numel, param_owners
from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.passes.tp_graph import layer_nodes, op_keys
from autopar.passes.tp_rules import strategies
from autopar.planner.tp_ilp import choose_layer
from autopar.planner.tp_layouts import plan_table
from autopar.zoo import GPT, GPTConfig


def _gpt(n_embd: int = 4096, n_head: int = 32, seq: int = 2048):
    """GPT-3 6.7B-sized blocks (two of them), where sharding pays on H100s."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=512, block_size=seq))
    return capture(model, batch=1, seq=seq)


MEGATRON = {
    "blocks.0.attn.c_attn": "column",
    "blocks.0.attn": "heads",
    "blocks.0.attn.c_proj": "row",
    "blocks.0.mlp.c_fc": "column",
    "blocks.0.mlp.c_proj": "row",
}
RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
"""Ring cost in units of (t−1)/t·N bytes: an all-reduce is a reduce-scatter plus an all-gather."""


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_layout_emerges_for_gpt(tp: int) -> None:
    from autopar.cost_models.tp import layer_context, price_layer
    from autopar.passes.tp_rules import propagate

    cap = _gpt()
    cluster = Cluster.preset("dgx-h100")
    choice = choose_layer(cap.gm, 1, tp, cluster, dtype="bf16")
    assert choice.modules == MEGATRON
    # Between the sub-blocks the ILP may keep the residual stream split over the sequence (the
    # norms, dropout and adds then run on a shard) where its costs say that pays; it is never
    # worse than Megatron's one all-reduce per sub-block, priced by the same model:
    nodes = layer_nodes(cap.gm, 1)
    megatron = {
        n.name: s for n in nodes for s in [choice.strategies[n.name]] if s.name in ("column", "heads")
    }
    megatron |= {
        n.name: next(s for s in strategies(n, tp) if s.name == "row" and s.out == "R")
        for n in nodes
        if choice.strategies[n.name].name == "row"
    }
    ctx = layer_context(cap.gm, (1,), tp, cluster, dtype="bf16", sp=False)
    assert not ctx.final  # a block feeds no model output
    pure = price_layer(ctx, propagate(nodes, megatron, tp), 0.0)  # memory: not compared here
    assert (
        sorted((c.kind, c.phase) for c in pure.collectives if c.kind == "all_reduce")
        == [("all_reduce", "backward")] * 2 + [("all_reduce", "forward")] * 2
    )  # Shoeybi et al. 2019, Fig. 3: f and g per sub-block
    assert choice.time_s <= pure.time_s * (1 + 1e-6)


@pytest.mark.parametrize("tp", [2, 8])
def test_megatron_sequence_parallel_layout_emerges(tp: int) -> None:
    cap = _gpt()
    choice = choose_layer(cap.gm, 1, tp, Cluster.preset("dgx-h100"), dtype="bf16", sp=True)
    assert choice.modules == MEGATRON
    forward = sorted(c.kind for c in choice.collectives if c.phase == "forward")
    # Korthikanti et al. 2022, Fig. 5: g = all-gather before each column-parallel linear,
    # g-bar = reduce-scatter after each row-parallel one …
    assert forward == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    backward = sorted(c.kind for c in choice.collectives if c.phase == "backward")
    # … their conjugates backward, plus the fused QKV bias's gradient slices gathered …
    assert backward == ["all_gather"] * 3 + ["reduce_scatter"] * 2
    # … and each g's input gathered again for the weight gradient (§4.2.2: the shard is what is
    # kept), behind the input-gradient GEMM
    assert [c.kind for c in choice.collectives if c.phase == HIDDEN] == ["all_gather"] * 2


def test_collectives_match_the_block_cost_model() -> None:
    """terms.py prices TP per block as an all-reduce of the row-parallel outputs each way; the
    sequence-parallel layout moves exactly that."""
    from autopar.cost_models.profile import ModelProfile

    cap = _gpt()
    choice = choose_layer(cap.gm, 1, 4, Cluster.preset("dgx-h100"), dtype="bf16", sp=True)
    block = ModelProfile.from_captured(cap).layer_types[cap.layers[1].type]
    moved = sum(RING[c.kind] * c.size_bytes for c in choice.collectives if c.phase == "forward")
    assert moved == 2 * block.tp_reduce_bytes


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
    assert table["mlp.c_proj:linear#0"][0] == "row"  # all-reduced, or reduce-scattered then gathered
    keys1 = list(op_keys(layer_nodes(cap.gm, 1), "blocks.0").values())
    keys2 = list(op_keys(layer_nodes(cap.gm, 2), "blocks.1").values())
    assert keys1 == keys2  # the same names in every block


def test_memory_objective_and_budget_trade_time_for_memory() -> None:
    """At h 1024 without SP the fastest layout keeps attention whole on one H100 pair (its
    all-reduces cost more than the split saves); the leanest splits it (Megatron), holding less
    for more time; a budget between the two is met, one below the least is a clear error."""
    cap = _gpt(n_embd=1024, n_head=16, seq=512)
    cluster = Cluster.preset("dgx-h100")
    fast = choose_layer(cap.gm, 1, 2, cluster, dtype="bf16")
    lean = choose_layer(cap.gm, 1, 2, cluster, dtype="bf16", objective="memory")
    assert "blocks.0.attn" not in fast.modules, fast.modules
    assert lean.modules == MEGATRON
    assert lean.memory_bytes < 0.8 * fast.memory_bytes
    assert fast.time_s < lean.time_s
    middle = (fast.memory_bytes + lean.memory_bytes) / 2
    bounded = choose_layer(cap.gm, 1, 2, cluster, dtype="bf16", memory_budget_bytes=middle)
    assert bounded.memory_bytes <= middle
    assert fast.time_s <= bounded.time_s <= lean.time_s * (1 + 1e-9)
    print(
        f"h 1024 block at tp 2: fastest {fast.memory_bytes / 2**20:.1f} MiB, {1e3 * fast.time_s:.3f} ms; "
        f"leanest {lean.memory_bytes / 2**20:.1f} MiB, {1e3 * lean.time_s:.3f} ms"
    )
    with pytest.raises(AutoparError, match="within"):
        choose_layer(cap.gm, 1, 2, cluster, dtype="bf16", memory_budget_bytes=lean.memory_bytes / 2)


def test_memory_of_a_replicated_layer_is_its_states_and_saved_tensors() -> None:
    """Everything replicated: 16 bytes per parameter (bf16 weight and gradient, fp32 master,
    momentum, variance) plus every byte the block's operators save for backward."""
    cap = _gpt(n_embd=256, n_head=4, seq=128)
    nodes = layer_nodes(cap.gm, 1)
    owners = param_owners(nodes)
    params = 12 * 256**2 + 13 * 256  # a GPT block: QKV, projection, 4h MLP, two norms, biases
    assert sum(param_numel(p) for p in owners.values()) == params
    held = sum(
        op_memory_bytes(n, strategies(n, 2)[0], 2, state_bytes_per_param=16, owners=owners) for n in nodes
    )
    saved = sum(n.meta["autopar.saved_bytes"] for n in nodes)
    assert held == 16 * params + saved
