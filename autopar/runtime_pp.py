"""Pipeline-parallel (and 3-D) plans at run time: split the captured model into this rank's
stages and run them with ``torch.distributed.pipelining``.

The mesh is (pp, dp, tp), TP innermost. Each rank captures the model, applies the
tensor-parallel pass on the TP axis (tp > 1), cuts the graph into the plan's chunks
(``passes.pipeline_split``), keeps only its own (chunk c runs on pipeline rank c mod p),
outlines each block into a submodule at its original path, wraps the blocks the plan
recomputes in ``checkpoint_wrapper``, shards blocks and stage with FSDP2 over the DP axis,
and hands the stages to the plan's schedule (GPipe, 1F1B, Interleaved1F1B). Parameters
read by chunks on several pipeline ranks (a tied embedding and head) have their gradients
summed over those ranks before the optimizer step, as Megatron does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autopar.errors import AutoparError
from autopar.graph import CapturedModel, capture
from autopar.graph.trace import retarget
from autopar.passes.pipeline_split import (
    fill_layers,
    outline_attention,
    outline_blocks,
    split_stages,
    stage_chunks,
)
from autopar.passes.tensor_parallel import is_param
from autopar.plan import Plan
from autopar.runtime import (
    PlacedModel,
    agree_on_batch,
    compute_dtype,
    device_type,
    fsdp_policy,
    reduce_partial_grads,
    scalar,
)

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
"""Plan schedule → ``torch.distributed.pipelining`` schedule class."""

WRAPPED = "_checkpoint_wrapped_module."
"""What ``checkpoint_wrapper`` inserts into parameter names (removed to get the model's FQNs)."""


def fqn(name: str) -> str:
    """A parameter name with wrapper prefixes removed: the original model's FQN."""
    return name.replace(WRAPPED, "")


def recompute_blocks(stage: fx.GraphModule, choices: dict[str, str]) -> fx.GraphModule:
    """Wrap the stage's blocks the plan recomputes: ``full`` the whole block, ``selective`` its
    attention (outlined into a submodule first)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, choice in choices.items():
        if choice == "none" or not _has(stage, name):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = stage.get_submodule(parent_name)
        block = getattr(parent, child)
        if choice == "full":
            setattr(parent, child, checkpoint_wrapper(block))
            continue
        block, attn = outline_attention(block, name)
        if attn is not None:
            setattr(block, attn, checkpoint_wrapper(getattr(block, attn)))
        setattr(parent, child, block)
    return stage


def shard_over_dp(stage: nn.Module, plan: Plan, dp_mesh: Any, half: torch.dtype | None) -> None:
    """FSDP2 over the DP axis: each block of the stage, then the stage (ZeRO-3 reshards parameters
    after forward; ZeRO 0–2 keep them until backward: DDP does not compose with DTensor or
    pipeline stages, so those plans keep ZeRO-2 memory)."""
    from torch.distributed.fsdp import fully_shard

    from autopar.runtime_tp import dp_placement

    st = plan.strategy
    options = {
        "mesh": dp_mesh,
        "reshard_after_forward": st.zero == 3,
        "mp_policy": fsdp_policy(half),
        "shard_placement_fn": dp_placement,
    }
    for name in plan.recompute:
        if _has(stage, name):
            fully_shard(stage.get_submodule(name), **options)
    fully_shard(stage, **options)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def shared_params(gm: fx.GraphModule, chunks: list[list[str]], names: list[str]) -> dict[str, set[int]]:
    """Trainable parameters read by more than one chunk → those chunks (tied embedding/head)."""
    chunk_of = {name: c for c, members in enumerate(chunks) for name in members}
    readers: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            param = gm.get_parameter(str(n.target)) if is_param(gm, str(n.target)) else None
            if param is None or not param.requires_grad:
                continue
            todo, seen = list(n.users), set()
            while todo:  # through to_local reads to the operators that use the weight
                u = todo.pop()
                if u in seen:
                    continue
                seen.add(u)
                if u.op == "call_method":
                    todo.extend(u.users)
                elif "autopar.layer" in u.meta:
                    readers.setdefault(str(n.target), set()).add(chunk_of[names[u.meta["autopar.layer"]]])
    return {k: v for k, v in readers.items() if len(v) > 1}


@dataclass
class TiedGroup:
    """Parameters held by several pipeline ranks and the process group that sums their gradients."""

    names: list[str]
    """Their names in this rank's stages."""
    group: Any
    """The process group of the ranks holding them (one per (dp, tp) coordinate)."""
    params: list[nn.Parameter] = field(default_factory=list)
    """The parameters themselves, once the stages are final (after FSDP2 replaced them)."""


def tied_groups(shared: dict[str, set[int]], mesh: Any, pp: int) -> list[TiedGroup]:
    """One process group per set of pipeline ranks sharing parameters, per (dp, tp) coordinate
    (every rank makes every group, in the same order; keeps those it belongs to)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, chunks in sorted(shared.items()):
        ranks = tuple(sorted({c % pp for c in chunks}))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(name)
    groups = []
    layout = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    for ranks, names in sorted(by_ranks.items()):
        subgroups = [
            [int(layout[k, d, t]) for k in ranks]
            for d in range(layout.shape[1])
            for t in range(layout.shape[2])
        ]
        mine, _ = dist.new_subgroups_by_enumeration(subgroups)
        if mine is not None:
            groups.append(TiedGroup(names=names, group=mine))
    return groups


class StageOptimizers:
    """One optimizer per local chunk (DCP keys optimizer state by each chunk's FQNs)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


@dataclass
class PipelineModel(PlacedModel):
    """This rank's pipeline stages under the plan's schedule; same surface as ``ParallelModel``."""

    stages: list[nn.Module]
    """This rank's chunks in execution order (GraphModules with the model's FQNs)."""
    optimizer: StageOptimizers
    """One optimizer per chunk."""
    plan: Plan
    """The plan being executed."""
    schedule: Any
    """The ``torch.distributed.pipelining`` schedule."""
    first: bool
    """Whether this rank runs the first chunk (takes the tokens)."""
    last: bool
    """Whether this rank runs the last chunk (computes the loss)."""
    autocast_dtype: torch.dtype | None = None
    """Autocast dtype when no FSDP2 casts parameters (dp = 1)."""
    partial_grads: list[nn.Parameter] = field(default_factory=list)
    """Sequence parallelism: parameters with TP-partial gradients (summed once per step)."""
    tp_group: Any = ""
    """Name of this rank's TP process group."""
    tied: list[TiedGroup] = field(default_factory=list)
    """Parameters shared with other pipeline ranks and the groups that sum their gradients."""
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """A tied parameter's name → all its names in the model (the graph reads it under one)."""
    needs_weights: bool = False
    """Built from meta parameters: the stages' memory is allocated but holds no values until
    ``load_full_state_dict`` or a DCP ``load_state_dict``."""

    def _with_aliases(self, state: dict[str, Any]) -> dict[str, Any]:
        return {alias: v for k, v in state.items() for alias in self.aliases.get(k, (k,))}

    @property
    def module(self) -> nn.ModuleList:
        """The local stages as one module (for users inspecting parameters)."""
        return nn.ModuleList(self.stages)

    def _run(self, run: Callable[..., Any], batch: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        with self._autocast(), self._loss_parallel():
            if self.first:
                run(batch, target=batch if self.last else None, losses=losses)
            else:
                run(target=batch if self.last else None, losses=losses)
        st = self.plan.strategy
        mean = torch.zeros((), dtype=torch.float32)
        if self.last:
            mean += sum(float(scalar(x).detach()) for x in losses) / len(losses)
        dist.all_reduce(mean)  # only the dp·tp last-stage ranks contribute
        return float(mean) / (st.dp * st.tp)

    def _check_weights(self) -> None:
        if self.needs_weights:
            raise AutoparError(
                "this model was built with meta parameters: load its weights first "
                "(load_full_state_dict, or torch.distributed.checkpoint.load + load_state_dict)"
            )

    def train_step(self, batch: torch.Tensor) -> float:
        """One optimizer step on this replica's ``batch`` (global batch / dp rows), pipelined over
        the plan's micro-batches; returns the mean loss over all data-parallel ranks."""
        self._check_weights()
        agree_on_batch(batch, self.plan.strategy)
        loss = self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), batch)
        reduce_partial_grads(self.partial_grads, self.tp_group)
        for tied in self.tied:  # embedding and head gradients of a tied weight add up
            reduce_partial_grads(tied.params, tied.group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor) -> float:
        """Mean loss of this replica's batch over all ranks, forward only."""
        self._check_weights()
        return self._run(self.schedule.eval, batch)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (the model's own ``state_dict()`` names, on the CPU, the same on
        every rank): each rank copies in only its stages' slices."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        for stage in self.stages:
            names = [k for k in stage.state_dict()]
            missing = [fqn(k) for k in names if fqn(k) not in state]
            if missing:
                raise AutoparError(f"the state dict has no {missing[0]!r}: it is not this model's")
            mine: dict[str, Any] = {k: state[fqn(k)] for k in names}
            set_model_state_dict(stage, mine, options=StateDictOptions(full_state_dict=True))
        self.needs_weights = False

    def _local_state(self) -> dict[str, Any]:
        """This rank's model and optimizer entries of every chunk, merged, under the model's
        names (optimizer state flattened by FQN, as DCP keys it)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for stage, opt in zip(self.stages, self.optimizer.optimizers, strict=True):
            model.update({fqn(k): v for k, v in get_model_state_dict(stage).items()})
            optim.update({fqn(k): v for k, v in get_optimizer_state_dict(stage, opt, options=flat).items()})
        return {"model": model, "optimizer": optim}

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for DCP under the original model's names (a tied weight
        under each of its names)."""
        from autopar.checkpointing import map_dtensors, unstride

        local = self._local_state()
        local["model"] = self._with_aliases(local["model"])
        return map_dtensors(local, unstride)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict`` (after ``torch.distributed.checkpoint.load`` into it)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from autopar.checkpointing import flatten, map_dtensors, restride

        if self.plan.strategy.tp > 1:  # fused-QKV shards were saved as plain shards
            like: dict[str, Any] = {}
            flatten(self._local_state(), "", like)
            placements = {k: v.placements for k, v in like.items() if hasattr(v, "placements")}
            state = map_dtensors(state, restride, like=placements)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        self.needs_weights = False
        for stage, opt in zip(self.stages, self.optimizer.optimizers, strict=True):
            names = {k: fqn(k) for k in stage.state_dict()}
            set_model_state_dict(
                stage, {k: state["model"][v] for k, v in names.items() if v in state["model"]}
            )
            optim_names = get_optimizer_state_dict(stage, opt, options=flat)
            mine = {k: state["optimizer"][fqn(k)] for k in optim_names if fqn(k) in state["optimizer"]}
            set_optimizer_state_dict(stage, opt, mine, options=flat)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters under the original names, from every stage (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            sd = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
            full.update({fqn(k): v.detach().cpu() for k, v in sd.items() if isinstance(v, torch.Tensor)})
        st = self.plan.strategy
        share = full if dist.get_rank() % (st.dp * st.tp) == 0 else {}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, share)
        return self._with_aliases({k: v for part in gathered for k, v in part.items()})


def set_buffers(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put each tensor of ``values`` (buffer name → tensor) in place of that buffer."""
    for name, b in values.items():
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._buffers[attr] = b


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta tensors on ``device`` (``to_empty``, which FSDP2 follows),
    keeping the values of buffers that already had them (rotary tables)."""
    real = {name: b.to(device) for name, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    set_buffers(module, real)


def tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter the model holds under several names → all of them."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: tuple(names) for names in groups.values() if len(names) > 1 for name in names}


def capture_with_meta_parameters(model: nn.Module, *, batch: int, seq: int) -> CapturedModel:
    """``capture``, also for a model with meta parameters and real buffers (``meta_parameters``):
    the buffers are traced as meta tensors, and the graph then reads the real ones."""
    real = {n: b for n, b in model.named_buffers() if not b.is_meta}
    if not real or not any(p.is_meta for p in model.parameters()):
        return capture(model, batch=batch, seq=seq)

    set_buffers(model, {n: b.to("meta") for n, b in real.items()})
    try:
        captured = capture(model, batch=batch, seq=seq)
    finally:
        set_buffers(model, real)
    for name, b in real.items():  # the graph's root copied the model's own buffers
        if "." not in name:
            captured.gm._buffers[name] = b
    retarget(captured.gm, next(iter(real.values())).device)
    return captured


def rewritten_graph(
    model: nn.Module, plan: Plan, tp_mesh: Any
) -> tuple[fx.GraphModule, list[str], list[str]]:
    """The model captured at the plan's micro-batch shape, rewritten for the TP axis when
    tp > 1, every node annotated with its layer: (graph, layer names, names of the parameters
    with TP-partial gradients). What the TP and pipeline runtimes both start from."""
    st = plan.strategy
    captured = capture_with_meta_parameters(model, batch=st.micro_batch, seq=st.seq)
    gm, partial = captured.gm, list[str]()
    if st.tp > 1:
        from autopar.runtime_tp import tensor_parallel_captured

        gm, partial = tensor_parallel_captured(captured, plan, tp_mesh)
    return fill_layers(gm), [layer.name for layer in captured.layers], partial


def build_stages(
    model: nn.Module, plan: Plan, mesh: Any
) -> tuple[dict[int, fx.GraphModule], list[str], list[TiedGroup], int]:
    """This rank's chunks (outlined, recompute applied, not yet sharded over DP), the names of
    TP-partial-gradient parameters, the tied-parameter groups, and the number of chunks."""
    st = plan.strategy
    gm, names, partial = rewritten_graph(model, plan, mesh["tp"])
    chunks = stage_chunks(names, [s.layers for s in plan.stages], st.virtual_stages)
    rank = mesh["pp"].get_local_rank()
    mine = [c for c in range(len(chunks)) if c % st.pp == rank]
    parts = split_stages(gm, lambda n: names[n.meta["autopar.layer"]], chunks, keep=mine)
    stages = {c: recompute_blocks(outline_blocks(parts[c], names), plan.recompute) for c in mine}
    tied = tied_groups(shared_params(gm, chunks, names), mesh, st.pp)
    return stages, partial, tied, len(chunks)


def parallelize_pp(
    model: nn.Module,
    plan: Plan,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
) -> PipelineModel:
    """pp > 1: this rank's stages on the (pp, dp, tp) mesh under the plan's schedule."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    st = plan.strategy
    aliases = tied_names(model)  # before the TP pass replaces parameters
    if st.schedule not in SCHEDULES:
        raise AutoparError(f"unknown pipeline schedule {st.schedule!r}; use one of {sorted(SCHEDULES)}")
    mesh = init_device_mesh(device_type(), (st.pp, st.dp, st.tp), mesh_dim_names=("pp", "dp", "tp"))
    stages, partial, tied, n_chunks = build_stages(model, plan, mesh)
    half = compute_dtype(model, plan)
    autocast = half
    if st.dp > 1:
        autocast = None
        for stage in stages.values():
            shard_over_dp(stage, plan, mesh["dp"], half)
    cuda = device_type() == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:  # allocate this rank's stages only; the weights come from a checkpoint
        for stage in stages.values():
            materialize(stage, device)
    group = mesh["pp"].get_group()
    pipes = [
        pipelining.PipelineStage(stage, c, n_chunks, device, group=group)
        for c, stage in sorted(stages.items())
    ]
    cls = getattr(pipelining, SCHEDULES[st.schedule])
    schedule = (
        cls(pipes, st.micro_batches, loss_fn=loss_fn)
        if st.virtual_stages > 1
        else cls(pipes[0], st.micro_batches, loss_fn=loss_fn)
    )
    ordered = [stages[c] for c in sorted(stages)]
    params = {fqn(n): p for s in ordered for n, p in s.named_parameters()}
    for shared in tied:
        shared.params = [params[n] for n in shared.names]
    return PipelineModel(
        stages=ordered,  # type: ignore[arg-type]
        optimizer=StageOptimizers([optimizer_cls(s.parameters(), **kwargs) for s in ordered]),
        plan=plan,
        schedule=schedule,
        first=0 in stages,
        last=n_chunks - 1 in stages,
        autocast_dtype=autocast,
        partial_grads=[params[n] for n in partial if n in params],
        tp_group=mesh["tp"].get_group().group_name,
        tied=tied,
        aliases=aliases,
        needs_weights=on_meta,
    )


__all__ = [
    "SCHEDULES",
    "PipelineModel",
    "build_stages",
    "fqn",
    "materialize",
    "parallelize_pp",
    "recompute_blocks",
    "rewritten_graph",
    "shard_over_dp",
]
