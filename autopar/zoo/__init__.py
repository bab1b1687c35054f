"""Built-in models, constructible on the meta device at any size.

``build("gpt3-175b")`` returns an ``nn.Module`` whose parameters live on the
meta device (no memory); ``build(name, device="cpu")`` materialises it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from autopar.errors import ModelSpecError
from autopar.zoo.gpt import GPT, GPTConfig
from autopar.zoo.llama import Llama, LlamaConfig
from autopar.zoo.mixtral import Mixtral, MixtralConfig


@dataclass(frozen=True, kw_only=True)
class ZooEntry:
    """A named built-in model."""

    name: str
    """Short lower-case name, e.g. ``"llama3-70b"``."""
    family: str
    """``gpt``, ``llama`` or ``mixtral``."""
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

    def factory(self) -> Callable[[], nn.Module]:
        cls: Callable[..., nn.Module] = {"gpt": GPT, "llama": Llama, "mixtral": Mixtral}[self.family]
        return lambda: cls(self.config)


def _gpt(name: str, l: int, h: int, a: int, source: str, V: int = 51200, s: int = 2048) -> ZooEntry:  # noqa: E741
    cfg = GPTConfig(n_layer=l, n_embd=h, n_head=a, vocab_size=V, block_size=s)
    return ZooEntry(name=name, family="gpt", config=cfg, source=source)


_GPT2 = "Radford et al. 2019 (GPT-2), V=50257, s=1024"
_MEGATRON = "Narayanan et al. SC'21 Table 1, V=51200, s=2048"
_LLAMA3 = "Llama 3 (Dubey et al. 2024, Table 3)"


def _llama(name: str, layers: int, dim: int, heads: int, ffn: int) -> ZooEntry:
    """Llama 3: 8 key/value heads, V=128256, RoPE θ=500000 at every size."""
    cfg = LlamaConfig(n_layer=layers, dim=dim, n_head=heads, n_kv_head=8, ffn_dim=ffn)
    return ZooEntry(name=name, family="llama", config=cfg, source=_LLAMA3)


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
    ]
}
"""Built-in models by name, in listing order."""


def build(
    name: str,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    blocks: int | None = None,
) -> nn.Module:
    """Construct zoo model ``name`` on ``device`` with parameters in ``dtype`` (with ``blocks``
    blocks instead of its own when given: a shallow copy the planner captures in its place)."""
    if name not in ZOO:
        raise ModelSpecError(
            f"unknown model {name!r}; built-in models are {', '.join(ZOO)} "
            "(or give path/to/file.py:factory or package.module:factory)"
        )
    entry = ZOO[name]
    if blocks is not None:
        entry = replace(entry, config=replace(entry.config, n_layer=blocks))
    with torch.device(device):
        model = entry.factory()()
    return model.to(dtype)


__all__ = [
    "GPT",
    "ZOO",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Mixtral",
    "MixtralConfig",
    "ZooEntry",
    "build",
]
