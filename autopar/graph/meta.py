"""Meta parameters: capture a model whose parameters are on the meta device (``meta_parameters``)
and allocate only the parts a rank keeps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def parameters_as(model: nn.Module, dtype: torch.dtype) -> Iterator[dict[int, torch.Tensor]]:
    """Inside: every floating parameter of ``model`` replaced by an uninitialised stand-in of
    ``dtype`` on its device (a tied weight by one stand-in). Yields stand-in id → the model's
    parameter; restores them after."""
    stand_ins: dict[int, nn.Parameter] = {}
    originals: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in stand_ins:
                stand = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device), p.requires_grad)
                stand_ins[id(p)], originals[id(stand)] = stand, p
            module._parameters[name] = stand_ins[id(p)]
            swapped.append((module, name, p))
    try:
        yield originals
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def capture_as(model: nn.Module, *, batch: int, seq: int, dtype: torch.dtype | None) -> CapturedModel:
    """``capture_with_meta_parameters`` with the floating parameters seen in ``dtype`` (None: as
    they are): the graph computes as the model does once FSDP2's mixed precision casts them, so
    casts the model writes as ``.to(weight.dtype)`` or ``.to(x.dtype)`` are traced to ``dtype``,
    not to the dtype the weights are stored in. The graph then reads the model's own parameters.
    (Real weights get real stand-ins while it traces, on their device, which code may branch on:
    ``dtype``'s bytes per parameter, freed after.)"""
    if dtype is None:
        return capture_with_meta_parameters(model, batch=batch, seq=seq)
    with parameters_as(model, dtype) as originals:
        captured = capture_with_meta_parameters(model, batch=batch, seq=seq)
    for module in captured.gm.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in originals:
                module._parameters[name] = originals[id(p)]  # type: ignore[assignment]
    return captured


__all__ = ["capture_as", "capture_with_meta_parameters", "materialize", "parameters_as", "set_buffers"]
