"""DeepSeek-V3-style decoder: multi-head latent attention, dense first layers, then MoE layers
of many fine-grained routed experts plus a shared one (DeepSeek-AI 2024, arXiv:2412.19437).

Faithful in what the planner prices — every matmul's shape, the experts' count, size and
top-k, the dense first layers — and simplified where it does not change a shape: routing takes
the top-k of sigmoid affinities without the node-limited group selection and without the
auxiliary-loss-free bias (§2.1.2), and there is no multi-token prediction module (§2.2). The
routed experts are grouped matmuls (``zoo.grouped``), dropless by default, so expert
parallelism applies. Shape of DeepSeek-V3 (671B): 61 layers (3 dense), dim 7168, 128 heads,
256 routed experts of hidden 2048 (top-8) and 1 shared, vocabulary 129280.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.configs import DeepSeekConfig, LlamaConfig
from autopar.zoo.grouped import GroupedExperts, routed
from autopar.zoo.llama import FeedForward, Llama, RMSNorm, TransformerBlock, rotate_half


class LatentAttention(nn.Module):
    """MLA (§2.1.1): queries through a rank-``q_lora_rank`` bottleneck; keys and values from one
    rank-``kv_lora_rank`` latent, plus a rotary key part shared by all heads."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.cfg, H = cfg, cfg.n_head
        qk = cfg.qk_nope_dim + cfg.qk_rope_dim
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(H * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (B, T, _) = self.cfg, x.shape
        H, nope, rope = c.n_head, c.qk_nope_dim, c.qk_rope_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, H, nope + rope).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, H, nope + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        k_rope = k_rope.view(B, 1, T, rope)
        q_rope = q_rope * cos + rotate_half(q_rope) * sin
        k_rope = k_rope * cos + rotate_half(k_rope) * sin
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, T, rope)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/√(nope + rope)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * c.v_head_dim))


class DeepSeekMoE(nn.Module):
    """Shared experts every token passes, plus top-k of the routed ones weighted by their
    normalised sigmoid affinities × ``routed_scale`` (§2.1.2, Eq. 12–16)."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.top_k, self.capacity_factor, self.scale = cfg.top_k, cfg.capacity_factor, cfg.routed_scale
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.ffn_dim)
        self.shared = FeedForward(cfg.dim, cfg.ffn_dim * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        xs = x.reshape(B * T, H)
        affinity = torch.sigmoid(self.gate(xs).float())
        weights, chosen = torch.topk(affinity, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True) * self.scale).to(x.dtype)
        return self.shared(x) + routed(self.experts, xs, weights, chosen, self.capacity_factor).view(B, T, H)


def block(cfg: LlamaConfig, layer: int) -> TransformerBlock:
    """Block ``layer``: MLA, then a dense FFN in the first ``n_dense_layers``, experts after."""
    assert isinstance(cfg, DeepSeekConfig)
    dense = layer < cfg.n_dense_layers
    ffn = FeedForward(cfg.dim, cfg.dense_ffn_dim) if dense else DeepSeekMoE(cfg)
    return TransformerBlock(cfg, ffn=ffn, attention=LatentAttention(cfg))


class DeepSeekV3(Llama):
    """Token ids (B, T) → logits (B, T, V)."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__(cfg, block_factory=block, rope_dim=cfg.qk_rope_dim)
