"""``autopar calibrate``: run plans on the launched cluster and compare the measured step time
with the one the plan predicted (run on every rank under torchrun).

Each plan trains the model (real weights, seeded, synthetic tokens) through
``autopar.parallelize``, the plans' steps alternating; a step is timed from a barrier before
it to a barrier after it, so every rank sees the slowest rank's step. The first ``warmup``
steps are dropped and the median of the rest is compared with the plan's predicted step.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One plan: predicted and measured step time."""

    label: str
    """Name given to the plan (its file name)."""
    plan: Plan
    """The plan run."""
    steps_s: tuple[float, ...]
    """Every timed step after warm-up (seconds)."""

    @property
    def predicted_s(self) -> float:
        return float(self.plan.predicted["step_time_s"])

    @property
    def measured_s(self) -> float:
        """Median of the timed steps."""
        return statistics.median(self.steps_s)

    @property
    def error(self) -> float:
        """(predicted − measured) / measured: positive when the model is pessimistic."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    def to_dict(self) -> dict[str, Any]:
        st = self.plan.strategy
        return {
            "label": self.label,
            "plan": st.to_dict(),
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "error": self.error,
            "steps_s": list(self.steps_s),
            "predicted_breakdown_s": self.plan.predicted["breakdown_s"],
            "notes": list(self.plan.predicted.get("notes", [])),
        }


def time_plans(
    spec: str, plans: Sequence[tuple[str, Plan]], *, vocab: int, steps: int, warmup: int
) -> list[Calibration]:
    """Train MODEL ``spec`` under each of ``plans`` (label, plan) here (every rank calls this).

    All plans are placed first, then their steps alternate (one step of each in turn), so
    that a slow spell of a shared machine falls on every plan alike rather than on one."""
    from autopar.runtime import parallelize
    from autopar.zoo.spec import build_model

    placed = [parallelize(build_model(spec, seed=0), plan) for _, plan in plans]
    generator = torch.Generator().manual_seed(1)
    times: list[list[float]] = [[] for _ in plans]
    for i in range(warmup + steps):
        for k, ((_, plan), pm) in enumerate(zip(plans, placed, strict=True)):
            st = plan.strategy
            local = st.global_batch // st.dp
            batch = torch.randint(0, vocab, (st.global_batch, st.seq), generator=generator)
            mine = batch[pm.dp_rank * local : (pm.dp_rank + 1) * local]
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step(mine)
            dist.barrier()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    del placed
    gc.collect()
    return [
        Calibration(label=label, plan=plan, steps_s=tuple(t))
        for (label, plan), t in zip(plans, times, strict=True)
    ]


__all__ = ["Calibration", "time_plans"]
