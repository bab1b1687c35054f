"""What moving a running job to another plan costs, and when it pays (``autopar.Adaptive``).

A switch saves every rank's state (weights and optimizer state; gradients are not kept) through
DCP, places the new plan and loads the state resharded (``runtime.switch``):

    switch_s = place_s + (a_save + b_save · S) + (a_load + b_load · S)

``place_s`` the time a placement took, measured when the run started (building the model,
capture, passes, wrapping, allocation); S one rank's weights and optimizer state (written once,
read once: each rank reads about what it wrote when the new plan holds the same share of the
state); a and b a DCP save's and load's fixed and per-byte time per rank, measured with every
rank at it at once (``measure.disk.checkpoint_cost``). Once a switch has run, its measured
time replaces this estimate.

It pays when the time saved over the steps left exceeds it, with the new plan's prediction
taken ``margin`` too optimistic (the cost model's error on a plan it has not seen run: the
corpus's held-out median is 11.3%, ``benchmarks/published_runs.py``):

    (now_s − (1 + margin) · new_s) · remaining_steps > switch_s
"""

from __future__ import annotations


def switch_time_s(
    *,
    place_s: float,
    state_bytes: float,
    save_latency_s: float,
    save_s_per_byte: float,
    load_latency_s: float,
    load_s_per_byte: float,
) -> float:
    """Seconds a switch takes: a placement plus the state saved and loaded once (module doc)."""
    save = save_latency_s + save_s_per_byte * state_bytes
    return place_s + save + load_latency_s + load_s_per_byte * state_bytes


def switch_gain_s(*, now_s: float, new_s: float, remaining_steps: int, margin: float) -> float:
    """Seconds a switch saves over the remaining steps, the new plan's step taken ``margin`` slower
    than predicted (negative: it loses)."""
    return (now_s - (1.0 + margin) * new_s) * remaining_steps


def switch_pays(*, now_s: float, new_s: float, remaining_steps: int, margin: float, switch_s: float) -> bool:
    """Whether moving to the new plan saves more than the switch costs (module doc)."""
    return switch_gain_s(now_s=now_s, new_s=new_s, remaining_steps=remaining_steps, margin=margin) > switch_s


def state_bytes(memory: dict[str, float]) -> float:
    """One rank's state a switch moves, from a plan's predicted memory of a stage
    (``Plan.predicted["memory"]``): its weights and optimizer state."""
    return float(memory.get("weights", 0.0)) + float(memory.get("optimizer", 0.0))


__all__ = ["state_bytes", "switch_gain_s", "switch_pays", "switch_time_s"]
