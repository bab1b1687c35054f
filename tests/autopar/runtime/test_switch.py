"""A running job moved to another plan in process (``runtime.switch.switch_plan``, what
``autopar.Adaptive`` does) trains on exactly as one process does: ``autopar verify``'s switch
mode in float64, TP2 → ZeRO-3 and a pipeline → ZeRO-3 (model, optimizer state and all). A
switch that drops the state (the new placement's load skipped) FAILs. The CLI's flags are
``tests/autopar/cli/test_bad_inputs.py``'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from autopar.measure.verify import verify_runs
from autopar.runtime.model import ParallelModel
from autopar.zoo import hf
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2-rank process groups

BATCH, SEQ, STEPS = 8, 16, 4


def tiny_gpt2() -> torch.nn.Module:
    """Hugging Face GPT-2, 2 layers, width 64, float64 (seeded: the same weights every call)."""
    return hf.family("gpt2", layers=2, seq=SEQ).double()


@contextlib.contextmanager
def state_dropped() -> Iterator[None]:
    """The mutation: a placement's ``load`` does nothing, so the switched-to plan trains from the
    model's initial weights and a fresh optimizer."""
    with mock.patch.object(ParallelModel, "load", lambda self, path: None):
        yield


def test_a_switch_mid_run_matches_one_process(tmp_path) -> None:
    """One launch: TP2 → ZeRO-3 and PP2 → ZeRO-3 before step 2, and the mutation."""
    tp = plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, tp=2)
    pp = plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, pp=2)
    zero3 = plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, dp=2, zero=3)
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    cases = [(tp, None), (pp, None), (tp, state_dropped)]
    *good, dropped = verify_runs(tiny_gpt2, cases, data, str(tmp_path), switch=(2, zero3), checkpoint=False)
    for verdict in good:
        assert verdict.passed, verdict.first_failure
        assert verdict.arithmetic == "float64" and verdict.max_param_error < 1e-9
    assert not dropped.passed
