"""What the overhead benchmarks share: two gloo processes, variants timed step by step in turn.

Alternating the variants (a barrier before each step) lets both see the same machine state on
a shared, noisy CPU; the median of the steps after the warm-up is reported.
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopar.measure.launch import launch

WARMUP = 3
"""Steps dropped before the median (first-step allocations, pipeline shape inference)."""


def join(rank: int, init: str) -> None:
    """Join the 2-process gloo group (5-minute timeout) with one thread per process."""
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    torch.set_num_threads(1)


def alternate(variants: dict[str, Callable[[Any], Any]], batches: Any) -> dict[str, float]:
    """Median seconds per step of each variant after ``WARMUP`` steps, the variants taking
    turns on every batch."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for batch in batches:
        for name, step in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(batch)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts[WARMUP:]) for name, ts in times.items()}


def run_two(worker: Callable[..., None], *args: Any) -> dict[str, float]:
    """Spawn ``worker(rank, init, *args, out)`` on 2 processes; returns what rank 0 saved to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.pt"
        launch(worker, args=(f"file://{tmp}/init", *args, out), nprocs=2)
        times: dict[str, float] = torch.load(out)
    return times


def dp2_plan(model: torch.nn.Module, *, batch: int, seq: int, zero: int) -> str:
    """The planner's plan (JSON) for ``model`` (on the meta device) as DP2 with ZeRO ``zero``,
    micro-batch batch / 2, no recompute, fp32, on 2 cpu ranks."""
    from autopar import Cluster, Constraints, PlanRequest
    from autopar.planner import ModelProfiles, make_plan

    request = PlanRequest(
        model=model,
        name="bench-gpt",
        cluster=Cluster.preset("cpu", gpus_per_node=2),
        global_batch=batch,
        seq=seq,
        dtype="fp32",
        constraints=Constraints(tp=1, pp=1, dp=2, zero=zero, micro_batch=batch // 2, recompute=("none",)),
    )
    return make_plan(request, ModelProfiles.of(model, dtype="fp32", seq=seq)).plan.to_json()


def report(rank: int, times: dict[str, float], out: str) -> None:
    """Rank 0 saves the medians for ``run_two``; every rank leaves the process group."""
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()
