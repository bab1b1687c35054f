"""The built-in models by name: their shapes and sources (``ZOO``), without torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopar.errors import ModelSpecError
from autopar.zoo.configs import DeepSeekConfig, GPTConfig, LlamaConfig, MixtralConfig


@dataclass(frozen=True, kw_only=True)
class ZooEntry:
    """A named built-in model."""

    name: str
    """Short lower-case name, e.g. ``"llama3-70b"``."""
    family: str
    """``gpt``, ``llama``, ``mixtral`` or ``deepseek``."""
    config: GPTConfig | LlamaConfig
    """The model's shape."""
    source: str
    """Where the shape comes from."""

    @property
    def default_seq(self) -> int:
        """Sequence length the model was trained at (used when --seq is not given)."""
        if isinstance(self.config, GPTConfig):
            return self.config.block_size
        return self.config.max_seq_len


def _gpt(name: str, l: int, h: int, a: int, source: str, V: int = 51200, s: int = 2048) -> ZooEntry:  # noqa: E741
    cfg = GPTConfig(n_layer=l, n_embd=h, n_head=a, vocab_size=V, block_size=s)
    return ZooEntry(name=name, family="gpt", config=cfg, source=source)


_GPT2 = "Radford et al. 2019 (GPT-2), V=50257, s=1024"
_MEGATRON = "Narayanan et al. SC'21 Table 1, V=51200, s=2048"
_LLAMA3 = "Llama 3 (Dubey et al. 2024, Table 3)"


_LLAMA31 = (
    "Llama 3.1 (Dubey et al. 2024, Table 3; 131,072 positions after the long-context stage, §3.4.2; "
    "rotary scaling 8 as in Meta's model code)"
)


def _llama(name: str, layers: int, dim: int, heads: int, ffn: int, *, long: bool = False) -> ZooEntry:
    """Llama 3: 8 key/value heads, V=128256, RoPE θ=500000 at every size; ``long``: Llama 3.1,
    the same shapes at 131,072 positions."""
    cfg = LlamaConfig(n_layer=layers, dim=dim, n_head=heads, n_kv_head=8, ffn_dim=ffn)
    if long:
        cfg = dataclasses.replace(cfg, max_seq_len=131072, rope_scaling=8.0)
    return ZooEntry(name=name, family="llama", config=cfg, source=_LLAMA31 if long else _LLAMA3)


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        _gpt("gpt2", 12, 768, 12, _GPT2, V=50257, s=1024),
        _gpt("gpt2-medium", 24, 1024, 16, _GPT2, V=50257, s=1024),
        _gpt("gpt2-large", 36, 1280, 20, _GPT2, V=50257, s=1024),
        _gpt("gpt2-xl", 48, 1600, 25, _GPT2, V=50257, s=1024),
        _gpt("megatron-1.7b", 24, 2304, 24, _MEGATRON),
        _gpt("megatron-3.6b", 30, 3072, 32, _MEGATRON),
        _gpt("megatron-7.5b", 36, 4096, 32, _MEGATRON),
        _gpt("megatron-18.4b", 40, 6144, 48, _MEGATRON),
        _gpt("megatron-39.1b", 48, 8192, 64, _MEGATRON),
        _gpt("megatron-76.1b", 60, 10240, 80, _MEGATRON),
        _gpt("megatron-145.6b", 80, 12288, 96, _MEGATRON),
        _gpt("gpt3-175b", 96, 12288, 96, "Brown et al. 2020 (GPT-3), V=51200, s=2048"),
        _gpt("megatron-310.1b", 96, 16384, 128, _MEGATRON),
        _gpt("megatron-529.6b", 105, 20480, 128, _MEGATRON),
        _gpt("megatron-1t", 128, 25600, 160, _MEGATRON),
        _llama("llama3-8b", 32, 4096, 32, 14336),
        _llama("llama3-70b", 80, 8192, 64, 28672),
        _llama("llama3-405b", 126, 16384, 128, 53248),
        _llama("llama3.1-8b", 32, 4096, 32, 14336, long=True),
        _llama("llama3.1-70b", 80, 8192, 64, 28672, long=True),
        _llama("llama3.1-405b", 126, 16384, 128, 53248, long=True),
        ZooEntry(
            name="mixtral-8x7b",
            family="mixtral",
            config=MixtralConfig(
                n_layer=32,
                dim=4096,
                n_head=32,
                n_kv_head=8,
                ffn_dim=14336,
                vocab_size=32000,
                max_seq_len=32768,
                rope_theta=1e6,
                n_experts=8,
                top_k=2,
            ),
            source="Jiang et al. 2024 (Mixtral of Experts)",
        ),
        ZooEntry(
            name="deepseek-v3-671b",
            family="deepseek",
            config=DeepSeekConfig(
                n_layer=61,
                dim=7168,
                n_head=128,
                n_kv_head=128,
                ffn_dim=2048,
                vocab_size=129280,
                max_seq_len=4096,
                rope_theta=10000.0,
                n_experts=256,
                top_k=8,
                norm_eps=1e-6,
                n_dense_layers=0,  # V3 has 3; the planner prices one repeated block type
            ),
            source="DeepSeek-AI 2024 (DeepSeek-V3, arXiv:2412.19437), pre-trained at s=4096; stand-in: "
            "all 61 layers MoE (V3's first 3 are dense), routing without group limits or balancing "
            "bias, no MTP module",
        ),
    ]
}
"""Built-in models by name, in listing order."""


def max_seq(spec: str, module: Any = None) -> int | None:
    """The longest sequence the model's configuration allows (a zoo model's trained length; a
    config's ``block_size``, ``n_positions`` or ``max_position_embeddings``), None if it states none."""
    if spec in ZOO:
        return ZOO[spec].default_seq
    config = getattr(module, "config", None)
    for key in ("block_size", "max_seq_len", "n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_seq(spec: str, seq: int | None, *, dtype: str = "bf16") -> int:
    """The sequence length to use for MODEL ``spec``: ``seq``, or the model's own; one that the
    model's configuration does not allow is an error."""
    if spec in ZOO:
        module = None
    else:
        from autopar.zoo.spec import resolve  # builds the model (torch): not for a built-in one

        module = resolve(spec, dtype=dtype).module
    limit = max_seq(spec, module)
    chosen = seq or limit or 1024
    if limit is not None and chosen > limit:
        raise ModelSpecError(
            f"--seq {chosen} exceeds the {limit} positions {spec!r} allows; use --seq {limit} or less "
            "(or a model configured for longer sequences)"
        )
    return chosen


__all__ = ["ZOO", "ZooEntry", "max_seq", "model_seq"]
