"""Llama-3-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Written as a user would: the rotary cos/sin tables are buffers sliced to the
input length in ``forward``, key/value heads are repeated to the query heads
before ``F.scaled_dot_product_attention``, the output layer is untied.
Shapes per Meta's Llama 3 model card (Dubey et al. 2024, Table 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.configs import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.wq = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_head // self.n_kv_head
        k = k[:, :, None].expand(B, self.n_kv_head, rep, T, self.head_dim)
        v = v[:, :, None].expand(B, self.n_kv_head, rep, T, self.head_dim)
        k = k.reshape(B, self.n_head, T, self.head_dim)
        v = v.reshape(B, self.n_head, T, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(
        self, cfg: LlamaConfig, ffn: nn.Module | None = None, attention: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = attention if attention is not None else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = ffn if ffn is not None else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def rope_tables(cfg: LlamaConfig, head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, head_dim), rotate-half layout (head_dim: dim / n_head
    unless given)."""
    head_dim = head_dim or cfg.dim // cfg.n_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if cfg.rope_scaling != 1.0:
        inv_freq = llama31_scaled(inv_freq, cfg.rope_scaling)
    t = torch.arange(cfg.max_seq_len).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def llama31_scaled(inv_freq: torch.Tensor, factor: float, *, original: int = 8192) -> torch.Tensor:
    """Llama 3.1's rotary frequencies for long context (Meta's ``apply_scaling``, low and high
    frequency factors 1 and 4): wavelengths longer than ``original`` / 1 slowed by ``factor``,
    shorter than ``original`` / 4 kept, interpolated between."""
    low, high = original / 1.0, original / 4.0
    wavelen = 2 * torch.pi / inv_freq
    smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
    mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low, inv_freq / factor, mixed)
    return torch.where(wavelen < high, inv_freq, out)


class Llama(nn.Module):
    """Token ids (B, T) → logits (B, T, V)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self,
        cfg: LlamaConfig,
        block_factory: Callable[[LlamaConfig, int], nn.Module] | None = None,
        rope_dim: int | None = None,
    ) -> None:
        """``block_factory(cfg, i)`` makes block i (a ``TransformerBlock`` unless given);
        ``rope_dim``: the rotary tables' width (dim / n_head unless given)."""
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        make = block_factory or (lambda c, _: TransformerBlock(c))
        self.layers = nn.ModuleList([make(cfg, i) for i in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg, rope_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for m in self.modules():  # N(0, 0.02) weights; meta tensors hold no values
            if isinstance(m, nn.Linear | nn.Embedding) and not m.weight.is_meta:
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, T = tokens.shape
        h = self.tok_embeddings(tokens)
        cos = self.rope_cos[:T].to(h.dtype)
        sin = self.rope_sin[:T].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
