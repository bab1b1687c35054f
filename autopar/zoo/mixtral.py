"""Mixtral-style sparse mixture-of-experts decoder (Llama blocks with a top-k MoE FFN).

The MoE layer dispatches with a fixed expert capacity (GShard/Switch style,
capacity C = ceil(k·S/E · capacity_factor) token slots per expert), so every
shape is static and the graph can be captured; overflowing tokens are dropped
as in those systems. Experts are a ModuleList of SwiGLU MLPs, each applied to
its (C, dim) slice, so the FLOPs are k·S tokens' worth, not E·S.
Shape of Mixtral-8x7B per Jiang et al. 2024 (32 layers, dim 4096, 8 experts, top-2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.configs import MixtralConfig
from autopar.zoo.llama import FeedForward, Llama, LlamaConfig, TransformerBlock


class MoE(nn.Module):
    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(cfg.dim, cfg.ffn_dim) for _ in range(cfg.n_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        E, k = len(self.experts), self.top_k
        xs = x.reshape(B * T, H)
        S = B * T
        C = math.ceil(k * S / E * self.capacity_factor)
        weights, chosen = torch.topk(self.gate(xs), k, dim=-1)  # (S, k)
        weights = F.softmax(weights.float(), dim=-1).to(x.dtype)
        flat = chosen.reshape(-1)  # (S·k,)
        onehot = F.one_hot(flat, E)  # (S·k, E)
        rank = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # position within its expert
        slot = torch.where(rank < C, flat * C + rank, torch.full_like(flat, E * C))
        token = torch.arange(S, device=x.device).repeat_interleave(k)
        buf = xs.new_zeros(E * C + 1, H).index_add(0, slot, xs[token])
        slots = buf[: E * C].view(E, C, H)
        out = torch.cat(
            [
                torch.stack([ex(slots[e]) for e, ex in enumerate(self.experts)]).view(E * C, H),
                xs.new_zeros(1, H),
            ]
        )
        y = out[slot] * weights.reshape(-1, 1)
        return y.view(S, k, H).sum(1).view(B, T, H)


class MoEBlock(TransformerBlock):
    def __init__(self, cfg: LlamaConfig) -> None:
        assert isinstance(cfg, MixtralConfig)
        super().__init__(cfg, ffn=MoE(cfg))


class Mixtral(Llama):
    """Token ids (B, T) → logits (B, T, V)."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__(cfg, block_factory=MoEBlock)
