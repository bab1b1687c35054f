"""The Python surface: ``autopar.plan`` (a plan for a model on a cluster) and
``autopar.parallelize`` (a model placed on this rank by a plan, planned here when given a
cluster). The only place that puts the planner and the runtime together."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.groups import MixedCluster
from autopar.plan import Plan
from autopar.planner import make_plan
from autopar.request import Constraints, PlanRequest
from autopar.runtime import ParallelModel, init_distributed
from autopar.runtime import parallelize as place
from autopar.runtime.distributed import from_rank0
from autopar.runtime.loss import LossFn


def plan(
    model: str | nn.Module,
    cluster: Cluster | MixedCluster,
    *,
    global_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    constraints: Constraints | None = None,
    top_k: int = 5,
    time_limit_s: float = 10.0,
) -> Plan:
    """The fastest predicted plan for ``model`` (a module or a MODEL spec) on ``cluster``.

    Raises ``InfeasibleError`` when nothing fits (the message says what would).
    """
    request = PlanRequest(
        model=model,
        cluster=cluster,
        global_batch=global_batch,
        seq=seq_len,
        dtype=dtype,
        constraints=constraints or Constraints(),
        top_k=top_k,
        time_limit_s=time_limit_s,
    )
    return make_plan(request).plan


def plan_for_world(request: PlanRequest) -> Plan:
    """Rank 0 plans for the launched world and broadcasts the plan (every rank calls this; the
    model is captured on fake tensors: no compute, its weights are never read)."""
    world = dist.get_world_size()
    if request.cluster.world_size != world:
        raise AutoparError(
            f"the cluster has {request.cluster.world_size} GPUs but {world} processes were launched; "
            "describe the cluster you launched on (e.g. Cluster.preset('cpu', gpus_per_node=N))"
        )
    return Plan.from_json(from_rank0(lambda: make_plan(request).plan.to_json()))


def parallelize(
    model: nn.Module,
    plan: Plan | Cluster | MixedCluster,
    *,
    global_batch: int | None = None,
    seq: int | None = None,
    loss_fn: LossFn | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    optimizer_kwargs: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    constraints: Constraints | None = None,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on this rank (call on every rank, inside torchrun).

    ``plan`` is a Plan, or a Cluster to plan for here (rank 0 plans for the launched world
    with ``global_batch`` and ``seq``, under ``constraints`` if given, and broadcasts).
    The loss is ``loss_fn(output, tokens)``; by default the model's own (a forward that takes
    ``targets`` or ``labels``: ``graph.objective``), else next-token cross-entropy. The optimizer
    is ``optimizer_cls(params, **optimizer_kwargs)`` (default AdamW, lr 1e-3), sharded over the
    data-parallel ranks under ZeRO ≥ 1. ``timeout_s``: how long any collective of the plan waits
    for a rank that died or hangs, set on the process group whoever made it (None: the group's
    own, 300 s where autopar makes it).
    """
    timeout_s = init_distributed(timeout_s)
    if isinstance(plan, Cluster | MixedCluster):
        if global_batch is None or seq is None:
            raise AutoparError("planning here needs global_batch= and seq= (or pass a Plan)")
        dtype = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
        request = PlanRequest(
            model=model,
            cluster=plan,
            global_batch=global_batch,
            seq=seq,
            dtype=dtype,
            constraints=constraints or Constraints(),
        )
        plan = plan_for_world(request)
    return place(
        model,
        plan,
        loss_fn=loss_fn,
        optimizer_cls=optimizer_cls,
        optimizer_kwargs=optimizer_kwargs,
        timeout_s=timeout_s,
    )


__all__ = ["parallelize", "plan", "plan_for_world"]
