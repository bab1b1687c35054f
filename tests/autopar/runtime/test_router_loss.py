"""A Hugging Face MoE model's own router (load-balancing) loss, unchanged: with
``output_router_logits=True`` autopar trains on what the model's ``labels=`` loss is (next-token
cross-entropy + ``router_aux_loss_coef`` × ``aux_loss``), as written and captured; a pipeline is
refused in one line. Trained under EP2 × TP2 against one process in
``test_expert_parallel.test_ep2_within_tp2_trains_like_one_process``."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.runtime.loss import RouterAuxLoss, lm_loss, loss_of, resolve_objective
from autopar.zoo import hf

SEQ = 16


def mixtral_with_router_loss() -> torch.nn.Module:
    """Tiny Hugging Face Mixtral asking for its router loss, coefficient raised so it shows."""
    model = hf.family("mixtral")
    model.config.output_router_logits = True  # read by each forward
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = 0.1  # as built with it
    return model


def test_the_loss_is_the_models_own_labels_loss_as_written_and_captured() -> None:
    model = mixtral_with_router_loss()
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    _, fn = resolve_objective(model, None)
    assert isinstance(fn, RouterAuxLoss) and fn.coef == 0.1
    ours = loss_of(model, tokens).detach()
    theirs = model(tokens, labels=tokens, use_cache=False).loss.detach()
    plain = lm_loss(model(tokens, use_cache=False), tokens)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert float(ours) - float(plain) > 0.1  # the router loss is in it (aux ≥ 1 for a top-2 of 4)
    graph = capture(model, batch=2, seq=SEQ).gm
    assert float(fn(graph(tokens), tokens)) == pytest.approx(float(ours), rel=1e-6)  # a graph's tuple
    with pytest.raises(AutoparError, match=r"router loss .* 2 stages: set output_router_logits=False"):
        resolve_objective(model, None, pp=2)
    _, given = resolve_objective(model, lm_loss, pp=2)  # a loss_fn of the user's: theirs
    assert given is lm_loss
