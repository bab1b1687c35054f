"""The shapes of the built-in models: plain dataclasses, importable without torch (the zoo's
registry and the planner's capture cache name models by them)."""

from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["GPTConfig", "LlamaConfig", "MixtralConfig"]
