"""``split_loss``: a model's own loss cut out of its captured graph computes the same loss from
the graph's new outputs and the targets, and the graph no longer reads the targets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx, nn

from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.passes.loss_split import split_loss
from autopar.zoo.spec import build_model

NANOGPT = f"{Path(__file__).parents[1] / 'autopar' / 'runtime' / 'nanogpt.py'}:nanogpt_z_loss"


def test_the_cut_loss_equals_the_models_own() -> None:
    model = build_model(NANOGPT)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    want_logits, want = model(idx, targets=targets)
    gm = capture(model, batch=2, seq=16).gm
    gm, loss_gm, kept = split_loss(gm, "targets")
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["idx"]
    out = gm(idx)
    assert kept == 1 and torch.allclose(out[0], want_logits)
    got = loss_gm(*out[kept:], targets)
    assert torch.allclose(got, want), (got, want)  # cross-entropy and the z-loss, as written


class TwoLosses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return (y - targets).pow(2).mean(), (y - targets).abs().mean()


def test_targets_reaching_two_outputs_is_a_clear_error() -> None:
    gm = fx.symbolic_trace(TwoLosses())
    with pytest.raises(AutoparError, match="reach 2 of its outputs"):
        split_loss(gm, "targets")
