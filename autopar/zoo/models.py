"""Built-in models constructed: ``build(name)`` on the meta device (no memory) or any other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from autopar.errors import ModelSpecError
from autopar.zoo.gpt import GPT
from autopar.zoo.llama import Llama
from autopar.zoo.mixtral import Mixtral
from autopar.zoo.registry import ZOO


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
    cls: Callable[..., nn.Module] = {"gpt": GPT, "llama": Llama, "mixtral": Mixtral}[entry.family]
    with torch.device(device):
        model = cls(entry.config)
    return model.to(dtype)


__all__ = ["build"]
