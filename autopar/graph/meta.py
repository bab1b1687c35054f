"""Meta parameters: capture a model whose parameters are on the meta device (``meta_parameters``)
and allocate only the parts a rank keeps."""

from __future__ import annotations

import torch
from torch import nn

from autopar.graph import CapturedModel, capture
from autopar.graph.trace import retarget


def set_buffers(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put each tensor of ``values`` (buffer name → tensor) in place of that buffer."""
    for name, b in values.items():
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._buffers[attr] = b


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta tensors on ``device`` (``to_empty``, which FSDP2 follows),
    keeping the values of buffers that already had them (rotary tables)."""
    real = {name: b.to(device) for name, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    set_buffers(module, real)


def capture_with_meta_parameters(model: nn.Module, *, batch: int, seq: int) -> CapturedModel:
    """``capture``, also for a model with meta parameters and real buffers (``meta_parameters``):
    the buffers are traced as meta tensors, and the graph then reads the real ones."""
    real = {n: b for n, b in model.named_buffers() if not b.is_meta}
    if not real or not any(p.is_meta for p in model.parameters()):
        return capture(model, batch=batch, seq=seq)

    set_buffers(model, {n: b.to("meta") for n, b in real.items()})
    try:
        captured = capture(model, batch=batch, seq=seq)
    finally:
        set_buffers(model, real)
    for name, b in real.items():  # the graph's root copied the model's own buffers
        if "." not in name:
            captured.gm._buffers[name] = b
    retarget(captured.gm, next(iter(real.values())).device)
    return captured


__all__ = ["capture_with_meta_parameters", "materialize", "set_buffers"]
