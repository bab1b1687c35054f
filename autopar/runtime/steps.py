"""The graph-side steps of ``parallelize``: capture, tensor-parallel pass, stage split, block
outlining, recomputation, regional compilation, and the parameters several pipeline ranks share.

Each step takes the ``Stages`` the one before made and skips itself where its degree is 1: with
tp = pp = 1 the model is not captured and runs as written (one stage: the model itself); with
pp = 1 the whole graph is the one stage.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autopar.graph import CapturedModel
from autopar.graph.meta import capture_as
from autopar.graph.objective import Objective
from autopar.mesh import simulated
from autopar.passes.compile import compile_blocks
from autopar.passes.expert_load import CountedLayer, count_expert_load
from autopar.passes.expert_parallel import EXPERTS, expert_parallel, outline_experts
from autopar.passes.loss_split import split_loss
from autopar.passes.pipeline_split import fill_layers, install, outline_blocks, split_stages, stage_chunks
from autopar.passes.recompute import has_submodule, recompute
from autopar.plan import Plan
from autopar.runtime.distributed import local_device
from autopar.runtime.state import fqn


@dataclass
class Stages:
    """This rank's share of the model as the steps build it."""

    modules: dict[int, nn.Module]
    """Chunk index → its module (chunk c runs on pipeline rank ``Strategy.chunk_rank(c)``);
    {0: the model} when the model is not captured."""
    captured: CapturedModel | None = None
    """The capture every rank starts from (tp > 1 or pp > 1)."""
    gm: fx.GraphModule | None = None
    """The captured graph after the tensor-parallel pass, every node annotated with its layer."""
    names: list[str] = field(default_factory=list)
    """The captured model's layer names, indexed by ``autopar.layer``."""
    partial: list[str] = field(default_factory=list)
    """Parameters whose gradients are partial over the TP group (summed once per step)."""
    chunks: list[list[str]] = field(default_factory=list)
    """Layer names of every chunk of the whole model (pp > 1; pp · virtual stages of them)."""
    loss_graph: fx.GraphModule | None = None
    """pp > 1, a model that computes its own loss: that loss, cut out of the graph
    (``passes.loss_split``); it reads the last ``len(outputs) - loss_kept`` stage outputs and the
    targets."""
    loss_kept: int = 0
    """How many of the last stage's outputs are the model's own (the rest feed ``loss_graph``)."""
    experts: list[str] = field(default_factory=list)
    """ep > 1: the module paths of this rank's routed experts (outlined; FSDP2 shards each over
    the data-parallel ranks holding the same experts)."""
    counted: list[CountedLayer] = field(default_factory=list)
    """A captured model's MoE layers whose rows are counted (``passes.expert_load``)."""
    positions: torch.Tensor | None = None
    """cp > 1: this rank's positions of each sequence (its loss reads their targets)."""

    @property
    def count(self) -> int:
        """Chunks of the whole model (1 without a pipeline)."""
        return max(1, len(self.chunks))

    @property
    def ordered(self) -> list[nn.Module]:
        """The local chunks in execution order."""
        return [self.modules[c] for c in sorted(self.modules)]


def compute_dtype(model: nn.Module, plan: Plan) -> torch.dtype | None:
    """bf16/fp16 plans on fp32 weights compute in half precision with fp32 master weights (the
    gradients reduced in the plan's ``grad_reduce`` dtype); None when the plan is fp32 or the
    weights already are the compute dtype."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.strategy.dtype)
    return half if next(model.parameters()).dtype == torch.float32 else None


def capture_graph(model: nn.Module, plan: Plan) -> Stages:
    """The model captured at the plan's micro-batch shape (meta parameters allowed). With dp > 1
    FSDP2 will cast the weights to the compute dtype (``sharding.fsdp_policy``): the graph is
    captured as the model computes then (``graph.meta.capture_as``); at dp = 1 the stages run
    under autocast, on the weights as they are."""
    st = plan.strategy
    half = compute_dtype(model, plan) if st.dims.dp_cp > 1 else None
    # under context parallelism a rank runs s / cp positions of each sequence (passes.context_parallel)
    captured = capture_as(model, batch=st.micro_batch, seq=st.seq // st.cp, dtype=half)
    return Stages(modules={}, captured=captured, names=[layer.name for layer in captured.layers])


def apply_capture(model: nn.Module, plan: Plan) -> Stages:
    """tp, pp, ep or cp > 1: ``capture_graph``. Otherwise the model itself, as written."""
    st = plan.strategy
    as_written = st.tp == 1 and st.pp == 1 and st.ep == 1 and st.cp == 1
    return Stages(modules={0: model}) if as_written else capture_graph(model, plan)


def graph_objective(stages: Stages, objective: Objective) -> Objective:
    """How the stages are fed: a captured graph has ``use_cache=False`` in it already."""
    return replace(objective, no_cache=False) if stages.captured is not None else objective


def apply_tensor_parallel(stages: Stages, plan: Plan, tp_mesh: Any) -> None:
    """tp > 1: rewrite the captured graph for the TP mesh axis ``tp_mesh`` (``passes.
    tensor_parallel``); the nodes the pass inserts are given the layer of their users."""
    if stages.captured is None:
        return
    gm = stages.captured.gm
    if plan.strategy.tp > 1:
        from autopar.passes.tensor_parallel import tensor_parallel_for_plan  # DTensor: imported when used

        gm, stages.partial = tensor_parallel_for_plan(stages.captured, plan, tp_mesh)
    stages.gm = fill_layers(gm)


def apply_context_parallel(stages: Stages, plan: Plan, mesh: Any, model: nn.Module) -> None:
    """cp > 1: this rank's positions of every sequence, attention over all of them
    (``passes.context_parallel``; the model's attention masks read on a capture at
    ``MASK_PROBE`` positions); the positions are kept for the loss. (A model configured with a
    sliding window was refused by ``distributed.check_model``.)"""
    st = plan.strategy
    if st.cp == 1 or stages.gm is None:
        return
    from autopar.graph.attention import SDPA
    from autopar.passes.context_parallel import MASK_PROBE, POSITIONS, context_parallel

    masked = any(
        n.target is SDPA and len(n.args) > 3 and isinstance(n.args[3], fx.Node) for n in stages.gm.graph.nodes
    )
    small = st.seq // st.cp <= MASK_PROBE  # its own masks are small enough to evaluate
    probe = capture_as(model, batch=1, seq=MASK_PROBE, dtype=None).gm if masked and not small else None
    cp_mesh = mesh["cp"]
    group = cp_mesh.get_group().group_name
    rank = cp_mesh.get_local_rank()
    gm = context_parallel(
        stages.gm, cp=st.cp, rank=rank, group=group, seq=st.seq, probe=probe, device=local_device()
    )
    stages.gm = fill_layers(gm)
    stages.positions = getattr(gm, POSITIONS)


def apply_expert_parallel(stages: Stages, plan: Plan, mesh: Any) -> None:
    """ep > 1: each MoE layer's experts split over the mesh's ep axis, rows sent to them and
    back by all-to-all (``passes.expert_parallel``)."""
    if plan.strategy.ep > 1 and stages.gm is not None:
        stages.gm = expert_parallel(stages.gm, mesh["ep", "tp"] if plan.strategy.tp > 1 else mesh["ep"])


def apply_expert_load(stages: Stages) -> None:
    """A captured model: count each MoE layer's routed and computed rows per expert
    (``passes.expert_load``; ``ParallelModel.last_expert_load`` reads them each step)."""
    if stages.gm is not None:
        stages.gm, stages.counted = count_expert_load(stages.gm)


def apply_loss_split(stages: Stages, plan: Plan, objective: Objective) -> None:
    """pp > 1 and the model computes its own loss: cut the loss out of the graph, to run as the
    pipeline's loss function on the real targets (``passes.loss_split``)."""
    if stages.gm is None or plan.strategy.pp == 1 or objective.target is None:
        return
    stages.gm, stages.loss_graph, stages.loss_kept = split_loss(stages.gm, objective.target)


def apply_pipeline_split(stages: Stages, plan: Plan, mesh: Any) -> None:
    """pp > 1: cut the graph into the plan's chunks and keep this rank's (chunk c on pipeline
    rank ``Strategy.chunk_rank(c)``); pp = 1: the whole graph is the one stage."""
    st = plan.strategy
    if stages.gm is None:
        return
    if st.pp == 1:
        stages.modules = {0: stages.gm}
        return
    names = stages.names
    if simulated():  # the chunks' boundaries as this rank's tensors are (after TP), for torch's schedule
        propagate_local_shapes(stages.gm, plan)
    per_rank = [s.chunks if st.virtual_stages > 1 else [s.layers] for s in plan.stages]
    stages.chunks = stage_chunks(names, per_rank, st.chunk_rank)
    rank = mesh["pp"].get_local_rank()
    mine = st.rank_chunks(rank)
    stages.modules = split_stages(
        stages.gm, lambda n: names[n.meta["autopar.layer"]], stages.chunks, keep=mine
    )


LOCAL = "autopar.local"
"""Node meta key: the value the node computes on this rank (a fake tensor of its local shape),
where a simulated rank (``distributed.simulated``) has propagated it (``propagate_local_shapes``)."""


def propagate_local_shapes(gm: fx.GraphModule, plan: Plan) -> None:
    """Run ``gm`` once on a micro-batch of token ids (fake tensors: nothing is computed) and keep
    each node's output under ``LOCAL``: the captured ``val`` is the model's, before the TP pass
    split activations (a sequence-parallel boundary is s / t long here). It runs in the precision
    training will: FSDP2's half-precision copies of the weights where dp > 1, autocast else
    (``sharding.fsdp_policy``, ``ParallelModel.precision``). torch's pipeline schedule is handed
    these shapes on a simulated rank, whose peers cannot send theirs."""
    st = plan.strategy
    weights = {name for name, _ in gm.named_parameters()}
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(st.dtype)
    if half is not None and all(gm.get_parameter(w).dtype == half for w in weights):
        half = None  # the weights compute in their own dtype

    class Recorder(fx.Interpreter):
        def fetch_attr(self, target: str) -> Any:
            value = super().fetch_attr(target)
            cast = half is not None and st.dp > 1 and target in weights
            return value.to(half) if cast else value

        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):  # whether it needs a gradient, not its graph
                n.meta[LOCAL] = out.detach().requires_grad_(out.requires_grad)
            return out

    tokens = torch.zeros((st.micro_batch, st.seq), dtype=torch.long)
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [tokens if v.dtype == torch.long else v for v in placeholders]
    autocast = half is not None and st.dp == 1
    with torch.autocast(local_device().type, dtype=half, enabled=autocast):
        Recorder(gm).run(*inputs)


def apply_outline_blocks(stages: Stages) -> None:
    """Blocks of a captured graph become submodules at their own paths (FSDP2 shards them,
    ``checkpoint_wrapper`` recomputes them, parameter FQNs stay the model's); under expert
    parallelism each block's experts become a submodule of it (``passes.expert_parallel``)."""
    if stages.gm is None:
        return
    stages.modules = {c: outline_blocks(m, stages.names) for c, m in stages.modules.items()}
    if not any(EXPERTS in n.meta for n in stages.gm.graph.nodes):
        return
    for module in stages.modules.values():
        for name, block in _blocks(module, stages.names):
            outlined, children = outline_experts(block, name)
            if children:
                install(module, name, outlined)
                stages.experts.extend(f"{name}.{c}" for c in children)


def _blocks(module: nn.Module, names: list[str]) -> list[tuple[str, fx.GraphModule]]:
    """The outlined blocks of a stage module, by path."""
    return [
        (n, m)
        for n in names
        if has_submodule(module, n) and isinstance(m := module.get_submodule(n), fx.GraphModule)
    ]


def apply_recompute(stages: Stages, plan: Plan) -> None:
    """Wrap the blocks the plan recomputes (``passes.recompute``)."""
    for module in stages.modules.values():
        recompute(module, plan.recompute, plan.strategy.policies)


def apply_compile(stages: Stages, plan: Plan) -> None:
    """compile = block: each block this rank holds compiled in place by ``torch.compile``
    (``passes.compile``), after recompute wrapping, before data-parallel sharding."""
    if plan.strategy.compile == "off":
        return
    for module in stages.modules.values():
        compile_blocks(module, plan.recompute)


def apply_regather(stages: Stages, plan: Plan) -> None:
    """tp > 1: each stage's forward runs under ``regather_saved``, so a tensor gathered from
    shards (sequence parallelism's column-parallel inputs) is kept as this rank's shard and gathered
    again in backward (``passes.tp_collectives``), as ``cost_models.memory.layer_activation_bytes``
    (÷ t under SP) and ``cost_models.tp.reshard`` price it."""
    if stages.gm is None or plan.strategy.tp == 1:
        return
    from autopar.passes.tp_collectives import regather_saved

    for module in stages.modules.values():
        entered: list[Any] = []

        def enter(_m: nn.Module, _args: Any, entered: list[Any] = entered) -> None:
            hooks = regather_saved()
            hooks.__enter__()
            entered.append(hooks)

        def leave(_m: nn.Module, _args: Any, _out: Any, entered: list[Any] = entered) -> None:
            entered.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)


# ---- parameters on several pipeline ranks ---------------------------------------------------


def shared_params(gm: fx.GraphModule, chunks: list[list[str]], names: list[str]) -> dict[str, set[int]]:
    """Trainable parameters read by more than one chunk → those chunks (tied embedding/head)."""
    from autopar.passes.tensor_parallel import is_param

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


def apply_tied_groups(stages: Stages, plan: Plan, timeout_s: float) -> list[TiedGroup]:
    """pp > 1: one process group per set of pipeline ranks sharing parameters, per rank of a
    stage (every rank makes every group, in the same order; keeps those it belongs to), each
    timing out after ``timeout_s`` as the mesh's do."""
    pp = plan.strategy.pp
    if pp == 1 or stages.gm is None:
        return []
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, chunks in sorted(shared_params(stages.gm, stages.chunks, stages.names).items()):
        ranks = tuple(sorted({plan.strategy.chunk_rank(c) for c in chunks}))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(name)
    groups = []
    timeout = datetime.timedelta(seconds=timeout_s)
    for ranks, names in sorted(by_ranks.items()):
        subgroups = plan.strategy.dims.groups("pp", along=ranks)  # one per rank of a stage
        mine, _ = dist.new_subgroups_by_enumeration(subgroups, timeout=timeout)
        if mine is not None:
            groups.append(TiedGroup(names=names, group=mine))
    return groups


def rebind_tied(stages: Stages, tied: list[TiedGroup]) -> dict[str, nn.Parameter]:
    """This rank's parameters by model name, as data parallelism left them (FSDP2 replaces them
    with DTensors), and each tied group pointed at them."""
    params = {fqn(n): p for s in stages.ordered for n, p in s.named_parameters()}
    for shared in tied:
        shared.params = [params[n] for n in shared.names]
    return params


def tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter the model holds under several names → all of them."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: tuple(names) for names in groups.values() if len(names) > 1 for name in names}


__all__ = [
    "Stages",
    "TiedGroup",
    "apply_capture",
    "apply_compile",
    "apply_context_parallel",
    "apply_outline_blocks",
    "apply_pipeline_split",
    "apply_recompute",
    "apply_tensor_parallel",
    "apply_tied_groups",
    "capture_graph",
    "rebind_tied",
    "shared_params",
    "tied_names",
]
