"""The runtime: a Plan applied to a model on this rank, as one straight sequence of steps that
every plan runs through (a degree of 1 skips its step):

    capture → tensor-parallel pass → context-parallel pass → expert-parallel pass → loss split → stage split
            → outline blocks (and their experts) → recompute → compile blocks → regather
            → data parallel (DDP / ZeRO-1 / FSDP2; experts over their own ranks) → allocate
            → optimizers → schedule

Only torch.distributed does the work: DeviceMesh, DTensor, DDP and ``ZeroRedundancyOptimizer``,
FSDP2 ``fully_shard`` with mixed precision, ``checkpoint_wrapper``, ``torch.distributed.
pipelining`` schedules, and DCP for checkpoints (``ParallelModel.state_dict``). The runtime
never plans: ``autopar.parallelize`` plans first when it is given a cluster.

    steps.py       capture, TP and EP passes, stage split, outlining, recompute, compile, tied parameters
    sharding.py    mesh, mixed precision, DDP / ZeRO-1 / FSDP2 (and the experts'), allocation, optimizers
    schedules.py   the micro-batch loop (pp = 1) or the pipeline schedule
    model.py       ParallelModel: train_step, eval_step, checkpoint state
    state.py       the checkpoint layout (DCP, ZeRO-1, fused-QKV shards)
    checkpoint.py  save / load checkpoint folders (atomic; another model's refused)
    switch.py      a running job moved to another plan in process (state resharded through DCP)
    quantized.py   int8 gradient reduction (a DDP comm hook)
    distributed.py the process group and what ranks agree on
    settle.py      at exit, gloo's worker threads settle before the interpreter finalizes
    loss.py        the loss: the model's own, next-token cross-entropy, or the user's
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autopar.plan import Plan
from autopar.runtime.distributed import (
    DEFAULT_TIMEOUT_S,
    agree_on_plan,
    agree_on_rng,
    check_node_groups,
    check_plan,
    check_runnable,
    groups_made,
    init_distributed,
)
from autopar.runtime.loss import LossFn, context_loss, lm_loss, resolve_objective, tail_loss, whole_logits
from autopar.runtime.model import ParallelModel
from autopar.runtime.schedules import apply_schedule
from autopar.runtime.sharding import (
    apply_data_parallel,
    apply_materialize,
    apply_optimizer,
    compute_dtype,
    loss_scaler,
    make_mesh,
)
from autopar.runtime.steps import (
    apply_capture,
    apply_compile,
    apply_context_parallel,
    apply_expert_load,
    apply_expert_parallel,
    apply_loss_split,
    apply_outline_blocks,
    apply_pipeline_split,
    apply_recompute,
    apply_regather,
    apply_tensor_parallel,
    apply_tied_groups,
    graph_objective,
    rebind_tied,
    tied_names,
)


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: LossFn | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    optimizer_kwargs: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on this rank (call on every rank, inside torchrun).

    The loss is ``loss_fn(output, tokens)``, by default the model's own where it computes one
    (``runtime.loss.resolve_objective``), else next-token cross-entropy. The optimizer is
    ``optimizer_cls(params, **optimizer_kwargs)`` per local stage (default AdamW, lr 1e-3),
    sharded over the data-parallel ranks under ZeRO ≥ 1; ``timeout_s``: ``init_distributed``'s.
    The process groups the placement makes are ``ParallelModel.groups`` (``switch.release``)."""
    timeout_s = init_distributed(timeout_s)
    with groups_made() as made:
        pm = _place(model, plan, loss_fn, optimizer_cls, optimizer_kwargs, timeout_s)
    pm.groups = made
    return pm


def _place(
    model: nn.Module,
    plan: Plan,
    loss_fn: LossFn | None,
    optimizer_cls: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any] | None,
    timeout_s: float,
) -> ParallelModel:
    """``parallelize``'s steps, in order."""
    check_plan(model, plan)
    agree_on_plan(plan)
    check_node_groups(plan)
    st = plan.strategy
    on_meta = any(p.is_meta for p in model.parameters())
    half = compute_dtype(model, plan)
    aliases = tied_names(model)  # before the TP pass replaces parameters
    objective, loss_fn = resolve_objective(model, loss_fn, pp=st.pp, cp=st.cp)
    mesh = make_mesh(plan, timeout_s)
    if st.tp > 1:
        agree_on_rng(mesh["tp"].get_group())  # replicated activations draw the same dropout masks
    objective = graph_objective(stages := apply_capture(model, plan), objective)
    apply_tensor_parallel(stages, plan, mesh["tp"])
    apply_context_parallel(stages, plan, mesh, model)
    apply_expert_load(stages)
    apply_expert_parallel(stages, plan, mesh)
    apply_loss_split(stages, plan, objective)
    apply_pipeline_split(stages, plan, mesh)
    apply_outline_blocks(stages)
    apply_recompute(stages, plan)
    apply_compile(stages, plan)
    apply_regather(stages, plan)
    tied = apply_tied_groups(stages, plan, timeout_s)
    fsdp = apply_data_parallel(stages, plan, mesh, half)
    apply_materialize(stages, on_meta)
    optimizer = apply_optimizer(stages, plan, optimizer_cls, optimizer_kwargs)
    loss_fn = _stage_loss(stages, plan, loss_fn)
    schedule = apply_schedule(stages, plan, mesh, loss_fn)
    params = rebind_tied(stages, tied)  # the parameters as FSDP2 left them
    return ParallelModel(
        stages=stages.ordered,
        optimizer=optimizer,
        plan=plan,
        schedule=schedule,
        loss_fn=loss_fn,
        objective=objective,
        autocast_dtype=None if fsdp else half,
        scaler=loss_scaler(plan, sharded=fsdp or st.tp > 1),
        partial_grads=[params[n] for n in stages.partial if n in params],
        tp_group=mesh["tp"].get_group().group_name,
        tied=tied,
        aliases=aliases,
        needs_weights=on_meta,
        counted=stages.counted,
    )


def _stage_loss(stages: Any, plan: Plan, loss_fn: LossFn) -> LossFn:
    """The loss the last stage takes: the model's own cut out of its graph (pp > 1), a cp rank's
    share of next-token cross-entropy, on logits gathered whole under TP where it needs them."""
    st = plan.strategy
    loss_fn = tail_loss(stages.loss_graph, stages.loss_kept) if stages.loss_graph is not None else loss_fn
    loss_fn = context_loss(stages.positions, st.cp) if stages.positions is not None else loss_fn
    return whole_logits(loss_fn) if st.tp > 1 else loss_fn


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ParallelModel",
    "check_runnable",
    "init_distributed",
    "lm_loss",
    "parallelize",
]
