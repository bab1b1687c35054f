"""Recompute policies on one process: every policy's gradients are bit-identical to no
recompute, and the bytes a block keeps, measured, are what the cost model predicts."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from autopar.cluster import Cluster
from autopar.cost_models.memory import layer_activation_bytes
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.recompute import kept_bytes
from autopar.graph import capture
from autopar.graph.objective import LOGITS, without_cache
from autopar.measure.saved import retained_bytes
from autopar.passes.pipeline_split import outline_blocks
from autopar.passes.recompute import recompute
from autopar.planner.recompute_ilp import frontier
from autopar.zoo import GPT, GPTConfig, Llama, LlamaConfig, hf

B, S, VOCAB = 2, 32, 64


def zoo_llama() -> nn.Module:
    cfg = LlamaConfig(n_layer=5, dim=64, n_head=4, n_kv_head=2, ffn_dim=160, vocab_size=VOCAB, max_seq_len=S)
    return Llama(cfg)


def zoo_gpt() -> nn.Module:
    return GPT(GPTConfig(n_layer=5, n_embd=64, n_head=4, vocab_size=VOCAB, block_size=S))


def hf_llama() -> nn.Module:
    return hf.family("llama", layers=5, vocab=VOCAB, seq=S)


def hf_deepseek() -> nn.Module:
    """MLA fills its query in place (``new_empty`` + ``copy_``): such a tensor is never kept."""
    return hf.family("deepseek-v3", layers=5, vocab=VOCAB, seq=S)


def _call(model: nn.Module, tokens: torch.Tensor) -> object:
    """The model on ``tokens`` as the runtime calls it (``use_cache=False`` where it takes one)."""
    args, kwargs = without_cache(model, LOGITS).inputs(tokens)
    return model(*args, **kwargs)


def _grads(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    out = _call(model, tokens)
    out = getattr(out, "logits", out)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


def _block_bytes(model: nn.Module, path: str, tokens: torch.Tensor) -> int:
    """What the block at ``path`` keeps for backward, measured on its own arguments in the model."""
    block = model.get_submodule(path)
    seen: dict[str, tuple] = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.setdefault("in", (a, k)), with_kwargs=True)
    with torch.no_grad():
        _call(model, tokens)
    hook.remove()
    args, kwargs = seen["in"]
    return retained_bytes(block, lambda: (torch.randn_like(args[0]).requires_grad_(), args[1:], kwargs))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "as_graph"),
    [
        (zoo_llama, False),
        (zoo_gpt, False),
        (zoo_llama, True),
        (hf_llama, True),
        (hf_deepseek, True),
        (hf_llama, False),
    ],
)
def test_every_policy_is_exact_and_keeps_the_predicted_bytes(
    make: Callable[[], nn.Module], as_graph: bool
) -> None:
    """As written (the runtime's data-parallel path) and as the outlined graph (its TP/PP path).
    Hugging Face Llama as written attends without a mask (``is_causal``) where its capture passes
    one, so its calls differ from the captured ones: exact, its bytes not compared."""
    torch.manual_seed(0)
    model = make().float()
    cap = capture(model, batch=B, seq=S)
    prof = ModelProfile.from_captured(cap)
    block = prof.layer_types[prof.layers[1]]
    policies = frontier(prof, Cluster.preset("cpu"), "fp32")
    assert len(policies) >= 2, [p.summary for p in policies]
    names = [layer.name for layer in cap.layers]
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))

    written = outline_blocks(cap.gm, names) if as_graph else model

    def build(choice: str) -> nn.Module:
        return recompute(copy.deepcopy(written), dict.fromkeys(names[1:-1], choice), policies)

    reference = _grads(build("none"), tokens)
    for choice in ("none", "full", *(p.name for p in policies)):
        built = build(choice)
        grads = _grads(built, tokens)
        assert all(torch.equal(grads[n], g) for n, g in reference.items()), choice
        policy = next((p for p in policies if p.name == choice), None)
        predicted = (
            kept_bytes(block, frozenset(policy.keep), tp=1, sp=False, input_bytes=prof.input_bytes)
            if policy
            else layer_activation_bytes(block, tp=1, sp=False, recompute=choice, input_bytes=prof.input_bytes)
        )
        if as_graph or make is not hf_llama:
            measured = _block_bytes(built, names[2], tokens)
            assert predicted == pytest.approx(measured, rel=0.02), (choice, policy and policy.summary)


def test_policy_counts_each_operator_per_forward() -> None:
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from autopar.passes.recompute import policy_fn

    decide = policy_fn(frozenset({"mm#1", "sdpa#0"}))
    forward = SelectiveCheckpointContext(is_recompute=False)
    mm, attn = torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    got = [decide(forward, op) for op in (mm, mm, attn, mm)]
    assert got == [
        CheckpointPolicy.PREFER_RECOMPUTE,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.MUST_SAVE,  # every fused attention kernel is one "sdpa"
        CheckpointPolicy.PREFER_RECOMPUTE,
    ]
    again = SelectiveCheckpointContext(is_recompute=True)  # counted apart (older torch asks again)
    assert decide(again, mm) == CheckpointPolicy.PREFER_RECOMPUTE
    assert decide(again, mm) == CheckpointPolicy.MUST_SAVE
