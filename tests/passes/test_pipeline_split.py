"""The pipeline split on one process: stages run in a chain equal the model exactly (outputs and
every gradient), parameter names stay the model's, and inputs-free values are recomputed per
stage rather than sent."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from torch import fx

from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.passes.pipeline_split import (
    fill_layers,
    outline,
    outline_attention,
    outline_blocks,
    split_stages,
    stage_chunks,
)
from autopar.runtime import lm_loss
from autopar.zoo import GPT, GPTConfig, hf
from autopar.zoo.llama import Llama, LlamaConfig

SEQ = 16


def make_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=SEQ))


def make_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layer=4, dim=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=64, max_seq_len=SEQ)
    return Llama(cfg)


make_hf_gpt2 = functools.partial(hf.gpt2, layers=3, width=32, seq=SEQ)
make_hf_llama = functools.partial(hf.llama, layers=3, width=32, ffn=64, seq=SEQ)


def _split(
    model: torch.nn.Module, cut: list[int], virtual: int = 1
) -> tuple[list[fx.GraphModule], list[str], fx.GraphModule]:
    """Stages of ``model`` with layer boundaries before each index in ``cut`` (chunks dealt to
    ranks round-robin when ``virtual`` > 1), blocks outlined; also the whole captured graph."""
    cap = capture(model, batch=2, seq=SEQ)
    names = [layer.name for layer in cap.layers]
    bounds = [0, *cut, len(names)]
    pieces = [names[a:b] for a, b in itertools.pairwise(bounds)]
    p = len(pieces) // virtual
    ranks = [[piece for c, piece in enumerate(pieces) if c % p == k] for k in range(p)]
    chunks = stage_chunks(names, ranks)
    assert chunks == pieces
    gm = fill_layers(cap.gm)
    parts = split_stages(gm, lambda n: names[n.meta["autopar.layer"]], chunks)
    return [outline_blocks(parts[c], names) for c in sorted(parts)], names, gm


def _chain(stages: list[fx.GraphModule], x: torch.Tensor) -> torch.Tensor:
    out: object = x
    for stage in stages:
        out = stage(*(out if isinstance(out, tuple) else (out,)))
    assert isinstance(out, torch.Tensor) or hasattr(out, "logits")
    return out  # type: ignore[return-value]


CASES = [
    (make_gpt, [3], 1),  # even: embed + 2 blocks | 2 blocks + head
    (make_gpt, [2], 1),  # uneven: 1 block | 3 blocks
    (make_gpt, [2, 3, 4], 2),  # interleaved: 4 chunks on 2 ranks
    (make_llama, [2, 4], 1),  # three stages; rotary tables recomputed on each
    (make_hf_gpt2, [2], 1),
    (make_hf_llama, [3], 1),
]


@pytest.mark.parametrize(
    ("make", "cut", "virtual"), CASES, ids=["gpt", "gpt-uneven", "gpt-v2", "llama-3", "hf-gpt2", "hf-llama"]
)
def test_stages_in_a_chain_equal_the_model(make, cut, virtual) -> None:
    model = make()
    ref = copy.deepcopy(model)
    stages, names, whole = _split(model, cut, virtual)
    x = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    lm_loss(whole(x), x).backward()  # the unsplit captured graph, on the same parameters
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    lm_loss(_chain(stages, x), x).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, want[name]), name
    # and the captured graph is the model (HF Llama's eager attention rounds differently: 1e-8)
    lm_loss(ref(x), x).backward()
    for name, p in ref.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=0, atol=1e-6), name  # type: ignore[arg-type]
    # names stay the model's; together the stages hold every parameter
    model_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    held = {n for s in stages for n, _ in s.named_parameters()}
    assert held <= model_names
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    # the blocks are submodules at their own paths (FSDP2 and checkpoint_wrapper apply to them)
    blocks = [n for s in stages for n, m in s.named_modules() if isinstance(m, fx.GraphModule) and n]
    assert len(blocks) == sum(1 for n in names if n not in ("embed", "head"))


def test_values_needing_no_input_are_recomputed_not_sent() -> None:
    stages, _, _ = _split(make_llama(), [2, 4])
    for stage in stages[1:]:  # only the residual stream crosses: rotary tables are recomputed
        inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
        assert len(inputs) == 1, [n.name for n in inputs]
    assert "rope_cos" not in stages[1].state_dict()  # a non-persistent buffer stays non-persistent


def test_outline_attention_for_selective_recompute() -> None:
    stages, _, _ = _split(make_gpt(), [3])
    block = stages[0].get_submodule("blocks.0")
    outlined, child = outline_attention(block, "blocks.0")  # type: ignore[arg-type]
    assert child == "attn"
    names = {n for n, _ in outlined.named_parameters()}
    assert "attn.c_attn.weight" in names and "mlp.c_fc.weight" in names
    x = torch.randn(2, SEQ, 32)
    assert torch.equal(outlined(x), block(x))


def test_bad_stage_layouts_are_clear_errors() -> None:
    names = ["embed", "b.0", "b.1", "head"]
    with pytest.raises(AutoparError, match="do not cover"):
        stage_chunks(names, [[["embed", "b.0"]], [["b.1"]]])
    with pytest.raises(AutoparError, match=r"chunk c on rank \[0, 1\]\[c\]"):
        stage_chunks(names, [[["embed", "b.1"]], [["b.0", "head"]]])
    v_shape = [[["embed"], ["head"]], [["b.0"], ["b.1"]]]  # rank 0: chunks 0 and 3; rank 1: 1 and 2
    in_v = stage_chunks(names, v_shape, lambda c: c if c < 2 else 3 - c)
    assert in_v == [["embed"], ["b.0"], ["b.1"], ["head"]]
    with pytest.raises(AutoparError, match="in order"):
        stage_chunks(names, v_shape)  # looped placement: chunk 1 on rank 1 is b.0, chunk 2 head


def test_outline_refuses_a_group_that_is_not_convex() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))
    b = g.call_function(torch.exp, (a,))  # outside the group, between its two nodes
    c = g.call_function(torch.add, (a, b))
    g.output(c)
    gm = fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(AutoparError, match="not convex"):
        outline(gm, lambda n: "grp" if n.name in ("neg", "add") else None)


def test_recompute_wraps_outlined_blocks_and_keeps_gradients_exact() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from autopar.passes.recompute import recompute
    from autopar.runtime.state import fqn

    model = make_gpt()
    stages, _, whole = _split(model, [3])
    x = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    lm_loss(whole(x), x).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    stages[0] = recompute(stages[0], {"blocks.0": "full", "blocks.1": "selective"})
    assert isinstance(stages[0].get_submodule("blocks.0"), CheckpointWrapper)
    assert isinstance(stages[0].get_submodule("blocks.1.attn"), CheckpointWrapper)
    assert not isinstance(stages[0].get_submodule("blocks.1.mlp"), CheckpointWrapper)
    names = {fqn(n) for n, _ in stages[0].named_parameters()}
    assert "blocks.0.attn.c_attn.weight" in names and "blocks.1.attn.c_proj.bias" in names
    lm_loss(_chain(stages, x), x).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, want[name]), name
