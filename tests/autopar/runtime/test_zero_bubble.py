"""Zero-bubble pipeline schedules on gloo processes equal single-process training: torch's
interleaved zero bubble (ZB-H1 at one chunk per rank, ZB1P at two), ZBV and DualPipeV (two
chunks per rank in a V: the first rank runs the embedding's chunk and the head's) at PP2 and
PP4, uneven chunks, and with TP2 and DP2 (ZeRO-3 on FSDP2)."""

from __future__ import annotations

import pytest

from autopar.strategy import V_SHAPE, Strategy, StrategyError, check_strategy
from tests.autopar.runtime.test_pipeline import _plan, _run_and_check, make_gpt4, make_gpt8, make_llama

pytestmark = pytest.mark.slow  # 2- and 4-rank process groups


def test_pp2_zero_bubble_schedules(tmp_path) -> None:
    """PP2 on the tied GPT (embedding and head on one rank in a V: their gradients add there)."""
    plans = [
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="interleaved-zb", virtual_stages=1),
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="interleaved-zb", virtual_stages=2),
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="zbv"),
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="dualpipev"),
    ]
    for plan in plans:
        if plan.strategy.schedule in V_SHAPE:  # rank 0: chunks 0 and 3, the embedding's and the head's
            first = plan.stages[0].layers
            assert first[0] == "embed" and first[-1] == "head", plan.text()
    _run_and_check(make_gpt4, plans, tmp_path)


def test_zero_bubble_with_data_and_tensor_parallel(tmp_path) -> None:
    """PP2×DP2 (ZeRO-1, ZeRO-2 on FSDP2) and PP2×TP2 (SP, full recompute) on 4 processes; the
    8-process PP2×DP2×TP2 ZBV run is in test_pipeline's one 8-process launch."""
    one = {"micro_batch": 1, "pp": 2}
    plans = [
        _plan(make_llama, dp=2, tp=1, zero=2, schedule="zbv", **one),
        _plan(make_llama, dp=2, tp=1, zero=1, schedule="interleaved-zb", virtual_stages=1, **one),
        _plan(make_llama, tp=2, sequence_parallel=True, recompute=("full",), schedule="dualpipev", **one),
    ]
    _run_and_check(make_llama, plans, tmp_path, checkpoint=False)


def test_zero_bubble_refuses_zero3() -> None:
    with pytest.raises(StrategyError, match="cannot run with ZeRO-3"):
        check_strategy(
            Strategy(pp=2, dp=2, zero=3, schedule="zbv", virtual_stages=2, global_batch=8),
            world_size=4,
            blocks=4,
            heads=4,
        )


def test_pp4_zero_bubble_schedules(tmp_path) -> None:
    plans = [
        _plan(make_gpt8, pp=4, dp=1, tp=1, micro_batch=1, schedule="interleaved-zb", virtual_stages=2),
        _plan(make_gpt8, pp=4, dp=1, tp=1, micro_batch=1, schedule="zbv"),
        _plan(make_gpt8, pp=4, dp=1, tp=1, micro_batch=1, schedule="dualpipev"),
    ]
    _run_and_check(make_gpt8, plans, tmp_path, checkpoint=False)
