"""A running job moved to another plan in process: ``switch_plan(pm, model, plan, folder)``.

The state — weights, optimizer, loss scaler — is saved under the old plan with
``ParallelModel.save`` (a DCP folder: each rank writes its shards) and loaded into the model
placed by the new plan with ``ParallelModel.load``, which reshards between any two plans of one
model (``runtime.checkpoint``). Between the two the old placement is released: its stages and
optimizer dropped, the process groups it made destroyed (``ParallelModel.groups``), so the old and
the new plan never hold memory or gloo/NCCL communicators at once. This process's random state
is put back after the new model is built (building draws initial weights), so the steps after
the switch draw what they would have drawn without it; the data position is the caller's (step
k's batch is a function of k: ``GlobalBatches``).

The folder must be one every rank can read: local disk on one node, a shared file system across
nodes (DCP loads another rank's shards when the new plan holds other slices).
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.plan import Plan


def release(pm: Any) -> None:
    """Drop ``pm``'s stages, optimizer and schedule and destroy the process groups its placement
    made (never the default group). Collective in effect: every rank releases after a barrier,
    so no peer still has work in flight on a group being destroyed. ``pm`` is unusable after."""
    dist.barrier()
    groups, pm.groups = list(pm.groups), []
    pm.stages, pm.schedule, pm.tied, pm.partial_grads = [], None, [], []
    pm.optimizer = None
    gc.collect()
    for group in groups:
        if group is not dist.GroupMember.WORLD and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def switch_plan(
    pm: Any,
    build_model: Callable[[], nn.Module],
    plan: Plan,
    folder: str | Path,
    *,
    place: Callable[[nn.Module, Plan], Any],
) -> Any:
    """``pm``'s training state moved to a new placement of ``plan`` (see the module doc);
    ``place(model, plan)`` places a freshly built model (``runtime.parallelize`` with the run's
    loss and optimizer). Collective: call on every rank with the same plan. Returns the new
    ParallelModel; ``pm`` is released."""
    folder = Path(folder)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    pm.save(str(folder))
    release(pm)
    new = place(build_model(), plan)
    new.load(str(folder))
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    dist.barrier()  # every rank has read the folder
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    return new


__all__ = ["release", "switch_plan"]
