"""The price of moving a running job to another plan, and the rule that says when it pays."""

from __future__ import annotations

import pytest

from autopar.cost_models.switch import state_bytes, switch_gain_s, switch_pays, switch_time_s


def test_switch_time_is_a_placement_and_the_state_saved_and_loaded_once() -> None:
    # 2 s placement + (0.5 s + 400 MB at 200 MB/s) saved + (0.3 s + 400 MB at 2 GB/s) loaded
    cost = switch_time_s(
        place_s=2.0,
        state_bytes=400e6,
        save_latency_s=0.5,
        save_s_per_byte=1 / 200e6,
        load_latency_s=0.3,
        load_s_per_byte=1 / 2e9,
    )
    assert cost == pytest.approx(2.0 + 0.5 + 2.0 + 0.3 + 0.2)


def test_a_switch_pays_only_past_its_cost_with_the_new_plan_taken_margin_slower() -> None:
    # 1.0 s → 0.8 s predicted; with a 10% margin the new step counts as 0.88 s: 0.12 s a step
    assert switch_gain_s(now_s=1.0, new_s=0.8, remaining_steps=100, margin=0.1) == pytest.approx(12.0)
    assert switch_pays(now_s=1.0, new_s=0.8, remaining_steps=100, margin=0.1, switch_s=11.9)
    assert not switch_pays(now_s=1.0, new_s=0.8, remaining_steps=100, margin=0.1, switch_s=12.1)
    assert not switch_pays(
        now_s=1.0, new_s=0.8, remaining_steps=10**6, margin=0.25, switch_s=0.0
    )  # within margin


def test_state_is_weights_and_optimizer() -> None:
    assert state_bytes({"weights": 4.0, "optimizer": 8.0, "gradients": 4.0, "activations": 99.0}) == 12.0
