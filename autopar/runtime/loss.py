"""The training loss: next-token cross-entropy by default, on whole or vocabulary-split logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RouterAuxLoss:
    """A Hugging Face MoE model's training loss with ``output_router_logits=True``: next-token
    cross-entropy of its logits plus ``coef`` × the load-balancing loss its forward returns
    (``aux_loss``, Switch Transformer's, over every layer's router logits) — what the model's
    own ``labels=`` loss adds (transformers' ``MixtralForCausalLM.forward``: ``loss +=
    router_aux_loss_coef * aux_loss``). The output may be the model's (``.logits``,
    ``.aux_loss``) or a captured graph's tuple (the scalar and the (…, seq, vocab) logits)."""

    coef: float
    vocab: int

    def __call__(self, output: Any, tokens: torch.Tensor) -> torch.Tensor:
        if hasattr(output, "aux_loss") and hasattr(output, "logits"):
            logits, aux = output.logits, output.aux_loss
        else:
            parts = list(output) if isinstance(output, (tuple, list)) else [output]
            found = [
                x for x in parts if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[-1] == self.vocab
            ]
            auxes = [x for x in parts if isinstance(x, torch.Tensor) and x.dim() == 0]
            if not found or not auxes:
                raise AutoparError(
                    f"the model's config asks for its router loss (output_router_logits) but it returned "
                    f"{describe(output)}, without logits and a scalar aux_loss; pass loss_fn="
                )
            logits, aux = found[0], auxes[0]
        return scalar(lm_loss(logits, tokens)) + self.coef * scalar(aux)  # promoted to the loss's dtype


def router_aux_loss(model: nn.Module) -> RouterAuxLoss | None:
    """``RouterAuxLoss`` for a Hugging Face model whose config has ``output_router_logits`` set
    (its coefficient ``router_aux_loss_coef``, as the model holds it); None otherwise."""
    config: Any = getattr(model, "config", None)
    hf = type(model).__module__.startswith("transformers.")
    if not hf or not getattr(config, "output_router_logits", False):
        return None
    # the model keeps the coefficient it was built with (MixtralForCausalLM.router_aux_loss_coef)
    coef = float(getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0)))
    return RouterAuxLoss(coef=coef, vocab=int(config.vocab_size))


def own_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The loss the model computed itself (``graph.objective.model_loss``)."""
    return model_loss(output)


def resolve_objective(
    model: nn.Module, loss_fn: LossFn | None, *, pp: int = 1, cp: int = 1
) -> tuple[Objective, LossFn]:
    """How ``model`` is fed and its loss taken: ``loss_fn`` on its output for tokens alone where
    one is given; else its own loss where it computes one (``objective_of``), else ``lm_loss``
    (plus a Hugging Face MoE's router loss where its config asks for it: ``router_aux_loss``);
    with ``use_cache=False`` where the forward takes it (``without_cache``). ``pp``: the plan's
    pipeline depth (the router loss needs every layer's router logits on one rank); ``cp``: its
    context-parallel degree (a rank holds part of each sequence: next-token cross-entropy on the
    logits only, ``context_loss``)."""
    objective, fn = _objective(model, loss_fn, pp)
    if cp > 1 and fn is not lm_loss:
        raise AutoparError(
            f"context parallelism (cp {cp}) trains next-token cross-entropy on the logits, a rank "
            f"holding part of each sequence; {type(model).__name__} is trained on its own or a custom "
            "loss: plan cp 1, or train it on its logits"
        )
    return objective, fn


def _objective(model: nn.Module, loss_fn: LossFn | None, pp: int) -> tuple[Objective, LossFn]:
    if loss_fn is not None:
        return without_cache(model, LOGITS), loss_fn
    objective = objective_of(model)
    if objective.own_loss:
        return without_cache(model, objective), own_loss
    aux = router_aux_loss(model)
    if aux is not None and pp > 1:
        raise AutoparError(
            f"{type(model).__name__}'s router loss (config.output_router_logits) sums every layer's router "
            f"logits, which a pipeline holds on {pp} stages: set output_router_logits=False, pass "
            "loss_fn=, or plan pp=1"
        )
    return without_cache(model, LOGITS), aux or lm_loss


def tail_loss(loss_graph: nn.Module, kept: int) -> LossFn:
    """A pipeline's loss for a model that computes its own: ``loss_graph`` (the model's loss, cut
    out of its graph) on the last stage's outputs after the first ``kept`` and the targets."""

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        outputs = output if isinstance(output, tuple) else (output,)
        return loss_graph(*outputs[kept:], targets)

    return loss


def context_loss(positions: torch.Tensor, cp: int) -> LossFn:
    """Next-token cross-entropy under context parallelism: this rank's logits are those of its
    positions (``passes.context_parallel``), so its targets are the next tokens of the whole
    sequences at those positions (the last position has none), and its loss is its share of the
    sequences' mean times cp — the gradients are averaged over dp·cp ranks, each with 1/cp of
    the tokens: (1 / dp·cp) Σ cp · Σ_mine / N = the mean over each replica's N = b·(s − 1)
    predictions, averaged over dp (``ParallelModel.mean_loss`` divides by the same ranks). Any
    other loss was refused by ``resolve_objective``."""

    def loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        b, s = tokens.shape
        ignore = torch.full((b, 1), -100, dtype=tokens.dtype, device=tokens.device)
        targets = torch.cat([tokens[:, 1:], ignore], dim=1).index_select(1, positions.to(tokens.device))
        flat = logits.flatten(0, 1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        total = F.cross_entropy(flat, targets.flatten(), ignore_index=-100, reduction="sum")
        return total * (cp / (b * (s - 1)))

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
    if loss_fn is lm_loss or loss_fn is own_loss or isinstance(loss_fn, RouterAuxLoss):
        return loss_fn  # (own loss: computed in the graph; the router loss's logits: vocab-parallel)

    def gathered(output: Any, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils._pytree import tree_map

        return loss_fn(tree_map(scalar, output), tokens)

    return gathered


__all__ = [
    "LossFn",
    "RouterAuxLoss",
    "context_loss",
    "lm_loss",
    "loss_of",
    "own_loss",
    "resolve_objective",
    "router_aux_loss",
    "scalar",
    "tail_loss",
    "whole_logits",
]
