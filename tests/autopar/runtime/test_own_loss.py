"""A model that computes its own loss trains that loss, unmodified, under every plan family: a
single-file GPT written the nanoGPT way (``forward(idx, targets=None)`` → ``(logits, loss)``,
only the last position's logits without targets) with a loss the default does not compute."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import AutoparError
from autopar.graph.objective import Objective, model_loss, objective_of
from autopar.measure.verify import verify_runs
from autopar.runtime.loss import lm_loss, loss_of
from autopar.zoo.spec import build_model
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # process groups and the verify CLI

NANOGPT = f"{Path(__file__).with_name('nanogpt.py')}:nanogpt"

BATCH, SEQ = 8, 16


nanogpt = functools.partial(build_model, NANOGPT)
nanogpt_z_loss = functools.partial(build_model, NANOGPT + "_z_loss")


def _plan(**knobs) -> autopar.Plan:
    return plan_for(nanogpt_z_loss, batch=BATCH, seq=SEQ, gpus=2, **knobs)


def test_the_objective_follows_the_forward_signature() -> None:
    tokens = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model = nanogpt()
    assert objective_of(model) == Objective(target="targets", shifted=True)
    own = loss_of(model, tokens)
    logits, _ = model(tokens)  # without targets: the last position only
    assert logits.shape[1] == 1
    full, _ = model(tokens[:, :-1], targets=tokens[:, 1:].contiguous())
    # the same s − 1 predictions as next-token cross-entropy of every position's logits
    assert torch.allclose(own, torch.nn.functional.cross_entropy(full.flatten(0, 1), tokens[:, 1:].flatten()))
    with pytest.raises(AutoparError, match=r"returned \(Tensor\[2, 1, 96\], None\)"):
        lm_loss(model(tokens), tokens)  # the default loss names what it was given
    with pytest.raises(AutoparError, match=r"returned \(Tensor\[2, 15, 96\]\), with no scalar loss"):
        model_loss((full,))


def test_own_loss_trains_under_dp_zero3_tp_and_pp(tmp_path) -> None:
    plans = [
        _plan(tp=1, pp=1, dp=2, zero=3),
        _plan(tp=2, pp=1, dp=1),
        _plan(tp=1, pp=2, dp=1, schedule="1f1b"),
        _plan(tp=1, pp=2, dp=1, schedule="interleaved", virtual_stages=2),
    ]
    data = torch.randint(0, 96, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    verdicts = verify_runs(nanogpt_z_loss, [(p, None) for p in plans], data, str(tmp_path), checkpoint=False)
    logits, _ = nanogpt_z_loss().double()(data[0, :, :-1], targets=data[0, :, 1:].contiguous())
    plain = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[0, :, 1:].flatten()))
    for plan, v in zip(plans, verdicts, strict=True):
        print(f"{plan.text().splitlines()[0]}: losses {v.losses}, grad error {v.max_grad_error:.1e}")
        assert v.passed, (plan.text(), v.first_failure)
        assert abs(v.losses[0] - plain) > 1e-3  # the z-loss is in it: the model's loss, not the default


def test_verify_and_profile_take_the_model_file_as_is(tmp_path, capsys) -> None:
    """The CLI on the unmodified file: verify under a pipeline (default flags otherwise) and
    profile, whose head timing includes the model's own loss."""
    import json

    from autopar.cli import main

    args = ["verify", NANOGPT, "--nproc", "2", "--pp", "2", "--global-batch", "8", "--seq", "16"]
    assert main([*args, "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["plan"]["strategy"]["pp"] == 2, report["first_failure"]
    out = tmp_path / "profile.json"
    profile = ["profile", NANOGPT, "--batch", "2", "--seq", "16", "--repeat", "1", "--warmup", "1"]
    assert main([*profile, "--out", str(out)]) == 0
    layers = {t["layer_type"] for t in json.loads(out.read_text())["layers"]}
    assert "head" in layers, layers
