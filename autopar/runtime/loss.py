"""The training loss: next-token cross-entropy by default, on whole or vocabulary-split logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.graph.objective import LOGITS, Objective, describe, model_loss, objective_of, without_cache

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""loss(model output, tokens) → scalar."""


def lm_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a language model's logits (a tensor or ``.logits``)."""
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[1] != tokens.shape[1]:
        raise AutoparError(
            f"the default loss needs logits of shape (batch, seq, vocab) = (…, {tokens.shape[1]}, …) but the "
            f"model returned {describe(output)}: return the logits, compute the loss in the model (a "
            "forward(…, targets=) or labels= that returns it), or pass loss_fn="
        )
    flat = logits[:, :-1].flatten(0, 1)
    if flat.dtype not in (torch.float32, torch.float64):  # half-precision logits: fp32 softmax
        flat = flat.float()
    return F.cross_entropy(flat, tokens[:, 1:].flatten())


def own_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The loss the model computed itself (``graph.objective.model_loss``)."""
    return model_loss(output)


def resolve_objective(model: nn.Module, loss_fn: LossFn | None) -> tuple[Objective, LossFn]:
    """How ``model`` is fed and its loss taken: ``loss_fn`` on its output for tokens alone where
    one is given; else its own loss where it computes one (``objective_of``), else ``lm_loss``;
    with ``use_cache=False`` where the forward takes it (``without_cache``)."""
    if loss_fn is not None:
        return without_cache(model, LOGITS), loss_fn
    objective = objective_of(model)
    if objective.own_loss:
        return without_cache(model, objective), own_loss
    return without_cache(model, LOGITS), lm_loss


def tail_loss(loss_graph: nn.Module, kept: int) -> LossFn:
    """A pipeline's loss for a model that computes its own: ``loss_graph`` (the model's loss, cut
    out of its graph) on the last stage's outputs after the first ``kept`` and the targets."""

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        outputs = output if isinstance(output, tuple) else (output,)
        return loss_graph(*outputs[kept:], targets)

    return loss


def loss_of(model: nn.Module, tokens: torch.Tensor, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The training loss of ``model`` (as written) on ``tokens`` (``resolve_objective``)."""
    objective, fn = resolve_objective(model, loss_fn)
    args, kwargs = objective.inputs(tokens)
    return fn(model(*args, **kwargs), tokens)


def scalar(x: Any) -> Any:
    """A DTensor as the whole plain tensor (a vocab-parallel loss is a replicated DTensor);
    anything else unchanged."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def whole_logits(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` for tensor-parallel plans, whose logits may leave split over the vocabulary
    (DTensors): ``lm_loss`` computes on them vocab-parallel (under ``loss_parallel``); any other
    loss gets them gathered whole."""
    if loss_fn is lm_loss or loss_fn is own_loss:  # (the model's own loss: computed in the graph)
        return loss_fn

    def gathered(output: Any, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils._pytree import tree_map

        return loss_fn(tree_map(scalar, output), tokens)

    return gathered


__all__ = [
    "LossFn",
    "lm_loss",
    "loss_of",
    "own_loss",
    "resolve_objective",
    "scalar",
    "tail_loss",
    "whole_logits",
]
