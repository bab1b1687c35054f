"""``autopar calibrate``: run plans on the launched cluster and compare the measured step time
with the one the plan predicted (run on every rank under torchrun).

Each plan trains the model (real weights, seeded, synthetic tokens) through
``autopar.parallelize``, the plans' steps alternating; a step is timed from a barrier before
it to a barrier after it, so every rank sees the slowest rank's step. The first ``warmup``
steps are dropped and the median of the rest is compared with the plan's predicted step.

``calibrate_cluster``: a cluster made to agree with a run (``autopar.Adaptive``). Two physical
quantities are taken from measurement and nothing is fitted per plan: the links, as the
collectives measured on this world's groups (a ``CommProfile``, ``measure.comm``: what the
communication terms are then priced from), and the device's speed, one factor κ on its peak
FLOP/s and memory bandwidth such that the plan's priced step equals the measured one:

    measured step = κ · (compute + recompute + optimizer + bubble) + (tp_comm + p2p + dp_comm)

(the breakdown priced with the measured links; κ > 1: the device is slower than described).
Every other plan is then priced on the same κ and links: what it predicts is the plan's
mechanism on the run's measured machine, not a correction learnt from the plan that ran.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.measurements import CommProfile
from autopar.plan import Plan
from autopar.planner import Pricer
from autopar.strategy import Strategy

COMM_TERMS = ("tp_comm", "p2p", "dp_comm")
"""The breakdown's terms priced from the links; the rest scale with the device's speed."""
LEAST_COMPUTE_SHARE = 0.05
"""κ's floor: compute is at least this share of the measured step, even where the priced
communication alone exceeds it (the links then measured slower than the step shows)."""


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
            start, stop = st.replica_rows(pm.dp_rank)
            batch = torch.randint(0, vocab, (st.global_batch, st.seq), generator=generator)
            mine = batch[start:stop]
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


@dataclass(frozen=True, kw_only=True)
class RunCalibration:
    """A cluster made to agree with one plan's measured step (module doc)."""

    cluster: Cluster
    """The described cluster with the measured links attached and the device's speed ÷ κ."""
    compute_scale: float
    """κ: the device's measured time per priced second of compute."""
    measured_step_s: float
    """The step time measured (the window's median)."""
    described_s: dict[str, float]
    """The plan's breakdown priced on the described cluster."""
    calibrated_s: dict[str, float]
    """The same on the calibrated one (its sum is the measured step, but for κ's floor)."""
    calibrated_step_s: float
    """The plan's step priced on the calibrated cluster."""

    def worst_term(self) -> tuple[str, float]:
        """The term whose price moved most (calibrated ÷ described), and by how much."""
        after = self.calibrated_s
        moved = {k: after[k] / v for k, v in self.described_s.items() if v > 0 and after[k] > 0}
        return max(moved.items(), key=lambda kv: max(kv[1], 1 / kv[1]), default=("compute", 1.0))


def calibrate_cluster(
    cluster: Cluster,
    pricer: Callable[[Cluster], Pricer],
    strategy: Strategy,
    *,
    step_s: float,
    comm: CommProfile | None = None,
) -> RunCalibration:
    """``cluster`` calibrated on ``strategy``'s measured ``step_s`` and the measured links
    ``comm`` (module doc); ``pricer(cluster)`` prices the model on a cluster."""
    if not step_s > 0:
        raise ValueError(f"step_s={step_s}: need a measured step time > 0")
    described = dict(pricer(cluster).estimate(strategy).breakdown_s)
    linked = cluster.from_profile(comm=comm) if comm is not None else cluster
    breakdown = pricer(linked).estimate(strategy).breakdown_s
    comm_s = sum(breakdown[k] for k in COMM_TERMS)
    compute_s = sum(v for k, v in breakdown.items() if k not in COMM_TERMS)
    kappa = max(step_s - comm_s, LEAST_COMPUTE_SHARE * step_s) / compute_s
    device = linked.device
    device = replace(
        device,
        peak_flops={k: v / kappa for k, v in device.peak_flops.items()},
        hbm_bandwidth_bytes_per_s=device.hbm_bandwidth_bytes_per_s / kappa,
    )
    calibrated = replace(linked, device=device)
    priced = pricer(calibrated).estimate(strategy)
    return RunCalibration(
        cluster=calibrated,
        compute_scale=kappa,
        measured_step_s=step_s,
        described_s=described,
        calibrated_s=dict(priced.breakdown_s),
        calibrated_step_s=priced.step_time_s,
    )


__all__ = ["COMM_TERMS", "Calibration", "RunCalibration", "calibrate_cluster", "time_plans"]
