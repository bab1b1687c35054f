"""What a checkpoint's trip through a folder costs per rank: a DCP save and a DCP load of
S bytes each, with every rank at it at once as a plan switch does (``runtime.switch``), fitted
as time(S) = a + b·S per direction. ``a`` is DCP's own fixed cost for a state of that many
tensors (planning the save, its barriers, the metadata of every tensor, the threads that write
and read), ``b`` the folder's per-byte time. Measured at two sizes (``SIZES``), split into as
many tensors as the state to be moved holds; the load reads right after the save, as a switch
does (from the page cache where the machine keeps the files). Collective.

Measured here (2 gloo ranks, local disk, ``benchmarks/adaptive.py``): a switch from ZeRO-3 of a
25M-parameter GPT took 3.28 s where a placement and the folder's raw write/read bandwidth alone
predicted 1.05 s; priced with this fit, the next run's took 2.44 s against 2.35 s estimated."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.runtime.distributed import slowest_s

SIZES = (2**20, 32 * 2**20)
"""Bytes per rank of the two probes."""


@dataclass(frozen=True, kw_only=True)
class CheckpointCost:
    """time(S) = latency + S · seconds_per_byte, for a save and for a load of S bytes per rank."""

    save_latency_s: float
    save_s_per_byte: float
    load_latency_s: float
    load_s_per_byte: float


def _timed(nbytes: int, tensors: int, folder: Path) -> tuple[float, float]:
    """(save, load) seconds of ``nbytes`` per rank in ``tensors`` tensors through DCP, the slowest
    rank's each."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    size = max(1, nbytes // 4 // tensors)
    state = {f"rank{rank}.{i}": torch.ones(size, dtype=torch.float32) for i in range(tensors)}
    dist.barrier()
    began = time.perf_counter()
    dcp.save(state, checkpoint_id=str(folder))
    save = slowest_s(time.perf_counter() - began)
    began = time.perf_counter()
    dcp.load(state, checkpoint_id=str(folder))
    load = slowest_s(time.perf_counter() - began)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    return save, load


def checkpoint_cost(folder: str | Path, tensors: int = 1) -> CheckpointCost:
    """Measure ``CheckpointCost`` for a state of ``tensors`` tensors per rank, in a new folder
    under ``folder`` (removed after)."""
    base = Path(folder) / ".autopar-checkpoint-probe"
    (small_save, small_load), (big_save, big_load) = (_timed(n, tensors, base / str(n)) for n in SIZES)
    span = SIZES[1] - SIZES[0]
    save_b, load_b = max(0.0, (big_save - small_save) / span), max(0.0, (big_load - small_load) / span)
    if dist.get_rank() == 0 and base.exists():
        base.rmdir()
    return CheckpointCost(
        save_latency_s=max(0.0, small_save - save_b * SIZES[0]),
        save_s_per_byte=save_b,
        load_latency_s=max(0.0, small_load - load_b * SIZES[0]),
        load_s_per_byte=load_b,
    )


__all__ = ["SIZES", "CheckpointCost", "checkpoint_cost"]
