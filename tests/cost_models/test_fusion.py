"""Fusion-aware compute pricing of compiled blocks (``Strategy.compile = "block"``): each chain
of FLOP-free ops between matmuls is one kernel moving the bytes that enter and leave the chain
(``cost_models.kernels.fusion_groups``), hand-computed; eager plans keep the per-op pricing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx

from autopar import Cluster
from autopar.cost_models.compute import layer_forward_s
from autopar.cost_models.estimate import estimate
from autopar.cost_models.kernels import OpCost, fusion_groups
from autopar.cost_models.terms import build_terms
from autopar.planner import ModelProfiles
from autopar.strategy import Strategy
from autopar.zoo import GPT, GPTConfig


def _block(x, w1, w2):
    a = x @ w1  # (4, 16): a matmul, its own kernel
    c = torch.relu(a * 2)  # one chain: reads a, writes c
    d = c @ w2  # (4, 8)
    return d + x  # a chain on the residual stream: reads d and x, writes the output


SHAPES = {"x": (4, 8), "w1": (8, 16), "w2": (16, 8), "matmul": (4, 16), "mul": (4, 16), "relu": (4, 16)}
SHAPES |= {"matmul_1": (4, 8), "add": (4, 8)}


def _annotated() -> list[fx.Node]:
    """``_block`` traced, every node annotated as the capture does (fp32: 4 bytes an element)."""
    gm = fx.symbolic_trace(_block)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n in nodes:
        shape = SHAPES[n.name]
        out = 4 * shape[0] * shape[1]
        reads = sum(a.meta["autopar.out_bytes"] for a in n.all_input_nodes)
        matmul = n.name.startswith("matmul")
        n.meta |= {
            "autopar.shape": shape,
            "autopar.dtype": "float32",
            "autopar.out_bytes": out,
            "autopar.fwd_flops": 2 * 4 * 8 * 16 if matmul else 0,
            "autopar.mem_bytes": reads + out if n.op == "call_function" else 0,
        }
    return nodes


def test_chains_between_matmuls_are_one_kernel_each_by_hand() -> None:
    kernels = fusion_groups(_annotated(), h=8)
    assert [k.flops for k in kernels] == [1024, 0, 1024, 0]  # matmul, chain, matmul, chain
    mm1, chain, mm2, residual = kernels
    # eager: mul reads a (256 B) and writes 256, relu the same: 1024 B; fused: a in, c out
    assert chain == OpCost(flops=0, kernel_flops=0, mem_bytes=256 + 256, stream=False)
    # the residual add reads d and x (128 B each) and writes its output (the block's)
    assert residual == OpCost(flops=0, kernel_flops=0, mem_bytes=3 * 128, stream=True)
    assert mm1.mem_bytes == 128 + 512 + 256 and mm2.mem_bytes == 256 + 512 + 128  # as eager


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, block_size=128)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    return ModelProfiles.of(model, dtype="bf16", seq=128)


def test_a_compiled_block_moves_fewer_bytes_and_keeps_its_matmuls(gpt) -> None:
    block = gpt.at(1).layer_types["Block"]
    eager = [op for op in block.ops if not op.flops]
    fused = [op for op in block.fused_ops if not op.flops]
    assert [op for op in block.fused_ops if op.flops] == [op for op in block.ops if op.flops]
    assert len(fused) < len(eager) and sum(op.mem_bytes for op in fused) < sum(op.mem_bytes for op in eager)
    h100 = Cluster.preset("dgx-h100").device
    compiled = layer_forward_s(block, h100, "bf16", tp=1, sp=False, compiled=True)
    # the compiled forward is the roofline of the fused kernels, the eager one of every op
    bw = h100.hbm_bandwidth_bytes_per_s
    by_hand = sum(
        max(op.kernel_flops / h100.achievable_flops("bf16", attention=op.attention), op.mem_bytes / bw)
        for op in block.fused_ops
    )
    assert compiled == pytest.approx(by_hand, rel=1e-12)
    assert compiled < layer_forward_s(block, h100, "bf16", tp=1, sp=False)


def test_fused_kernels_at_any_micro_batch_equal_a_capture_there(gpt) -> None:
    """``at_micro_batch`` carries the fused kernels affinely, exactly as it does the eager ones."""
    cfg = GPTConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, block_size=128)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    captured = ModelProfiles.of(model, dtype="bf16", seq=128)._exactly(3)  # a capture at 3
    assert gpt.at(3).layer_types["Block"].fused_ops == captured.layer_types["Block"].fused_ops


def test_compiled_plans_are_predicted_faster_and_eager_ones_unchanged(gpt) -> None:
    cluster = Cluster.preset("dgx-h100")
    st = Strategy(tp=1, pp=1, dp=8, global_batch=8, seq=128)
    eager = estimate(gpt.at(1), cluster, st)
    compiled = estimate(gpt.at(1), cluster, dataclasses.replace(st, compile="block"))
    assert compiled.breakdown_s["compute"] < eager.breakdown_s["compute"]
    assert compiled.memory == eager.memory  # memory priced as eager
    # only the blocks are compiled: the embedding and head are priced eager either way
    eager_terms = build_terms(gpt.at(1), cluster, st)
    compiled_terms = build_terms(gpt.at(1), cluster, dataclasses.replace(st, compile="block"))
    assert compiled_terms.embed == eager_terms.embed and compiled_terms.head == eager_terms.head
    assert compiled_terms.block["none"].fwd_s < eager_terms.block["none"].fwd_s
    hand_built = dataclasses.replace(gpt.at(1).layer_types["Block"], fused_ops=())
    h100 = cluster.device
    assert layer_forward_s(hand_built, h100, "bf16", tp=1, sp=False, compiled=True) == layer_forward_s(
        hand_built, h100, "bf16", tp=1, sp=False
    )


def test_a_tp_block_with_selective_recompute_is_priced_eager(gpt) -> None:
    # under TP, selective recompute compiles only the checkpointed attention and runs the rest of
    # the block eagerly (passes/compile.py): that unit is priced eager, the others fused
    cluster = Cluster.preset("dgx-h100")
    st = Strategy(tp=2, pp=1, dp=4, global_batch=8, seq=128)
    eager = build_terms(gpt.at(1), cluster, st).block
    compiled = build_terms(gpt.at(1), cluster, dataclasses.replace(st, compile="block")).block
    assert compiled["selective"].fwd_s == eager["selective"].fwd_s
    assert compiled["none"].fwd_s < eager["none"].fwd_s and compiled["full"].fwd_s < eager["full"].fwd_s
    dp_only = dataclasses.replace(st, tp=1, dp=8)  # without TP the whole block is compiled
    assert (
        build_terms(gpt.at(1), cluster, dataclasses.replace(dp_only, compile="block"))
        .block["selective"]
        .fwd_s
        < build_terms(gpt.at(1), cluster, dp_only).block["selective"].fwd_s
    )
