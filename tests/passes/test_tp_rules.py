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
