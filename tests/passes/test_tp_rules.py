"""Sharding rules on small hand-built and captured graphs (no processes)."""

from __future__ import annotations

import torch

from autopar.graph import capture
from autopar.passes.tp_graph import layer_nodes
from autopar.passes.tp_rules import RF, R, propagate, strategies, view_dim_map
from autopar.zoo import GPT, GPTConfig


def test_view_dim_map_follows_leading_dims_of_groups() -> None:
    assert view_dim_map((2, 16, 32), (2, 16, 4, 8)) == {0: 0, 1: 1, 2: 2}  # C → heads
    assert view_dim_map((2, 16, 4, 8), (2, 16, 32)) == {0: 0, 1: 1, 2: 2}  # heads → C
    assert view_dim_map((2, 16, 32), (32, 32)) == {0: 0, 2: 1}  # (B·T, C): C keeps its sharding
    assert view_dim_map((1, 16, 32), (16, 32)) == {1: 0, 2: 1}  # size-1 dims are skipped


def _block_nodes(n_head: int = 4, n_embd: int = 32):
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=64, block_size=16))
    cap = capture(model, batch=2, seq=16)
    return {n.name: n for n in layer_nodes(cap.gm, 1)}, layer_nodes(cap.gm, 1)


def test_linear_offers_replicate_column_row() -> None:
    nodes, _ = _block_nodes()
    options = strategies(nodes["linear"], 2)  # the fused QKV projection
    assert [s.name for s in options] == ["replicate", "column", "row", "row"]
    column, row, row_sp = options[1:]
    assert column.inputs == (RF,) and column.out == "S2" and column.compute_fraction == 0.5
    assert row.inputs == ("S2",) and row.out == R and row.reduce_output  # all-reduce
    assert row_sp.out == "S1" and row_sp.reduce_output  # reduce-scatter over the sequence


def test_heads_must_divide() -> None:
    nodes, _ = _block_nodes(n_head=4)
    assert "heads" in {s.name for s in strategies(nodes["scaled_dot_product_attention"], 4)}
    assert "heads" not in {s.name for s in strategies(nodes["scaled_dot_product_attention"], 8)}
    nodes3, _ = _block_nodes(n_head=3, n_embd=48)
    assert "heads" not in {s.name for s in strategies(nodes3["scaled_dot_product_attention"], 2)}


def test_normalisation_cannot_shard_its_normalised_dim() -> None:
    nodes, _ = _block_nodes()
    outs = {s.out for s in strategies(nodes["layer_norm"], 2)}
    assert "S2" not in outs and "S1" in outs  # the sequence dim can be (sequence parallelism)


def test_propagation_completes_megatron_from_the_deciding_ops() -> None:
    nodes, order = _block_nodes()

    def pick(name: str, strategy: str):
        return next(s for s in strategies(nodes[name], 2) if s.name == strategy)

    decided = {
        "linear": pick("linear", "column"),
        "scaled_dot_product_attention": pick("scaled_dot_product_attention", "heads"),
        "linear_1": pick("linear_1", "row"),
        "linear_2": pick("linear_2", "column"),
        "linear_3": pick("linear_3", "row"),
    }
    got = propagate(order, decided, 2)
    assert got["view"].out == "S2" and got["transpose"].out == "S1"  # (B, heads, T, hd): heads split
    assert got["gelu"].out == "S2" and got["layer_norm"].out == R and got["add_2"].out == R


def _math_block():
    """A block with explicit attention (scores, masked_fill with a causal-mask buffer, softmax,
    dropout), as Megatron-LM wrote it and the 22B run of Korthikanti et al. ran."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, attention="math"))
    cap = capture(model, batch=2, seq=16)
    return {n.name: n for n in layer_nodes(cap.gm, 1)}


def test_masked_fill_follows_the_heads_with_the_mask_whole() -> None:
    nodes = _math_block()
    fill = {s.out: s for s in strategies(nodes["masked_fill"], 2)}
    assert fill["S1"].inputs == ("S1", RF)  # scores split over heads; the (s, s) mask broadcast, whole
    assert fill["S3"].inputs == ("S3", "S1")  # split over keys: the (s, s) mask splits with them
    softmax = {s.out for s in strategies(nodes["softmax"], 2)}
    assert "S1" in softmax and "S3" not in softmax


def test_explicit_attention_gets_megatrons_layout() -> None:
    """The per-operator ILP splits the heads through scores, mask, softmax and dropout: no
    placement change between the QKV projection and the output projection."""
    from autopar.cluster import Cluster
    from autopar.planner.tp_layouts import layer_choices

    with torch.device("meta"):
        model = GPT(
            GPTConfig(n_layer=2, n_embd=2048, n_head=16, vocab_size=512, block_size=1024, attention="math")
        )
    cap = capture(model, batch=1, seq=1024)
    (_, layers, choice), _ = layer_choices(cap, Cluster.preset("dgx-a100-80g"), 8, "bf16")
    chosen = {n.name: choice.strategies[n.name] for n in layer_nodes(cap.gm, layers[0].index)}
    for name in ("matmul", "masked_fill", "softmax", "matmul_1"):
        assert chosen[name].out == "S1", (name, chosen[name])
    assert (chosen["linear"].name, chosen["linear_1"].name) == ("column", "row")
    gathered = {c.at for c in choice.collectives if c.kind == "all_gather" and c.phase == "forward"}
    assert not gathered & {"matmul", "mul", "masked_fill", "softmax", "dropout_1", "matmul_1"}, gathered


def test_alibi_select_and_index_rules() -> None:
    """BLOOM's baddbmm adds ALiBi over (batch·heads, 1, s): the bias follows dim 0 split; Falcon
    picks its multi-query keys out of the fused (b, s, kv groups, per group, d) projection with
    ``index`` (``[..., [-2], :]``, transformers ≤ 5.24) or ``select`` (``[..., -2, :]``, 5.25):
    either way the groups split and the picked dim never does."""
    from autopar.zoo import hf

    bloom = capture(hf.family("bloom"), batch=1, seq=16)
    (bmm,) = [n for n in layer_nodes(bloom.gm, 1) if n.target == torch.ops.aten.baddbmm.default]
    split = [s for s in strategies(bmm, 2) if s.out == "S0"]
    assert split and split[0].inputs == ("S0", "S0", "S0")  # per-head ALiBi slopes: split with the heads
    falcon = capture(hf.family("falcon-40b"), batch=1, seq=16)
    nodes = layer_nodes(falcon.gm, 1)
    picks = (torch.ops.aten.index.Tensor, torch.ops.aten.select.int)
    (pick, *_) = [n for n in nodes if n.target in picks and len(n.args[0].meta["val"].shape) == 5]
    ins = {s.inputs[0] for s in strategies(pick, 2)}
    assert "S3" not in ins and "S2" in ins, ins  # groups split, the picked dim not
    assert any(n.target == torch.ops.aten.linear.default for n in nodes)  # FalconLinear's x @ W.T folded


def test_index_with_one_index_list_keeps_every_other_dim_splittable() -> None:
    class Pick(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :, [0, 2]] * 2

    gm = torch.export.export(Pick(), (torch.randn(2, 4, 3, 8),)).graph_module
    (index,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.index.Tensor]
    outs = {s.out for s in strategies(index, 2)}
    assert {"S0", "S1", "S3"} <= outs and "S2" not in outs, outs  # (b, s, picked, d)


def test_fused_gate_up_chunk_is_column_sharded_chunk_wise() -> None:
    from autopar.passes.tp_rules import fused_chunks
    from autopar.zoo import hf

    cap = capture(hf.family("phi3"), batch=1, seq=16)
    nodes = layer_nodes(cap.gm, 1)
    (chunk,) = [n for n in nodes if n.target == torch.ops.aten.chunk.default]
    assert fused_chunks(chunk.args[0]) == 2  # gate | up: _StridedShard(0, split_factor=2)
    assert "S2" in {s.out for s in strategies(chunk, 2)}


def _deepseek_attention_nodes():
    from autopar.zoo import hf

    with torch.device("meta"):
        model = hf.family("deepseek-v3", seq=16)
    cap = capture(model, batch=2, seq=16)
    return cap.gm, layer_nodes(cap.gm, 1)


def test_what_deepseek_v3s_attention_may_not_split() -> None:
    """Three forms of DeepSeek-V3 (Hugging Face, unmodified) that the rules once split wrongly: its
    router reads ``weight.float()`` (a computed weight: no column/row); ``kv_a_proj`` output is cut
    into unequal [kv_lora_rank, rope] pieces (not followed column-wise); its query is a
    ``new_empty`` filled by ``copy_`` into slices (``written_later``: converted where read)."""
    from autopar.passes.tensor_parallel import written_later

    gm, nodes = _deepseek_attention_nodes()
    linears = [n for n in nodes if n.target is torch.ops.aten.linear.default]
    computed = [n for n in linears if n.args[1].op != "get_attr"]
    assert computed and all({s.name for s in strategies(n, 2)} == {"replicate"} for n in computed)
    splits = [n for n in nodes if n.target is torch.ops.aten.split_with_sizes.default]
    unequal = next(n for n in splits if len(set(n.args[1])) > 1)  # [kv_lora_rank 16, rope 8]
    cut = f"S{len(unequal.args[0].meta['autopar.shape']) - 1}"
    assert all(cut not in s.inputs for s in strategies(unequal, 2))
    filled = [n for n in nodes if n.target is torch.ops.aten.new_empty.default]
    written = written_later(gm.graph)
    assert filled and all(n.name in written for n in filled)
    assert not any(n.target is torch.ops.aten.linear.default for n in nodes if n.name in written)
