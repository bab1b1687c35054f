"""The device-side steps of ``parallelize``: the device mesh, mixed precision, data parallelism
(DDP, ZeRO-1, FSDP2), allocation of meta parameters, and the optimizers.

The mesh is (pp, dp, tp), TP innermost (inside a node). The data-parallel axis of a plan that
runs the model as written (tp = pp = 1) uses DDP for ZeRO 0 and 1 (``ZeroRedundancyOptimizer``
over DDP for 1) and FSDP2 ``fully_shard`` for 2 and 3; a captured plan's always runs through
FSDP2, since DDP and composable ``replicate`` do not compose with DTensor parameters or
pipeline stages: ZeRO 0–2 then keep parameters unsharded between forward and backward
(``reshard_after_forward=False``, ZeRO-2 memory), ZeRO 3 reshards them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.graph.meta import materialize
from autopar.plan import Plan
from autopar.runtime.distributed import device_type, local_device, set_group_timeout
from autopar.runtime.quantized import int8_hook
from autopar.runtime.steps import Stages, compute_dtype


def make_mesh(plan: Plan, timeout_s: float) -> PlanMesh:
    """The device mesh of the plan's degrees (``ParallelDims.mesh_dims``: (pp, dp, tp), dp as
    two dims under HSDP or EP, flattened back into "dp" for what runs over the whole axis: data,
    loss, dense ZeRO). Every group of it times out after ``timeout_s`` (torch would give each
    its backend's default)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = plan.strategy.dims
    names, shape = zip(*dims.mesh_dims, strict=True)
    root = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    mesh = PlanMesh(root, {name: root[parts]._flatten(name) for name, parts in dims.flattened.items()})
    for name in (*names, *dims.flattened):
        set_group_timeout(mesh[name].get_group(), timeout_s)
    return mesh


class PlanMesh:
    """A plan's ``DeviceMesh`` and the meshes of its flattened dims, indexed as one mesh:
    ``mesh["tp"]``, ``mesh["ep", "tp"]`` slice the root, a flattened name ("dp" under HSDP or
    EP) gives the mesh ``_flatten`` made (torch deprecates slicing those from the root)."""

    def __init__(self, root: Any, flattened: dict[str, Any]) -> None:
        self.root, self.flattened = root, flattened

    def __getitem__(self, names: str | tuple[str, ...]) -> Any:
        if isinstance(names, str) and names in self.flattened:
            return self.flattened[names]
        return self.root[names]


def fsdp_mesh(plan: Plan, mesh: Any) -> Any:
    """The mesh FSDP2 shards over (``ParallelDims.fsdp_dims``): the DP axis, or its (replicate,
    shard) dims under HSDP (a 2-D mesh is FSDP2's hybrid sharding: shard on the second dim,
    replicate on the first)."""
    dims = plan.strategy.dims.fsdp_dims
    return mesh[dims] if len(dims) > 1 else mesh[dims[0]]


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``Strategy.grad_reduce`` → the dtype gradients travel in."""


def fsdp_policy(half: torch.dtype | None, grad_reduce: str = "fp32") -> Any:
    """FSDP2's mixed precision for ``compute_dtype``: half-precision parameters; gradients reduced
    in bf16 when the plan says so, else in fp32 under half compute and in the weights' own dtype
    otherwise (an fp64 verify run must not round its gradients to fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = REDUCE_DTYPES[grad_reduce] if grad_reduce != "fp32" or half else None
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=reduce)


def dp_placement(param: nn.Parameter) -> Any:
    """FSDP2's dim for a parameter: not the dim of a fused column shard (``_StridedShard``, which a
    second shard of the same dim would scramble), else FSDP2's default (dim 0)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [p.dim for p in getattr(param, "placements", ()) if isinstance(p, _StridedShard)]
    if strided and param.dim() > 1:
        return Shard(1 if strided[0] == 0 else 0)
    return None


def shard_over_dp(stage: nn.Module, plan: Plan, dp_mesh: Any, half: torch.dtype | None) -> None:
    """FSDP2 over the DP axis: each block of the stage, then the stage (ZeRO-3 reshards
    parameters after forward; ZeRO 0–2 keep them until backward)."""
    from torch.distributed.fsdp import fully_shard

    from autopar.passes.recompute import has_submodule

    options = {
        "mesh": dp_mesh,
        "reshard_after_forward": plan.strategy.zero == 3,
        "mp_policy": fsdp_policy(half, plan.strategy.grad_reduce),
        "shard_placement_fn": dp_placement,
    }
    for name in plan.recompute:
        if has_submodule(stage, name):
            fully_shard(stage.get_submodule(name), **options)
    fully_shard(stage, **options)


def apply_data_parallel(stages: Stages, plan: Plan, mesh: Any, half: torch.dtype | None) -> bool:
    """The DP axis (dp > 1): DDP for a model run as written at ZeRO 0–1, else FSDP2 on every
    stage. Returns whether FSDP2 shards the stages (it then casts parameters itself; otherwise
    the forward runs under autocast)."""
    st = plan.strategy
    if st.dims.dp_cp == 1:
        return False
    if st.uses_ddp:  # the model as written (tp = pp = 1) at ZeRO 0–1
        from torch.nn.parallel import DistributedDataParallel

        # buckets of the plan's cap (``Strategy.bucket_mb``; priced in ``cost_models.buckets``),
        # gradients as views of them: otherwise the buckets are a second copy of every gradient
        # (torch's DDP docs: the saving "will be equal to the total gradients size"), which the
        # cost model's two in-flight buckets (memory.comm_buffer_bytes) do not price
        group = fsdp_mesh(plan, mesh).get_group()  # dp, or dp·cp under context parallelism
        if st.cp > 1:  # each rank's own positions: not a buffer DDP broadcasts from rank 0
            from autopar.passes.context_parallel import POSITIONS

            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                stages.modules[0], [POSITIONS]
            )
        ddp = DistributedDataParallel(
            stages.modules[0], process_group=group, gradient_as_bucket_view=True, bucket_cap_mb=st.bucket_mb
        )
        register_comm_hook(ddp, plan, group)
        stages.modules[0] = ddp
        return False
    for stage in stages.modules.values():
        shard_experts(stage, stages.experts, plan, mesh, half)
        shard_over_dp(stage, plan, fsdp_mesh(plan, mesh), half)
    return True


def shard_experts(
    stage: nn.Module, experts: list[str], plan: Plan, mesh: Any, half: torch.dtype | None
) -> None:
    """ep > 1: FSDP2 on each outlined experts module of the stage over the ranks holding the same
    experts (mesh dim ``edp``), before the blocks. It averages their gradients over those dp / ep
    ranks; ``passes.expert_parallel.combine`` has divided them by ep (each rank's sum the rows of
    its whole ep group): the mean over every data-parallel rank, as for the other weights. (FSDP2's
    own ``set_gradient_divide_factor`` would reduce with PREMUL_SUM, which gloo lacks.)"""
    from torch.distributed.fsdp import fully_shard

    from autopar.runtime.state import fqn

    st = plan.strategy
    wanted = set(experts)
    for name, module in stage.named_modules():
        if fqn(name) in wanted:
            fully_shard(
                module,
                mesh=mesh["edp"],
                reshard_after_forward=st.zero == 3,
                mp_policy=fsdp_policy(half, st.grad_reduce),
            )


POWERSGD_START_ITER = 10
"""Steps DDP all-reduces whole before PowerSGD compresses. torch's minimum is 2 (DDP rebuilds its
buckets after the first) and its default 1000, since early training is the most sensitive to
inexact gradients (torch's ``PowerSGDState`` docs). Measured on the benchmark GPT (2 gloo ranks,
SGD lr 0.5, 50 steps, rank 4; ``test_powersgd_rank4_converges_like_uncompressed_training``): the
last 5 steps' mean loss 2.6% above uncompressed when compressing from step 2, 1.3% from step 10."""


def register_comm_hook(ddp: Any, plan: Plan, group: Any) -> None:
    """The plan's gradient compression on DDP, through torch's comm hooks: PowerSGD
    (``powerSGD_hook``, error feedback and warm start on, seeded alike on every rank), or bf16
    reduction (``bf16_compress_hook``: each bucket cast to bf16 and divided by the group size,
    all-reduced, copied back), or int8 reduction (``quantized.int8_hook``: 8-bit codes per chunk
    of 512, all-gathered, averaged). None for fp32 reduction."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    st = plan.strategy
    if st.powersgd_rank:
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=st.powersgd_rank,
            start_powerSGD_iter=POWERSGD_START_ITER,
            random_seed=0,
        )
        hook = powerSGD_hook.powerSGD_hook
        ddp.register_comm_hook(state, hook if device_type() == "cuda" else _bucket_at_a_time(hook))
    elif st.grad_reduce == "int8":
        ddp.register_comm_hook(group, int8_hook)
    elif st.grad_reduce == "bf16":
        # torch's _compress_hook at bf16 under another name: DDP refuses the name
        # bf16_compress_hook without NCCL, while gloo reduces bf16 too (tested on gloo)
        ddp.register_comm_hook(
            group, lambda group, bucket: default_hooks._compress_hook(torch.bfloat16, group, bucket)
        )


def _bucket_at_a_time(hook: Any) -> Any:
    """``hook`` finishing each bucket before DDP hands it the next. PowerSGD issues Q's all-reduce
    from P's completion callback; gloo completes futures on its own thread, so that all-reduce
    can land before or after the next bucket's first one, differently on each rank (measured: a
    gloo "received data size doesn't match" abort at step 3). NCCL's futures complete as their
    kernels are enqueued, so there the chain stays in order without waiting."""

    def in_order(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        fut.wait()
        return fut

    # DDP checks the annotations themselves, not their strings (this module's __future__ import)
    in_order.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return in_order


def apply_materialize(stages: Stages, on_meta: bool) -> None:
    """A model built with meta parameters (``autopar.meta_parameters``): allocate this rank's
    stages only (their shards, after FSDP2); the weights come from a checkpoint."""
    if on_meta:
        for stage in stages.modules.values():
            materialize(stage, local_device())


class StageOptimizers:
    """One optimizer per local stage (DCP keys optimizer state by each stage's FQNs)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def apply_optimizer(
    stages: Stages, plan: Plan, optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any] | None
) -> StageOptimizers:
    """``optimizer_cls(params, **kwargs)`` per local stage (``kwargs`` None: lr 1e-3); under DDP
    at ZeRO 1 its states are sharded over the data-parallel ranks (``ZeroRedundancyOptimizer``).
    A weight two local stages share (a tied embedding and head on the first rank of a V) is
    updated by the first stage's optimizer only."""
    from torch.nn.parallel import DistributedDataParallel

    ordered = stages.ordered
    kwargs = {"lr": 1e-3} if kwargs is None else kwargs
    if plan.strategy.zero == 1 and isinstance(ordered[0], DistributedDataParallel):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero1 = ZeroRedundancyOptimizer(ordered[0].parameters(), optimizer_class=optimizer_cls, **kwargs)
        return StageOptimizers([zero1])
    seen: set[int] = set()
    optimizers = []
    for stage in ordered:
        mine = [p for p in stage.parameters() if id(p) not in seen]
        seen.update(id(p) for p in mine)
        optimizers.append(optimizer_cls([{"params": mine}], **kwargs))
    return StageOptimizers(optimizers)


def loss_scaler(plan: Plan, *, sharded: bool) -> Any:
    """fp16 plans: a dynamic loss scaler (``ShardedGradScaler`` where gradients are sharded, so
    overflow checks agree across shards; else ``GradScaler``: all-reduced gradients overflow
    alike on every rank). None for bf16/fp32."""
    if plan.strategy.dtype != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type())
    return torch.amp.GradScaler(device_type())


__all__ = [
    "PlanMesh",
    "StageOptimizers",
    "apply_data_parallel",
    "apply_materialize",
    "apply_optimizer",
    "compute_dtype",
    "dp_placement",
    "fsdp_mesh",
    "fsdp_policy",
    "loss_scaler",
    "make_mesh",
    "register_comm_hook",
    "shard_over_dp",
]
