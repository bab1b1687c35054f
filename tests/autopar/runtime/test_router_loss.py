"""A Hugging Face MoE model's own router (load-balancing) loss, unchanged: with
``output_router_logits=True`` autopar trains on what the model's ``labels=`` loss is (next-token
cross-entropy + ``router_aux_loss_coef`` × ``aux_loss``), as written, captured, under EP2 and
TP2 against single-process training; a pipeline is refused in one line."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.measure.verify import verify_cases
from autopar.planner import ModelProfiles, make_plan
from autopar.request import Constraints, PlanRequest
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


def _plan(**knobs):
    with torch.device("meta"):
        meta = mixtral_with_router_loss()
        profiles = ModelProfiles.of(mixtral_with_router_loss(), dtype="fp32", seq=SEQ)
    request = PlanRequest(
        model=meta,
        name="mixtral",
        cluster=Cluster.preset("cpu", gpus_per_node=2),
        global_batch=4,
        seq=SEQ,
        dtype="fp32",
        constraints=Constraints(micro_batch=1, recompute=("none",), **knobs),
    )
    return make_plan(request, profiles).plan


def test_ep2_and_tp2_train_with_the_router_loss_like_one_process(tmp_path) -> None:
    make = functools.partial(mixtral_with_router_loss)
    cases = [
        (make, _plan(tp=1, pp=1, dp=2, ep=2, zero=1), None),
        (make, _plan(tp=2, pp=1, dp=1, tp_objective="memory"), None),
    ]
    data = torch.randint(0, 64, (2, 4, SEQ), generator=torch.Generator().manual_seed(5))
    for (_, plan, _), v in zip(
        cases, verify_cases(cases, data, str(tmp_path), checkpoint=False), strict=True
    ):
        print(f"ep {plan.strategy.ep} tp {plan.strategy.tp}: grad error {v.max_grad_error:.1e}")
        assert v.passed, (plan.text(), v.first_failure)
