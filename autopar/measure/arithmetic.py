"""What a check computes in: the arithmetic a plan is run and judged in, and whether a model's
training forward is random or computes below float64 on purpose (``verify`` reads these)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.loss import loss_of


def model_for_check(make_model: Callable[[], nn.Module], arithmetic: str) -> nn.Module:
    """The model ``make_model`` builds, in float64 for a ``float64`` check."""
    model = make_model()
    return model.double() if arithmetic == "float64" else model


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""Half-precision arithmetic → the autocast dtype of its reference."""


def arithmetic_of(dtype: str, in_float64: str = "float64") -> str:
    """What a plan of ``dtype`` is checked in: fp32 (and fp64) plans in float64 (in float32 for a
    model that does not run in float64: ``in_float64``, the model's ``float64_arithmetic``),
    half-precision ones in their own dtype."""
    if dtype not in ("fp32", "fp64"):
        return dtype
    return "float32" if in_float64 == "float32" else "float64"


def in_eval_mode(make_model: Callable[[], nn.Module]) -> nn.Module:
    """The model ``make_model`` builds, in eval mode: its dropout draws nothing."""
    return make_model().eval()


@torch.no_grad()
def draws_masks(make_model: Callable[[], nn.Module], loss_fn: Any, tokens: torch.Tensor) -> bool:
    """Whether the model's training forward is random (dropout anywhere, as a module, a functional
    call or attention's ``dropout_p``; a router that samples its experts, PhiMoE's
    ``sparsemixer``): one batch's loss under three seeds. A sampling router changes a token's
    experts only where its top scores are close, so one row under two seeds could miss it (it
    did: PhiMoE, 16 tokens); give ``tokens`` the whole batch."""
    model = make_model().train()
    losses = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        losses.append(loss_of(model, tokens, loss_fn))
    return any(not torch.equal(losses[0], other) for other in losses[1:])


def batch_dependent(make_model: Callable[[], nn.Module], loss_fn: Any, tokens: torch.Tensor) -> bool:
    """Whether a row's loss depends on the other rows of its batch: experts with a capacity drop
    tokens by their place in the batch (GShard, Switch). The batch's loss against the mean of its
    rows' losses alone, beyond 100 roundings of the loss's dtype (1.2e-5 relative in float32;
    float32 rounding of a batch-independent model is near 1e-7). ``tokens``: two rows or more."""
    model = make_model()
    with torch.no_grad():
        whole = loss_of(model, tokens, loss_fn)
        rows = torch.stack([loss_of(model, row[None], loss_fn) for row in tokens]).mean()
    return bool((whole - rows).abs() > 100 * torch.finfo(whole.dtype).eps * whole.abs())


class _FloatDtypes(TorchDispatchMode):
    """The floating dtypes of the operator outputs run under it while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if self.active and isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen.add(t.dtype)
        return out


def float64_arithmetic(make_model: Callable[[], nn.Module], loss_fn: Any, tokens: torch.Tensor) -> str:
    """How an fp32 plan of this model is checked: ``float64`` (made float64, it computes in
    float64), ``lowered`` (made float64, some of its operators still compute lower on purpose:
    judged at float32's bounds), or ``float32`` (it does not run in float64 at all — the grouped
    matmul of Hugging Face's MoE experts, ``torch._grouped_mm``, has no double kernel — so both
    sides run in float32, judged at float32's bounds)."""
    try:
        lowered = computes_below_float64(make_model, loss_fn, tokens)
    except RuntimeError as e:
        if "Double" not in str(e):
            raise
        return "float32"
    return "lowered" if lowered else "float64"


@torch.no_grad()
def computes_below_float64(make_model: Callable[[], nn.Module], loss_fn: Any, tokens: torch.Tensor) -> bool:
    """Whether the model, made float64, still computes some operators of its forward in a lower
    precision on purpose (Gemma's and Llama's norms: ``x.float()``, ``x.to(torch.float32)``): one
    batch's forward. A loss that upcasts or downcasts the logits does not count (the verdict's loss
    bound allows for it)."""
    model = make_model().double().eval()
    mode = _FloatDtypes()

    def start(*_: Any) -> None:
        mode.active = True

    def stop(*_: Any) -> None:
        mode.active = False

    hooks = [model.register_forward_pre_hook(start), model.register_forward_hook(stop)]
    try:
        with mode:
            loss_of(model, tokens, loss_fn)
    finally:
        for h in hooks:
            h.remove()
    return any(d != torch.float64 for d in mode.seen)


__all__ = [
    "HALF",
    "arithmetic_of",
    "batch_dependent",
    "computes_below_float64",
    "draws_masks",
    "float64_arithmetic",
    "in_eval_mode",
    "model_for_check",
]
