"""The training loss: next-token cross-entropy by default, on whole or vocabulary-split logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from autopar.errors import AutoparError

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""loss(model output, tokens) → scalar."""


def lm_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a language model's logits (a tensor or ``.logits``)."""
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise AutoparError("the default loss needs logits of shape (batch, seq, vocab); pass loss_fn=")
    flat = logits[:, :-1].flatten(0, 1)
    if flat.dtype not in (torch.float32, torch.float64):  # half-precision logits: fp32 softmax
        flat = flat.float()
    return F.cross_entropy(flat, tokens[:, 1:].flatten())


def scalar(x: Any) -> Any:
    """A DTensor as the whole plain tensor (a vocab-parallel loss is a replicated DTensor);
    anything else unchanged."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def whole_logits(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` for tensor-parallel plans, whose logits may leave split over the vocabulary
    (DTensors): ``lm_loss`` computes on them vocab-parallel (under ``loss_parallel``); any other
    loss gets them gathered whole."""
    if loss_fn is lm_loss:
        return loss_fn

    def gathered(output: Any, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils._pytree import tree_map

        return loss_fn(tree_map(scalar, output), tokens)

    return gathered


__all__ = ["LossFn", "lm_loss", "scalar", "whole_logits"]
