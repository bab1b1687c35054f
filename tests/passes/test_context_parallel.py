"""Context parallelism's pieces without a process group: the head-tail chunks balance causal
attention, the gather's order inverts, ``cp_attention`` on every rank's chunks is exact causal
attention, and the pass rewrites positions and attention of a captured Llama (or refuses)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.errors import AutoparError
from autopar.graph.meta import capture_as
from autopar.passes import context_parallel as cpp
from autopar.zoo import GPT, GPTConfig, Llama, LlamaConfig

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_head_tail_chunks_balance_causal_attention(cp: int) -> None:
    """Every rank's positions are distinct, cover the sequence, and see the same number of
    (query, key) pairs under a causal mask: the work of each rank is 1/cp of the whole."""
    seq = 8 * cp
    ranks = [cpp.local_positions(r, cp, seq) for r in range(cp)]
    assert sorted(torch.cat(ranks).tolist()) == list(range(seq))
    pairs = [int((pos + 1).sum()) for pos in ranks]  # query i sees keys 0..i
    assert len(set(pairs)) == 1 and sum(pairs) == seq * (seq + 1) // 2
    gathered = torch.cat(ranks)[None, :, None]  # an all-gather's rank order, on a middle dim
    assert torch.equal(cpp.sequence_order(gathered, 1, cp), torch.arange(seq)[None, :, None])
    assert torch.equal(cpp.rank_order(cpp.sequence_order(gathered, 1, cp), 1, cp), gathered)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_is_exact_causal_attention(monkeypatch, cp: int) -> None:
    torch.manual_seed(0)
    b, h, seq, d = 2, 3, 8 * cp, 4
    q, k, v = (torch.randn(b, h, seq, d, dtype=torch.float64) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        pos = cpp.local_positions(rank, cp, seq)
        whole_kv = iter([k, v, k, v])  # what the gathers return: every rank's keys, then values
        monkeypatch.setattr(cpp, "gather_sequence", lambda x, dim, group, n, kv=whole_kv: next(kv))
        mine = cpp.cp_attention(
            q[:, :, pos], k[:, :, pos], v[:, :, pos], causal=True, scale=None, enable_gqa=False,
            group="", rank=rank, cp=cp,
        )  # fmt: skip
        torch.testing.assert_close(mine, whole[:, :, pos], rtol=0, atol=1e-12)
        wrong = lambda g, c: g * c + c // 2 if g else c  # noqa: E731  (offset off by half a chunk)
        monkeypatch.setattr(cpp, "visible_keys", wrong)
        bad = cpp.cp_attention(
            q[:, :, pos], k[:, :, pos], v[:, :, pos], causal=True, scale=None, enable_gqa=False,
            group="", rank=rank, cp=cp,
        )  # fmt: skip
        assert (bad - whole[:, :, pos]).abs().max() > 1e-3
        monkeypatch.undo()


LLAMA = LlamaConfig(n_layer=2, dim=48, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=80, max_seq_len=64)


def _captured(model: torch.nn.Module, seq: int, cp: int) -> torch.fx.GraphModule:
    return capture_as(model, batch=2, seq=seq // cp, dtype=None).gm


def test_pass_rewrites_positions_and_attention() -> None:
    """The token input keeps this rank's positions, the rotary tables their rows, and each
    attention becomes ``cp_attention`` (causal); the graph then runs on whole sequences."""
    torch.manual_seed(0)
    model = Llama(LLAMA)
    gm = cpp.context_parallel(_captured(model, 24, 2), cp=2, rank=1, group="g", seq=24)
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(cpp.cp_attention) == LLAMA.n_layer
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    selects = [n for n in gm.graph.nodes if n.target == torch.ops.aten.index_select.default]
    assert {str(n.args[0]) for n in selects} == {"tokens", "rope_cos", "rope_sin"}
    attentions = [n for n in gm.graph.nodes if n.target is cpp.cp_attention]
    assert all(n.kwargs["causal"] and n.kwargs["rank"] == 1 for n in attentions)
    # keys and values gathered before the grouped-query repeat (2 kv heads → 4 query heads)
    assert all(n.kwargs["repeat"] == 2 and n.args[1].meta["val"].shape[1] == 2 for n in attentions)
    assert torch.equal(getattr(gm, cpp.POSITIONS), torch.tensor([6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]))


def test_hugging_face_mask_is_read_as_causal() -> None:
    """Hugging Face's Llama builds its causal mask from positions: evaluated, it is causal."""
    from autopar.zoo import hf

    gm = cpp.context_parallel(_captured(hf.llama(seq=64), 24, 2), cp=2, rank=0, group="g", seq=24)
    kinds = [(n.kwargs["causal"], n.kwargs["repeat"]) for n in gm.graph.nodes if n.target is cpp.cp_attention]
    assert kinds == [(True, 2), (True, 2)]
    assert not any(n.target == torch.ops.aten.arange.default and n.args == (12,) for n in gm.graph.nodes)


def test_attention_by_hand_and_short_tables_are_refused() -> None:
    """A softmax written by hand (GPT's Megatron-style math attention) and a position table
    shorter than the sequence are one-line errors, not silently wrong training."""
    gpt = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=32, attention="math"))
    with pytest.raises(AutoparError, match=r"softmax|scaled_dot_product_attention"):
        cpp.context_parallel(_captured(gpt, 24, 2), cp=2, rank=0, group="g", seq=24)
    short = Llama(LlamaConfig(**{**LLAMA.__dict__, "max_seq_len": 16}))
    with pytest.raises(AutoparError, match="fewer than the sequence"):
        cpp.context_parallel(_captured(short, 24, 2), cp=2, rank=0, group="g", seq=24)


def test_a_model_training_its_own_loss_is_refused_before_any_rank_starts() -> None:
    """A rank holds part of each sequence, so cp trains next-token cross-entropy on the logits:
    nanoGPT's own ``forward(idx, targets)`` loss is refused where the loss is resolved (what
    ``parallelize`` and ``autopar verify`` call first), in one line; at cp 1 it is kept."""
    from autopar.runtime.loss import own_loss, resolve_objective
    from tests.autopar.runtime.nanogpt import nanogpt

    model = nanogpt()
    assert resolve_objective(model, None, cp=1)[1] is own_loss
    with pytest.raises(AutoparError, match=r"context parallelism \(cp 2\) trains next-token"):
        resolve_objective(model, None, cp=2)


def test_masks_are_read_on_a_short_probe_capture() -> None:
    """At s/cp positions above ``MASK_PROBE`` the masks are read on the same model captured at
    ``MASK_PROBE`` positions (a mask at 65,536 positions per rank would take tens of GB)."""
    from autopar.zoo import hf

    model = hf.llama(seq=256)
    probe = capture_as(model, batch=1, seq=cpp.MASK_PROBE, dtype=None).gm
    gm = cpp.context_parallel(_captured(model, 160, 2), cp=2, rank=1, group="g", seq=160, probe=probe)
    assert [n.kwargs["causal"] for n in gm.graph.nodes if n.target is cpp.cp_attention] == [True, True]


def test_a_sliding_window_model_is_refused_before_any_rank_starts() -> None:
    """Hugging Face's Mistral attends within a window (32 positions at this size): a window
    shorter than the mask probe would pass for causal, so its config refuses cp in one line."""
    import functools

    from autopar.runtime.distributed import check_model
    from autopar.zoo import hf
    from tests.conftest import plan_for

    make = functools.partial(hf.family, "mistral", seq=128)
    model = make()
    assert model.config.sliding_window == 32
    plan = plan_for(make, batch=4, seq=64, gpus=2, cp=2, dp=1, zero=3)
    with pytest.raises(AutoparError, match="sliding window of 32 positions; context parallelism"):
        check_model(model, plan)
    check_model(model, plan_for(make, batch=4, seq=64, gpus=2, cp=1, dp=2, zero=3))
