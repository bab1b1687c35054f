"""The shapes of the built-in models: plain dataclasses, importable without torch (the zoo's
registry and the planner's capture cache name models by them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model."""

    n_layer: int
    """Number of transformer blocks (l)."""
    n_embd: int
    """Hidden size (h)."""
    n_head: int
    """Attention heads (a); must divide n_embd."""
    vocab_size: int = 51200
    """Vocabulary size (V)."""
    block_size: int = 2048
    """Maximum sequence length (s), the size of the position table."""
    attention: str = "sdpa"
    """``sdpa`` (F.scaled_dot_product_attention, flash where available) or ``math``
    (explicit QKᵀ, masked softmax and attention dropout, as Megatron-LM ran in 2021–22)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention scores and both residual branches."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"attention must be 'sdpa' or 'math', got {self.attention!r}")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama model."""

    n_layer: int
    """Number of transformer blocks."""
    dim: int
    """Hidden size."""
    n_head: int
    """Query heads; must divide dim."""
    n_kv_head: int
    """Key/value heads (grouped-query attention); must divide n_head."""
    ffn_dim: int
    """Width of the SwiGLU feed-forward layer."""
    vocab_size: int = 128256
    """Vocabulary size."""
    max_seq_len: int = 8192
    """Length of the rotary tables."""
    rope_theta: float = 500000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_scaling: float = 1.0
    """Llama 3.1's rotary frequency scaling factor for long context (8 for its 131,072 positions,
    from an original 8,192; 1: none). Meta's ``apply_scaling``: wavelengths above 8192 / 1 are
    divided by it, below 8192 / 4 kept, smoothly between (``zoo.llama.rope_tables``)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"dim={self.dim}, n_head={self.n_head}, n_kv_head={self.n_kv_head}: "
                "n_head must divide dim and n_kv_head must divide n_head"
            )


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(LlamaConfig):
    """Shape of a Mixtral model: a Llama config plus the MoE fields."""

    n_experts: int = 8
    """Experts per MoE layer (E)."""
    top_k: int = 2
    """Experts each token is routed to (k)."""
    capacity_factor: float | None = None
    """Token rows per expert relative to an even split (k·S/E); tokens past them are dropped.
    None: dropless, every token reaches its k experts (Mixtral's own)."""


@dataclass(frozen=True, kw_only=True)
class DeepSeekConfig(MixtralConfig):
    """Shape of a DeepSeek-V3 model (DeepSeek-AI 2024, arXiv:2412.19437, §2 and §4.2): a Mixtral
    config (``ffn_dim``: one routed expert's) plus multi-head latent attention, shared experts
    and dense first layers. ``n_kv_head`` is unused (MLA's keys and values come from one latent)."""

    n_dense_layers: int = 3
    """First layers with a dense FFN instead of experts."""
    dense_ffn_dim: int = 18432
    """Hidden size of those dense FFNs."""
    n_shared_experts: int = 1
    """Experts every token passes through, beside its routed ones."""
    q_lora_rank: int = 1536
    """Rank of the queries' low-rank projection."""
    kv_lora_rank: int = 512
    """Rank of the keys' and values' shared latent (what inference caches)."""
    qk_nope_dim: int = 128
    """Per-head query/key dims without rotary embedding."""
    qk_rope_dim: int = 64
    """Per-head query/key dims with rotary embedding (the keys' part shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    routed_scale: float = 2.5
    """Factor on the routed experts' normalised weights."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.n_dense_layers <= self.n_layer:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be within 0..n_layer={self.n_layer}")


def block_runs(config: GPTConfig | LlamaConfig) -> tuple[int, ...]:
    """The model's blocks as runs of alike blocks, in order: (n_layer,), or DeepSeek-V3's
    (dense, MoE) counts."""
    dense = getattr(config, "n_dense_layers", 0)
    return (dense, config.n_layer - dense) if 0 < dense < config.n_layer else (config.n_layer,)


def with_block_runs(config: Any, runs: tuple[int, ...]) -> Any:
    """``config`` with ``runs`` blocks (``block_runs``'s form): a shallow copy's shape."""
    if len(runs) == 2:
        return replace(config, n_dense_layers=runs[0], n_layer=sum(runs))
    return replace(config, n_layer=runs[0])


__all__ = ["DeepSeekConfig", "GPTConfig", "LlamaConfig", "MixtralConfig", "block_runs", "with_block_runs"]
