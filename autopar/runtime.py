"""Runtime: ``parallelize`` applies a Plan to a model on torch.distributed (data parallel plans).

This first runtime executes plans with tp = pp = 1: data parallelism with
ZeRO 0 (DDP), ZeRO 1 (``ZeroRedundancyOptimizer`` over DDP), ZeRO 2 and 3
(FSDP2 ``fully_shard`` per block and at the root, ``reshard_after_forward``
False and True), per-block activation recomputation (non-reentrant
``checkpoint_wrapper``; selective wraps the block's attention submodule),
bf16 or fp16 mixed precision (FSDP2 ``MixedPrecisionPolicy`` with fp32
reduction, or autocast under DDP; fp16 adds dynamic loss scaling with
``GradScaler``, ``ShardedGradScaler`` where parameters are sharded) and
gradient accumulation over the plan's micro-batches (no gradient sync until
the last one). Tensor- and pipeline-parallel plans arrive with their passes.

Checkpoints go through ``torch.distributed.checkpoint``. ZeRO-1's optimizer
state is keyed by parameter name and saved by the rank that owns it, so a
checkpoint loads under any other world size or ZeRO stage of the same model.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.checkpointing import flatten, load_zero1_state, map_dtensors, restride, unstride, zero1_state
from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.plan import Plan

DEFAULT_TIMEOUT_S = 300.0
"""Process-group timeout: a mismatched collective becomes an error, not a hang."""


def lm_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a language model's logits (a tensor or ``.logits``)."""
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise AutoparError("the default loss needs logits of shape (batch, seq, vocab); pass loss_fn=")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def scalar(x: Any) -> Any:
    """A DTensor as the whole plain tensor (a vocab-parallel loss is a replicated DTensor);
    anything else unchanged."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def whole_logits(
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``loss_fn`` for tensor-parallel plans, whose logits may leave split over the vocabulary
    (DTensors): ``lm_loss`` computes on them vocab-parallel (under ``loss_parallel``); any other
    loss gets them gathered whole."""
    if loss_fn is lm_loss:
        return loss_fn

    def gathered(output: Any, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils._pytree import tree_map

        return loss_fn(tree_map(scalar, output), tokens)

    return gathered


def device_type() -> str:
    """Where this rank computes: ``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(model: nn.Module, plan: Plan) -> torch.dtype | None:
    """bf16/fp16 plans on fp32 weights compute in half precision with fp32 master weights and fp32
    gradient reduction; None when the plan is fp32 or the weights already are the compute dtype."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.strategy.dtype)
    return half if next(model.parameters()).dtype == torch.float32 else None


def fsdp_policy(half: torch.dtype | None) -> Any:
    """FSDP2's mixed precision for ``compute_dtype``: half-precision parameters, fp32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return (
        MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
    )


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


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group from the torchrun environment if there is none (NCCL on GPUs, gloo else)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise AutoparError("no process group and no torchrun environment: launch with torchrun")
    backend = "nccl" if device_type() == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _agree_on_plan(plan: Plan) -> None:
    """Every rank must hold the same plan before any other collective runs."""
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, plan.hash)
    if len(set(hashes)) != 1:
        raise AutoparError(
            f"ranks hold different plans (hashes {sorted(set(hashes))}); plan once and share it"
        )


def _apply_recompute(model: nn.Module, plan: Plan) -> int:
    """Wrap each block the plan recomputes; returns how many were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from autopar.passes.pipeline_split import is_attention

    wrapped = 0
    for name, choice in plan.recompute.items():
        if choice == "none":
            continue
        target = name
        if choice == "selective":
            block = model.get_submodule(name)
            attn = next((n for n, _ in block.named_children() if is_attention(n)), None)
            if attn is None:
                continue
            target = f"{name}.{attn}"
        parent_name, _, child = target.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, checkpoint_wrapper(getattr(parent, child)))
        wrapped += 1
    return wrapped


def _blocks(model: nn.Module, plan: Plan) -> list[nn.Module]:
    return [model.get_submodule(n) for n in plan.recompute]


def agree_on_batch(batch: torch.Tensor, st: Any) -> None:
    """Every rank checks every rank's batch size first: a wrong batch on one rank is an error on
    every rank, not a hang in the other ranks' collectives."""
    expected = st.global_batch // st.dp
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([batch.shape[0]]))
    bad = [(rank, int(n)) for rank, n in enumerate(sizes) if int(n) != expected]
    if bad:
        rank, n = bad[0]
        raise AutoparError(
            f"rank {rank}'s batch has {n} sequences but the plan gives each of its {st.dp} "
            f"data-parallel ranks {expected} (global batch {st.global_batch})"
        )


@torch.no_grad()
def reduce_partial_grads(params: list[nn.Parameter], group: Any) -> None:
    """Sum the gradients of ``params`` over ``group`` in one bucketed all-reduce (TP-partial
    gradients under sequence parallelism; a tied weight's gradients on several pipeline ranks)."""
    import torch.distributed._functional_collectives as funcol

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flat = funcol.wait_tensor(funcol.all_reduce(torch.cat([x.reshape(-1) for x in local]), "sum", group))
    offset = 0
    for x in local:
        x.copy_(flat[offset : offset + x.numel()].view_as(x))
        offset += x.numel()


class PlacedModel:
    """What the data/tensor-parallel and the pipeline runtimes share."""

    plan: Plan
    autocast_dtype: torch.dtype | None

    @property
    def micro_batches(self) -> int:
        return self.plan.strategy.micro_batches

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: pipeline and TP ranks of one replica share data
        (mesh (pp, dp, tp), TP innermost)."""
        st = self.plan.strategy
        return (dist.get_rank() // st.tp) % st.dp

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type(), dtype=self.autocast_dtype)

    def _loss_parallel(self) -> contextlib.AbstractContextManager[Any]:
        """Cross-entropy on logits split over the vocabulary (forward and backward run inside)."""
        if self.plan.strategy.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


@dataclass
class ParallelModel(PlacedModel):
    """A model placed by a plan; ``train_step`` runs one optimizer step on this rank's data."""

    module: nn.Module
    """The wrapped module (DDP or FSDP2)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over this rank's parameters."""
    plan: Plan
    """The plan being executed."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """loss(model output, batch) → scalar."""
    autocast_dtype: torch.dtype | None = None
    """Autocast dtype under DDP (FSDP2 casts parameters itself)."""
    scaler: Any = None
    """fp16 only: the dynamic loss scaler (``GradScaler`` or ``ShardedGradScaler``)."""
    partial_grads: list[nn.Parameter] = field(default_factory=list)
    """TP with sequence parallelism: replicated parameters whose gradients are partial over the TP
    group (all-reduced once per step, in one bucket)."""
    tp_group: Any = ""
    """Name of this rank's TP process group."""

    def _sync(self, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(enabled)
        elif not enabled and isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def train_step(self, batch: torch.Tensor) -> float:
        """Forward, backward over the plan's micro-batches, optimizer step; returns the mean loss
        over all data-parallel ranks. ``batch`` is this rank's share: global batch / dp rows."""
        st = self.plan.strategy
        agree_on_batch(batch, st)
        total = torch.zeros((), dtype=torch.float32)
        for i, micro in enumerate(batch.split(st.micro_batch)):
            with self._sync(i == self.micro_batches - 1), self._autocast(), self._loss_parallel():
                loss = self.loss_fn(self.module(micro), micro)
                if loss.dim() != 0:
                    raise AutoparError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
                scaled = loss / self.micro_batches
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            total += scalar(loss).detach().float()
        reduce_partial_grads(self.partial_grads, self.tp_group)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when a gradient overflowed; then the scale halves
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean = total / self.micro_batches
        dist.all_reduce(mean)  # SUM: gloo has no AVG
        return float(mean) / dist.get_world_size()

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor) -> float:
        """Mean loss of this rank's batch over all ranks, without gradients or updates."""
        parts = batch.split(self.plan.strategy.micro_batch)  # a captured graph runs one micro-batch
        loss = torch.zeros((), dtype=torch.float32)
        with self._autocast(), self._loss_parallel():
            for micro in parts:
                loss += scalar(self.loss_fn(self.module(micro), micro)).detach().float() / len(parts)
        dist.all_reduce(loss)
        return float(loss) / dist.get_world_size()

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for ``torch.distributed.checkpoint`` (sharded as trained)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state: dict[str, Any]
        if self.plan.strategy.zero == 1:
            state = {"model": get_model_state_dict(self.module), "optimizer": zero1_state(self)}
        else:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return map_dtensors(state, unstride)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict`` (after ``torch.distributed.checkpoint.load`` into it)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.plan.strategy.tp > 1:  # fused-QKV shards were saved as plain shards
            state = map_dtensors(state, restride, like=self.state_dict_placements())
        if self.plan.strategy.zero == 1:
            set_model_state_dict(self.module, state["model"])
            load_zero1_state(self, state["optimizer"])
        else:
            set_state_dict(
                self.module,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def state_dict_placements(self) -> dict[str, Any]:
        """Flattened key → the DTensor placements training uses (to undo ``unstride`` on load)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        flat: dict[str, Any] = {}
        flatten({"model": model_sd, "optimizer": optim_sd}, "", flat)
        return {k: v.placements for k, v in flat.items() if hasattr(v, "placements")}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters under the original names (collective: call on every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def plan_for_world(
    model: nn.Module,
    cluster: Cluster,
    *,
    global_batch: int,
    seq: int,
    dtype: str = "fp32",
    constraints: Any = None,
) -> Plan:
    """Rank 0 plans for the launched world and broadcasts the plan (every rank calls this).
    ``constraints`` (``planner.Constraints``) fixes knobs; the planner chooses the rest."""
    world = dist.get_world_size()
    if cluster.world_size != world:
        raise AutoparError(
            f"the cluster has {cluster.world_size} GPUs but {world} processes were launched; "
            "describe the cluster you launched on (e.g. Cluster.preset('cpu', gpus_per_node=N))"
        )
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        from autopar.costing import profile_fn
        from autopar.planner import Constraints, make_plan

        try:
            result = make_plan(
                type(model).__name__,
                profile_fn(model, dtype=dtype, seq=seq),  # captured on fake tensors: no compute
                cluster,
                global_batch=global_batch,
                seq=seq,
                dtype=dtype,
                constraints=constraints or Constraints(),
            )
            box[0] = ("plan", result.plan.to_json())
        except AutoparError as e:  # every rank must hear it, not wait for a plan
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, text = box[0]
    if kind == "error":
        raise AutoparError(text)
    return Plan.from_json(text)


def check_runnable(plan: Plan) -> None:
    """Raise a clear error for a plan this runtime cannot execute (before any process starts)."""
    st = plan.strategy
    if st.pp > 1 and st.dtype == "fp16":
        raise AutoparError(
            "fp16 loss scaling does not run under pipeline schedules yet; plan pipelines with --dtype bf16"
        )


def parallelize(
    model: nn.Module,
    plan: Plan | Cluster,
    *,
    global_batch: int | None = None,
    seq: int | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    optimizer_kwargs: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    constraints: Any = None,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on this rank (call on every rank, inside torchrun).

    ``plan`` is a Plan, or a Cluster to plan for here (rank 0 plans for the launched world
    with ``global_batch`` and ``seq``, under ``constraints`` if given, and broadcasts).
    Pipeline plans return a ``runtime_pp.PipelineModel`` (the same surface).
    The optimizer is ``optimizer_cls(params, **optimizer_kwargs)`` (default AdamW, lr 1e-3),
    sharded over the data-parallel ranks under ZeRO ≥ 1.
    """
    init_distributed(timeout_s)
    if isinstance(plan, Cluster):
        if global_batch is None or seq is None:
            raise AutoparError("planning here needs global_batch= and seq= (or pass a Plan)")
        dtype = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
        plan = plan_for_world(
            model, plan, global_batch=global_batch, seq=seq, dtype=dtype, constraints=constraints
        )
    st = plan.strategy
    world = dist.get_world_size()
    if st.world_size != world:
        raise AutoparError(
            f"the plan is for {st.world_size} GPUs (tp·pp·dp = {st.tp}·{st.pp}·{st.dp}) but {world} "
            "processes were launched; re-plan for this world (autopar plan --nodes/--cluster)"
        )
    check_runnable(plan)
    model_blocks = {n for n, _ in model.named_modules()}
    missing = [n for n in plan.recompute if n not in model_blocks]
    if missing:
        raise AutoparError(
            f"the plan names layers this model lacks (e.g. {missing[0]!r}): it was made for {plan.model}"
        )
    _agree_on_plan(plan)
    kwargs = optimizer_kwargs if optimizer_kwargs is not None else {"lr": 1e-3}
    if st.tp > 1:
        loss_fn = whole_logits(loss_fn)
    if st.pp > 1:
        from autopar.runtime_pp import parallelize_pp

        return parallelize_pp(model, plan, loss_fn, optimizer_cls, kwargs)  # type: ignore[return-value]
    if st.tp > 1:
        from autopar.runtime_tp import parallelize_tp

        return parallelize_tp(model, plan, loss_fn, optimizer_cls, kwargs)
    _apply_recompute(model, plan)
    autocast = None
    half = compute_dtype(model, plan)
    scaler: Any = None
    if st.zero >= 2:
        from torch.distributed.fsdp import fully_shard

        mp = fsdp_policy(half)
        scaler = loss_scaler(plan, sharded=True)
        reshard = st.zero == 3
        for block in _blocks(model, plan):
            fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
        wrapped: nn.Module = model
        opt = optimizer_cls(model.parameters(), **kwargs)
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        autocast = half
        scaler = loss_scaler(plan, sharded=False)
        if st.zero == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_cls, **kwargs)
        else:
            opt = optimizer_cls(model.parameters(), **kwargs)
    return ParallelModel(
        module=wrapped, optimizer=opt, plan=plan, loss_fn=loss_fn, autocast_dtype=autocast, scaler=scaler
    )
