"""How a step runs the plan's micro-batches: one after another on this rank with gradient
accumulation (pp = 1), or through a ``torch.distributed.pipelining`` schedule (pp > 1: GPipe,
1F1B, Interleaved1F1B, and the zero-bubble InterleavedZeroBubble, ZBVZeroBubble, DualPipeV).
Both return the losses this rank computed, one per micro-batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.graph.objective import Objective
from autopar.mesh import simulated
from autopar.plan import Plan
from autopar.runtime.distributed import local_device
from autopar.runtime.loss import LossFn, scalar
from autopar.runtime.steps import LOCAL, Stages
from autopar.strategy import MULTI_CHUNK

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Plan schedule → ``torch.distributed.pipelining`` schedule class (the multi-chunk ones take a
list of this rank's stages, ``strategy.MULTI_CHUNK``)."""


class Runner(Protocol):
    """What a schedule needs of the model it runs."""

    @property
    def loss_fn(self) -> LossFn: ...

    @property
    def scaler(self) -> Any: ...

    @property
    def objective(self) -> Objective: ...

    def precision(self) -> contextlib.AbstractContextManager[Any]: ...


class LocalSchedule:
    """pp = 1: the micro-batches in turn, each loss / m backward (gradients accumulate; m the mean
    micro-batches per replica, so that replicas running uneven shares still average the global
    batch: Σ_d Σ_i ∇loss_di / (dp · m) = Σ ∇loss / Σ shares).

    How gradients accumulate follows the ZeRO stage, as the cost model prices it
    (``cost_models.dp_overlap.dp_exposed_s``, ``terms.rank_memory_terms``): ZeRO 0–1 accumulate whole
    gradients and reduce once, after the last micro-batch; ZeRO-2/3 reduce-scatter every
    micro-batch's gradients and accumulate only the shard (Rajbhandari et al. SC'20 §5.2), so
    no rank ever holds the whole model's gradients. Below ZeRO-3 the gathered parameters stay
    until the last backward (one gather per step)."""

    def __init__(self, module: nn.Module, plan: Plan) -> None:
        self.module = module
        self.micro_batch, self.micro_batches = plan.strategy.micro_batch, plan.strategy.micro_batches
        self.zero = plan.strategy.zero

    def _sync(self, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(enabled or self.zero >= 2)
            if self.zero < 3:
                self.module.set_reshard_after_backward(enabled)
        elif not enabled and isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def _loss(self, runner: Runner, micro: torch.Tensor) -> torch.Tensor:
        """The module on one micro-batch, fed as the objective says, and its loss."""
        args, kwargs = runner.objective.inputs(micro)
        return runner.loss_fn(self.module(*args, **kwargs), micro)

    def step(self, runner: Runner, batch: torch.Tensor) -> list[torch.Tensor]:
        losses = []
        micros = batch.split(self.micro_batch)  # this replica's count (``Strategy.dp_shares``)
        for i, micro in enumerate(micros):
            with self._sync(i == len(micros) - 1), runner.precision():
                loss = self._loss(runner, micro)
                if loss.dim() != 0:
                    raise AutoparError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
                scaled = loss / self.micro_batches
                if runner.scaler is not None:
                    scaled = runner.scaler.scale(scaled)
                scaled.backward()
            losses.append(scalar(loss).detach())
        return losses

    def eval(self, runner: Runner, batch: torch.Tensor) -> list[torch.Tensor]:
        with runner.precision():  # a captured graph runs one micro-batch at a time
            return [scalar(self._loss(runner, micro)).detach() for micro in batch.split(self.micro_batch)]


class PipelineSchedule:
    """pp > 1: the plan's schedule over this rank's stages; the first rank feeds the tokens, the
    last computes the losses.

    Gradients are averaged over the m micro-batches here, once per parameter, not by torch's
    schedule (``scale_grads=False``): torch divides each stage's parameters, so a weight two
    stages of one rank share (a tied embedding and head, both on the first rank of a V)
    would be divided twice."""

    def __init__(
        self, schedule: Any, *, first: bool, last: bool, params: list[nn.Parameter], micro_batches: int
    ) -> None:
        self.schedule, self.first, self.last, self.micro_batches = schedule, first, last, micro_batches
        self.params = list({id(p): p for p in params}.values())

    def _run(self, runner: Runner, run: Callable[..., Any], batch: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        # torch's schedules run each backward as input gradients with retain_graph=True, then
        # weight gradients: a compiled block (``Strategy.compile``) must not donate its saved
        # buffers to the first (AOT autograd's check, read when compiling and in backward)
        with runner.precision(), torch._functorch.config.patch(donated_buffer=False):
            inputs, kwargs = runner.objective.inputs(batch)  # (own loss: its targets go to the last stage)
            target = next(iter(kwargs.values()), batch)
            run(*(inputs if self.first else ()), target=target if self.last else None, losses=losses)
        return [scalar(x).detach() for x in losses]

    def step(self, runner: Runner, batch: torch.Tensor) -> list[torch.Tensor]:
        losses = self._run(runner, lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), batch)
        with torch.no_grad():
            for p in self.params:  # the mean over micro-batches (torch's scale_grads, once per weight)
                if p.grad is not None:
                    p.grad.div_(self.micro_batches)
        return losses

    def eval(self, runner: Runner, batch: torch.Tensor) -> list[torch.Tensor]:
        return self._run(runner, self.schedule.eval, batch)


def apply_schedule(
    stages: Stages, plan: Plan, mesh: Any, loss_fn: LossFn
) -> LocalSchedule | PipelineSchedule:
    """pp = 1: the local micro-batch loop; pp > 1: this rank's stages as ``PipelineStage`` s
    under the plan's ``torch.distributed.pipelining`` schedule (one stage per chunk it holds)."""
    st = plan.strategy
    if st.pp == 1:
        return LocalSchedule(stages.modules[0], plan)
    from torch.distributed import pipelining

    if st.schedule not in SCHEDULES:
        raise AutoparError(f"unknown pipeline schedule {st.schedule!r}; use one of {sorted(SCHEDULES)}")
    group = mesh["pp"].get_group()
    pipes = [
        pipelining.PipelineStage(stage, c, stages.count, local_device(), group=group, **_static_shapes(stage))
        for c, stage in sorted(stages.modules.items())
    ]
    for pipe in pipes:
        drop_input_grads(pipe)
    cls = getattr(pipelining, SCHEDULES[st.schedule])
    local = pipes if st.schedule in MULTI_CHUNK else pipes[0]
    replica = st.dims.coordinate(dist.get_rank(), "dp") if dist.is_initialized() else 0
    schedule = cls(local, st.replica_micro_batches(replica), loss_fn=loss_fn, scale_grads=False)
    if simulated():  # its peers can't vote: the shapes are given (``_static_shapes``)
        schedule._warmup_p2p = _static_mode
    params = [p for stage in stages.modules.values() for p in stage.parameters()]
    first, last = 0 in stages.modules, stages.count - 1 in stages.modules
    return PipelineSchedule(schedule, first=first, last=last, params=params, micro_batches=st.micro_batches)


def drop_input_grads(stage: Any) -> None:
    """Frees each micro-batch's input gradient once a split backward has computed it.

    torch's ``stage_backward_input`` (the input-gradient pass of the zero-bubble schedules) also
    stores the gradient as ``.grad`` of the stage's input, a receive buffer torch keeps for the
    whole step (one per micro-batch), and never clears it, unlike ``stage_backward``, which
    clears it. Every micro-batch's gradient would stay to the step's end, and on into the next:
    m · chunks · b·s·h/t bytes. The send reads its own reference (``bwd_cache``), the weight
    pass none, so it is dropped when the input-gradient pass returns."""
    run = stage.backward_one_chunk

    def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = run(bwd_chunk_id, *args, **kwargs)
        state = stage.backward_state.get(bwd_chunk_id)  # a split backward's, until its W
        for t in state[0] if state else ():
            if isinstance(t, torch.Tensor):
                t.grad = None
        return out

    stage.backward_one_chunk = backward_one_chunk


def _static_shapes(stage: nn.Module) -> dict[str, Any]:
    """On a simulated rank, a chunk's input and output tensors as this rank computes them
    (``steps.propagate_local_shapes``) for torch's static stage metadata; else nothing: torch
    infers them at the first step by asking the neighbouring ranks."""
    if not simulated():
        return {}
    graph = stage.graph if isinstance(stage, torch.fx.GraphModule) else None
    if graph is None:
        return {}
    inputs = tuple(n.meta[LOCAL] for n in graph.nodes if n.op == "placeholder" and LOCAL in n.meta)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    outs = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    return {"input_args": inputs, "output_args": tuple(o.meta[LOCAL] for o in outs)}


def _static_mode(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
    """torch's warm-up vote, decided without peers: every stage runs on the shapes it was given."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


__all__ = ["SCHEDULES", "LocalSchedule", "PipelineSchedule", "apply_schedule"]
