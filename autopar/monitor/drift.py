"""When a run and its plan disagree: one warning naming the plan term most likely wrong.

Step time: measured / predicted beyond ``ratio`` (or below 1/ratio) for ``steps`` steps in a
row. The term named is the largest of the plan's predicted breakdown (``Plan.predicted
["breakdown_s"]``), with the command that measures it: compute, recompute and the optimizer
come from the device's speed (``autopar profile``), TP / pipeline / DP communication from the
links (``autopar profile-comm``), the bubble from the schedule. Memory: the peak beyond
``ratio`` × predicted for ``steps`` steps; the term named is the stage's largest predicted part.
Each kind warns once per run.
"""

from __future__ import annotations

from typing import Any

from autopar.units import format_bytes

MEASURES = {
    "compute": "autopar profile MODEL (the device's matmul speed)",
    "recompute": "autopar profile MODEL (the device's matmul speed)",
    "optimizer": "autopar profile MODEL (the device's memory bandwidth)",
    "tp_comm": "autopar profile-comm (the intra-node links)",
    "p2p": "autopar profile-comm (the links between stages)",
    "dp_comm": "autopar profile-comm (the data-parallel links)",
    "bubble": "autopar estimate with another --schedule or --micro-batch (the pipeline bubble)",
}


class Drift:
    """Counts the steps in a row a run is off its plan; ``observe`` returns a warning once."""

    def __init__(self, plan: Any, *, ratio: float, steps: int) -> None:
        self.plan, self.ratio, self.steps = plan, ratio, steps
        self.run = {"time": 0, "memory": 0}
        self.warned: set[str] = set()

    def observe(self, figures: dict[str, float]) -> str | None:
        """The warning to print after this step's ``figures`` (``metrics.GAUGES``), or None."""
        time_off = not (1 / self.ratio <= figures["step_time_over_predicted"] <= self.ratio)
        memory_off = figures["memory_over_predicted"] > self.ratio
        for kind, off in (("time", time_off), ("memory", memory_off)):
            self.run[kind] = self.run[kind] + 1 if off else 0
            if self.run[kind] >= self.steps and kind not in self.warned:
                self.warned.add(kind)
                return self._time(figures) if kind == "time" else self._memory(figures)
        return None

    def _time(self, figures: dict[str, float]) -> str:
        breakdown: dict[str, float] = self.plan.predicted.get("breakdown_s", {})
        term, predicted = max(breakdown.items(), key=lambda kv: kv[1], default=("compute", 0.0))
        measured, expected = figures["step_time_s"], figures["predicted_step_time_s"]
        return (
            f"step time {measured:.3g} s measured, {expected:.3g} s predicted "
            f"({measured / expected:.2f}×) for {self.steps} steps; the plan's largest term is {term} "
            f"({predicted:.3g} s): measure it with {MEASURES.get(term, 'autopar profile')}, plan from the "
            "measurement, and check with autopar calibrate"
        )

    def _memory(self, figures: dict[str, float]) -> str:
        memory = self.plan.predicted.get("memory", [{}])[0]
        parts = {k: v for k, v in memory.items() if k not in ("stage", "peak_bytes", "reserve")}
        term, predicted = max(parts.items(), key=lambda kv: kv[1], default=("activations", 0.0))
        return (
            f"peak memory {format_bytes(figures['peak_memory_bytes'])} measured, "
            f"{format_bytes(figures['predicted_peak_memory_bytes'])} predicted for {self.steps} steps; "
            f"the stage's largest predicted part is {term} ({format_bytes(predicted)}): "
            "check it with autopar inspect MODEL, or plan with --reserve-gib"
        )


__all__ = ["MEASURES", "Drift"]
