"""Built-in models constructed: ``build(name)`` on the meta device (no memory) or any other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from autopar.errors import ModelSpecError
from autopar.zoo.configs import with_block_runs
from autopar.zoo.deepseek import DeepSeekV3
from autopar.zoo.gpt import GPT
from autopar.zoo.llama import Llama
from autopar.zoo.mixtral import Mixtral
from autopar.zoo.registry import ZOO


def build(
    name: str,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.bfloat16,
    runs: tuple[int, ...] | None = None,
) -> nn.Module:
    """Construct zoo model ``name`` on ``device`` with parameters in ``dtype`` (with ``runs``
    blocks instead of its own when given, in ``configs.block_runs``' form: a shallow copy the
    planner captures in its place)."""
    if name not in ZOO:
        raise ModelSpecError(
            f"unknown model {name!r}; built-in models are {', '.join(ZOO)} "
            "(or give path/to/file.py:factory or package.module:factory)"
        )
    entry = ZOO[name]
    if runs is not None:
        entry = replace(entry, config=with_block_runs(entry.config, runs))
    families = {"gpt": GPT, "llama": Llama, "mixtral": Mixtral, "deepseek": DeepSeekV3}
    cls: Callable[..., nn.Module] = families[entry.family]
    with torch.device(device):
        model = cls(entry.config)
    if all(p.dtype == dtype for p in model.parameters()):
        return model  # (a cast that changes nothing swaps nothing: fake tensors refuse the swap)
    return model.to(dtype)


__all__ = ["build"]
