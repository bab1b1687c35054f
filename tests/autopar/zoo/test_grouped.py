"""The zoo's grouped experts: ``autopar::grouped_mm`` against per-expert matmuls (values and
float64 gradients), routing (dropless and with a capacity) against a per-token loop, capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar import capture
from autopar.graph.experts import expert_groups
from autopar.zoo.configs import MixtralConfig
from autopar.zoo.grouped import grouped_mm, route
from autopar.zoo.mixtral import Mixtral, MoE

CFG = dict(n_layer=2, dim=32, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=64, max_seq_len=32)


@pytest.mark.parametrize("offs", [[3, 7, 10], [0, 6, 6], [2, 5, 8]])
def test_grouped_mm_is_a_matmul_per_expert(offs: list[int]) -> None:
    """Expert e multiplies rows offs[e-1]:offs[e]; an expert with no rows is skipped; rows past
    offs[-1] (a capacity layout's empty tail) give zeros. Gradients checked in float64."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 16, 8, dtype=torch.float64, generator=g, requires_grad=True)
    o = torch.tensor(offs, dtype=torch.int32)
    y = grouped_mm(x, w, o)
    starts = [0, *offs[:-1]]
    want = torch.zeros(10, 8, dtype=torch.float64)
    for e, (a, b) in enumerate(zip(starts, offs, strict=True)):
        want[a:b] = x[a:b] @ w[e]
    assert torch.equal(y, want)
    assert torch.autograd.gradcheck(lambda x, w: grouped_mm(x, w, o), (x, w))


def _per_token(moe: MoE, xs: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer one token and choice at a time (``keep``: which (token, choice) are computed)."""
    w, chosen = torch.topk(moe.gate(xs), moe.top_k, dim=-1)
    w = F.softmax(w.float(), dim=-1).to(xs.dtype)
    ex, out = moe.experts, torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        for j in range(moe.top_k):
            if keep is None or keep[t * moe.top_k + j]:
                e = chosen[t, j]
                h = F.silu(xs[t] @ ex.w1[e]) * (xs[t] @ ex.w3[e])
                out[t] += w[t, j] * (h @ ex.w2[e])
    return out


def test_dropless_moe_computes_every_token_and_a_capacity_drops_the_late_ones() -> None:
    torch.manual_seed(0)
    moe = Mixtral(MixtralConfig(**CFG, n_experts=4, top_k=2)).double().layers[0].feed_forward
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    xs = x.reshape(12, 32)
    # dropless: what a loop over tokens computes (the routing weights' softmax runs in float32)
    assert torch.allclose(moe(x).reshape(12, 32), _per_token(moe, xs), rtol=0, atol=1e-9)
    # capacity C = ceil(2·12/4 · 0.5) = 3 rows per expert, filled in token order
    moe.capacity_factor = 0.5
    _, chosen = torch.topk(moe.gate(xs), 2, dim=-1)
    flat = chosen.reshape(-1)
    seen = [int((flat[:i] == flat[i]).sum()) for i in range(len(flat))]  # earlier rows of its expert
    keep = torch.tensor([s < 3 for s in seen])
    assert not keep.all()  # the case drops tokens
    assert torch.allclose(moe(x).reshape(12, 32), _per_token(moe, xs, keep), rtol=0, atol=1e-9)
    rows, offs, where = route(xs, chosen, 4, 0.5)
    assert rows.shape == (12, 32) and offs.tolist() == [3, 6, 9, 12]
    assert int((where == 12).sum()) == int((~keep).sum())  # the dropped read the zero row


def test_zoo_mixtral_captures_its_experts_as_grouped_matmuls() -> None:
    with torch.device("meta"):
        model = Mixtral(MixtralConfig(**CFG, n_experts=4, top_k=2))
    cap = capture(model, batch=2, seq=16)
    groups = expert_groups(cap.gm)
    assert [g.path for g in groups] == [f"layers.{i}.feed_forward.experts" for i in range(2)]
    assert all(g.experts == 4 and g.rows == 2 * 16 * 2 and len(g.entries) == 2 for g in groups)
    # the experts' FLOPs: 2 · rows · 3 · dim · ffn per layer, top-2 of 4 (half the expert weights)
    flops = sum(n.meta.get("autopar.fwd_flops", 0) for g in groups for n in g.matmuls)
    assert flops == 2 * (2 * 64 * 3 * 32 * 48)  # 2 layers
