"""Time in collectives, measured by ``torch.profiler`` on one step in every N (opt-in: a
profiled step runs slower).

The process groups name their work ``nccl:<collective>`` / ``gloo:<collective>`` (c10d's
``profilingTitle``): the event lasts from the call until the work completes, so it counts
time a collective is in flight, hidden behind compute or not. On a GPU the NCCL kernels'
device time (``ncclDevKernel_*``, ``ncclKernel_*``) is used instead: the time the network and
copy engines were busy. Either way the sum is a total, to set against the plan's predicted
communication (TP collectives + pipeline sends + exposed DP/ZeRO), which counts only what is
exposed: a measured total far above it means communication is slower than priced, or hides
less than the plan assumes.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

PROCESS_GROUP_PREFIXES = ("nccl:", "gloo:")
NCCL_KERNEL_PREFIX = "nccl"


def collective_seconds(events: Any) -> float:
    """Seconds spent in collectives by a profiler's ``key_averages()`` (module doc)."""
    kernels = [e for e in events if e.key.startswith(NCCL_KERNEL_PREFIX) and e.device_time_total > 0]
    if kernels:
        return sum(e.device_time_total for e in kernels) / 1e6
    return sum(e.cpu_time_total for e in events if e.key.startswith(PROCESS_GROUP_PREFIXES)) / 1e6


def predicted_comm_s(plan: Any) -> float:
    """The plan's predicted communication on the step's critical path: TP collectives,
    pipeline sends and exposed DP/ZeRO communication."""
    b = plan.predicted["breakdown_s"]
    return float(b["tp_comm"] + b["p2p"] + b["dp_comm"])


class CollectiveTimer:
    """Profiles steps k with (k + 1) % every == 0 (a warm-up step before each); ``step()`` after
    each step returns its collective seconds, or None for a step not profiled."""

    def __init__(self, every: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        assert every >= 2, every
        # Kineto prints "USDT: … profiler_start/stop" on stderr at every profiled step unless its
        # log level is above USDT (5); read when the profiler first starts. The user's setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.seconds: float | None = None
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=every - 2, warmup=1, active=1, repeat=0),
            on_trace_ready=self._ready,
        )
        self.profiler.start()

    def _ready(self, profiler: Any) -> None:
        self.seconds = collective_seconds(profiler.key_averages())

    def step(self) -> float | None:
        """Mark the end of a step; its collective seconds when it was profiled."""
        self.seconds = None
        with warnings.catch_warnings():  # each cycle's events cleared: what one step in N wants
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
            self.profiler.step()
        return self.seconds

    def close(self) -> None:
        self.profiler.stop()


__all__ = ["CollectiveTimer", "collective_seconds", "predicted_comm_s"]
