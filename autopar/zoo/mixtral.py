"""Mixtral-style sparse mixture-of-experts decoder (Llama blocks with a top-k MoE FFN).

Each MoE layer's experts are grouped matmuls over expert-sorted token rows
(``zoo.grouped``, the layout of torchtitan and Hugging Face): dropless by
default, as Mixtral itself, or with a fixed expert capacity (GShard/Switch,
C = ceil(k·S/E · capacity_factor) rows per expert, overflowing tokens dropped).
Every shape is static either way, so the graph captures on meta, the FLOPs are
k·S tokens' worth (not E·S), and expert parallelism can move the rows.
Shape of Mixtral-8x7B per Jiang et al. 2024 (32 layers, dim 4096, 8 experts, top-2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.configs import MixtralConfig
from autopar.zoo.grouped import GroupedExperts, routed
from autopar.zoo.llama import Llama, LlamaConfig, TransformerBlock


class MoE(nn.Module):
    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = cfg.n_experts, cfg.top_k, cfg.capacity_factor
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        xs = x.reshape(B * T, H)
        weights, chosen = torch.topk(self.gate(xs), self.top_k, dim=-1)  # (S, k)
        weights = F.softmax(weights.float(), dim=-1).to(x.dtype)  # Mixtral: softmax over the top k
        return routed(self.experts, xs, weights, chosen, self.capacity_factor).view(B, T, H)


class MoEBlock(TransformerBlock):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        assert isinstance(cfg, MixtralConfig)
        super().__init__(cfg, ffn=MoE(cfg))


class Mixtral(Llama):
    """Token ids (B, T) → logits (B, T, V)."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__(cfg, block_factory=MoEBlock)
