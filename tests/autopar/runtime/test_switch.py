"""A running job moved to another plan in process (``runtime.switch.switch_plan``, what
``autopar.Adaptive`` does) trains on exactly as one process does: ``autopar verify``'s switch
mode in float64, TP2 → ZeRO-3 (model, optimizer state and all) and, through the CLI,
ZeRO-3 → a pipeline. A switch that drops the state (the new placement's load skipped) FAILs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from autopar.cli import main
from autopar.measure.verify import verify_runs
from autopar.runtime.model import ParallelModel
from autopar.zoo import hf
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2-rank process groups, the CLI

BATCH, SEQ, STEPS = 8, 16, 4
SPEC = f"{__file__}:tiny_gpt2"


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
    tp = plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, tp=2)
    zero3 = plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, dp=2, zero=3)
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    cases = [(tp, None), (tp, state_dropped)]
    good, dropped = verify_runs(tiny_gpt2, cases, data, str(tmp_path), switch=(2, zero3), checkpoint=False)
    assert good.passed, good.first_failure
    assert good.arithmetic == "float64" and good.max_param_error < 1e-9
    assert not dropped.passed


def test_verify_switches_to_a_pipeline_from_the_command_line(tmp_path, capsys) -> None:
    z3, pp = tmp_path / "z3.json", tmp_path / "pp.json"
    z3.write_text(plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, dp=2, zero=3).to_json())
    pp.write_text(plan_for(tiny_gpt2, batch=BATCH, seq=SEQ, pp=2).to_json())
    argv = [
        "verify",
        SPEC,
        "--plan",
        str(z3),
        "--steps",
        "3",
        "--global-batch",
        str(BATCH),
        "--seq",
        str(SEQ),
    ]
    code = main([*argv, "--switch-at", "1", "--switch-to", str(pp), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report.get("first_failure")
