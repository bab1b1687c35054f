"""What a model is trained on: how a batch of token ids becomes its inputs, and where its loss is.

A model whose ``forward`` takes targets computes its own loss, and that loss is the one trained
(unless the user passes ``loss_fn``):

- ``targets`` (nanoGPT and most single-file GPTs): the caller shifts — the model reads
  ``tokens[:, :-1]`` and is given ``targets=tokens[:, 1:]``, so a batch of s tokens trains s − 1
  next-token predictions, exactly those the default loss trains (position i's logits depend on
  tokens ≤ i only). Such models often return only the last position's logits without targets.
- ``labels`` (the Hugging Face convention): the model shifts — it reads ``tokens`` with
  ``labels=tokens``. (Hugging Face's own causal LMs are trained on their logits instead: their
  loss is exactly next-token cross-entropy, see ``objective_of``.)

The loss is read from what the model returns: a scalar tensor, the first scalar tensor of a
tuple or list (nanoGPT returns ``(logits, loss)``, Hugging Face tuples ``(loss, logits, …)``), or
``.loss`` / ``["loss"]``. Other models are called on the tokens alone and trained with next-token
cross-entropy on their logits (``runtime.loss.lm_loss``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError

TARGET_KEYWORDS = {"targets": True, "labels": False}
"""A forward keyword that takes targets → whether the caller shifts them (the model does not)."""


@dataclass(frozen=True, kw_only=True)
class Objective:
    """How a (batch, seq) tensor of token ids is fed to the model and its loss found."""

    target: str | None = None
    """The forward keyword the targets go to; None: the model reads the tokens alone."""
    shifted: bool = False
    """The caller shifts: inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``."""
    no_cache: bool = False
    """Call the forward with ``use_cache=False`` (it takes one, as Hugging Face models do): a
    training step keeps no key/value cache, and a checkpointed block recomputed in backward
    would extend one a second time (``without_cache``)."""

    @property
    def own_loss(self) -> bool:
        """The model computes the loss itself."""
        return self.target is not None

    def inputs(self, tokens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """The forward's positional and keyword arguments for ``tokens``."""
        extra: dict[str, Any] = {"use_cache": False} if self.no_cache else {}
        if self.target is None:
            return (tokens,), extra
        if self.shifted:  # contiguous, as a data loader gives them (a model may .view them)
            return (tokens[:, :-1].contiguous(),), {self.target: tokens[:, 1:].contiguous(), **extra}
        return (tokens,), {self.target: tokens, **extra}

    def input_seq(self, seq: int) -> int:
        """Positions the model reads from a sequence of ``seq`` tokens."""
        return seq - 1 if self.shifted else seq


LOGITS = Objective()
"""Tokens in, logits out: the default next-token loss."""


def objective_of(model: nn.Module) -> Objective:
    """The model's own loss where its forward takes ``targets`` or ``labels``, else ``LOGITS``.
    A Hugging Face causal LM is trained on its logits: its ``labels=`` loss is next-token
    cross-entropy of them (transformers' ``ForCausalLMLoss``, in float32), which autopar computes
    itself — split over the vocabulary under TP, and in the checked dtype under ``verify``."""
    if type(model).__module__.startswith("transformers."):
        return LOGITS
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a compiled or C++ module)
        return LOGITS
    for keyword, shifted in TARGET_KEYWORDS.items():
        if keyword in params:
            return Objective(target=keyword, shifted=shifted)
    return LOGITS


def without_cache(model: nn.Module, objective: Objective) -> Objective:
    """``objective`` with ``no_cache`` where ``model.forward`` takes ``use_cache``: by name, or
    through ``**kwargs`` where the model's config has it (a Hugging Face model that hands its
    keywords on to the inner model, e.g. ``GraniteMoeForCausalLM``: without it the output holds
    a ``DynamicCache`` that torch.export cannot return)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature
        return objective
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    takes = "use_cache" in params or (passes_on and hasattr(getattr(model, "config", None), "use_cache"))
    return replace(objective, no_cache=True) if takes else objective


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model returned (see the module docstring), or one line naming what it returned."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)):
        loss = next((x for x in output if isinstance(x, torch.Tensor) and x.dim() == 0), None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise AutoparError(
        f"the model was given targets but returned {describe(output)}, with no scalar loss in it: "
        "return the loss (a scalar, an element of a tuple, or .loss), or pass loss_fn="
    )


def describe(value: Any) -> str:
    """A short account of a model output: ``(Tensor[2, 15, 96], None)``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:4]) + (", …" if len(value) > 4 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in list(value.items())[:4]) + "}"
    return type(value).__name__ if value is not None else "None"


__all__ = [
    "LOGITS",
    "TARGET_KEYWORDS",
    "Objective",
    "describe",
    "model_loss",
    "objective_of",
    "without_cache",
]
