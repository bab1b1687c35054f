"""Built-in models, constructible on the meta device at any size.

``build("gpt3-175b")`` returns an ``nn.Module`` whose parameters live on the
meta device (no memory); ``build(name, device="cpu")`` materialises it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.lazy import lazy_attributes
from autopar.zoo.configs import DeepSeekConfig, GPTConfig, LlamaConfig, MixtralConfig
from autopar.zoo.registry import ZOO, ZooEntry

if TYPE_CHECKING:
    from autopar.zoo.deepseek import DeepSeekV3
    from autopar.zoo.gpt import GPT
    from autopar.zoo.llama import Llama
    from autopar.zoo.mixtral import Mixtral
    from autopar.zoo.models import build

_MODULES = {
    "DeepSeekV3": "autopar.zoo.deepseek",
    "GPT": "autopar.zoo.gpt",
    "Llama": "autopar.zoo.llama",
    "Mixtral": "autopar.zoo.mixtral",
    "build": "autopar.zoo.models",
}
"""The names that need torch, imported on first use (PEP 562): the registry and the shapes do
not, so the planner's warm path never imports torch."""


__getattr__ = lazy_attributes(__name__, _MODULES)


__all__ = [
    "GPT",
    "ZOO",
    "DeepSeekConfig",
    "DeepSeekV3",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Mixtral",
    "MixtralConfig",
    "ZooEntry",
    "build",
]
