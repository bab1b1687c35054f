"""``ParallelModel``: a model placed by a plan on this rank — its stages, optimizers and
schedule — with one surface for every plan: ``train_step``, ``eval_step`` and checkpoint state."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.graph.objective import LOGITS, Objective
from autopar.passes.expert_load import CountedLayer
from autopar.plan import Plan
from autopar.runtime.distributed import (
    agree_on_batch,
    device_type,
    local_device,
    peer_failures,
    reduce_partial_grads,
)
from autopar.runtime.expert_load import (
    ExpertLoad,
    count_buffers,
    overflow_warning,
    packed_counts,
    unpack_loads,
    zero_counts,
)
from autopar.runtime.grad_norm import clip_grads_, grad_norm
from autopar.runtime.loss import LossFn
from autopar.runtime.schedules import LocalSchedule, PipelineSchedule
from autopar.runtime.sharding import StageOptimizers
from autopar.runtime.state import (
    fqn,
    load_local_state,
    local_state,
    map_dtensors,
    named_params,
    placements_of,
    restride,
    unstride,
)
from autopar.runtime.steps import TiedGroup


@dataclass
class ParallelModel:
    """This rank's part of a model placed by a plan; ``train_step`` runs one optimizer step."""

    stages: list[nn.Module]
    """This rank's stages in execution order: one when pp = 1 (the model, wrapped by DDP or
    FSDP2, or its tensor-parallel graph), its pipeline chunks otherwise (GraphModules with the
    model's FQNs)."""
    optimizer: StageOptimizers
    """One optimizer per stage."""
    plan: Plan
    """The plan being executed."""
    schedule: LocalSchedule | PipelineSchedule
    """How a step runs the micro-batches."""
    loss_fn: LossFn
    """loss(model output, batch) → scalar."""
    objective: Objective = LOGITS
    """How a micro-batch of tokens is fed to the model (with its targets, where it computes its
    own loss)."""
    autocast_dtype: torch.dtype | None = None
    """Autocast dtype where no FSDP2 casts parameters."""
    scaler: Any = None
    """fp16 only: the dynamic loss scaler (``GradScaler`` or ``ShardedGradScaler``)."""
    partial_grads: list[nn.Parameter] = field(default_factory=list)
    """TP with sequence parallelism: replicated parameters whose gradients are partial over the TP
    group (all-reduced once per step, in one bucket)."""
    tp_group: Any = ""
    """Name of this rank's TP process group."""
    tied: list[TiedGroup] = field(default_factory=list)
    """Parameters shared with other pipeline ranks and the groups that sum their gradients."""
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """A tied parameter's name → all its names in the model (a graph reads it under one)."""
    needs_weights: bool = False
    """Built from meta parameters: the stages' memory is allocated but holds no values until
    ``load_full_state_dict`` or a DCP ``load_state_dict``."""
    last_step_s: float = 0.0
    """Wall time of the last ``train_step`` on this rank, seconds (``autopar.Metrics`` reads it)."""
    last_grad_norm: float | None = None
    """The whole model's gradient norm in the last ``train_step`` given ``max_grad_norm`` (before
    clipping; None otherwise)."""
    counted: list[CountedLayer] = field(default_factory=list)
    """The MoE layers whose routed rows are counted (``passes.expert_load``; a captured model)."""
    last_expert_load: dict[str, ExpertLoad] = field(default_factory=dict)
    """Each counted MoE layer's rows per expert in the last ``train_step`` or ``eval_step``,
    summed over its micro-batches and data-parallel ranks, by the experts' module path (every
    rank has them); empty for a model that runs as written (tp = pp = ep = 1) and on a
    pipeline's first step (``_start_counting``)."""
    groups: list[Any] = field(default_factory=list)
    """The process groups this placement made (its mesh's, its tied weights'): destroyed by
    ``runtime.switch.release`` when a running job moves to another plan."""
    _counts: list[torch.Tensor | None] = field(default_factory=list, init=False, repr=False)
    _step_tokens: int = field(default=0, init=False, repr=False)
    _started: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def module(self) -> nn.Module:
        """The local stage (pp = 1), or the local stages as one ModuleList."""
        return self.stages[0] if len(self.stages) == 1 else nn.ModuleList(self.stages)

    @property
    def micro_batches(self) -> int:
        return self.plan.strategy.micro_batches

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: pipeline and TP ranks of one replica share data."""
        return self.plan.strategy.dims.coordinate(dist.get_rank(), "dp")

    def precision(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast where it applies, and vocabulary-parallel cross-entropy on logits split over
        the vocabulary (tp > 1): forward and backward run inside."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type(), dtype=self.autocast_dtype))
        if self.plan.strategy.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        return stack

    def mean_loss(self, losses: list[torch.Tensor]) -> float:
        """The mean loss over all data-parallel replicas (each rank holding the last stage adds
        its micro-batches' mean; the dp·tp ranks of that stage divide)."""
        dev = local_device()  # NCCL: device tensors
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for loss in losses:
            total += loss.detach().double()
        # uneven shares (``Strategy.dp_shares``): each replica's sum over the mean count, so the
        # replicas' average is the global batch's mean loss
        mean = total / (
            self.plan.strategy.micro_batches if self.plan.strategy.dp_shares else max(1, len(losses))
        )
        # the step's expert counts ride on the same all-reduce (runtime.expert_load)
        both = torch.cat([mean.reshape(1), packed_counts(self._counts, self.counted, dev)])
        dist.all_reduce(both)  # SUM: gloo has no AVG
        if self._step_tokens:
            self.last_expert_load = unpack_loads(both[1:], self.counted, tokens=self._step_tokens)
            if dist.get_rank() == 0 and (dropped := overflow_warning(self.last_expert_load)):
                warnings.warn(dropped, stacklevel=3)
        return float(both[0]) / self.plan.strategy.dims.axis("stage").size

    def _start_counting(self, batch: torch.Tensor, kind: str) -> None:
        """Zero the expert counts before a step's first micro-batch (``runtime.expert_load``).
        Not on a pipeline's first step of each ``kind`` (train, eval): torch's schedule runs an
        extra forward of each stage then, to infer the shapes it sends (its inputs beyond the
        first stage are not the step's), so that step has no counts."""
        first = self.plan.strategy.pp > 1 and kind not in self._started
        self._started.add(kind)
        self._step_tokens = (
            0 if first or not self.counted else batch.shape[0] * batch.shape[1] * self.plan.strategy.dp
        )
        self.last_expert_load = {}
        if self.counted:
            self._counts = self._counts or count_buffers(self.stages, self.counted)
            zero_counts(self._counts)

    def _check_weights(self) -> None:
        if self.needs_weights:
            raise AutoparError(
                "this model was built with meta parameters: load its weights first "
                "(load_full_state_dict, or torch.distributed.checkpoint.load + load_state_dict)"
            )

    def train_step(self, batch: torch.Tensor, *, max_grad_norm: float | None = None) -> float:
        """Forward, backward over the plan's micro-batches, optimizer step; returns the mean loss
        over all data-parallel ranks. ``batch`` is this replica's share: global batch / dp rows.
        ``max_grad_norm``: clip the whole model's gradient norm to it first, as
        ``torch.nn.utils.clip_grad_norm_`` does (``inf`` measures without clipping); the norm is
        ``last_grad_norm``. A peer that died or hung (past the process group's timeout) is an
        ``AutoparError`` saying so, on every surviving rank."""
        start = time.perf_counter()
        with peer_failures("a training step"):
            losses = self.backward(batch)
            self.last_grad_norm = None if max_grad_norm is None else self.clip_grad_norm(max_grad_norm)
            self.step()
            loss = self.mean_loss(losses)  # its all-reduce and .item() end the step on every rank
        self.last_step_s = time.perf_counter() - start
        return loss

    def backward(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """The first half of ``train_step``: forward and backward of every micro-batch, and the
        gradients made whole (TP-partial and tied-weight sums); returns this rank's micro-batch
        losses. ``full_grads`` can read the gradients now, before ``step`` applies them."""
        self._check_weights()
        agree_on_batch(batch, self.plan.strategy)
        self._start_counting(batch, "train")
        losses = self.schedule.step(self, batch)
        reduce_partial_grads(self.partial_grads, self.tp_group)
        for tied in self.tied:  # embedding and head gradients of a tied weight add up
            reduce_partial_grads(tied.params, tied.group)
        return losses

    def clip_grad_norm(self, max_norm: float) -> float:
        """After ``backward``: the whole model's gradient norm (under fp16 unscaled first), and
        every gradient scaled by min(1, max_norm / (norm + 1e-6)). Collective (one scalar)."""
        if not max_norm > 0:
            raise AutoparError(f"max_grad_norm={max_norm}: give a positive norm (inf to only measure)")
        if self.scaler is not None:
            (opt,) = self.optimizer.optimizers
            self.scaler.unscale_(opt)  # step() then applies the unscaled gradients
        norm = grad_norm(self.stages, self.tied, stage_ranks=self.plan.strategy.dims.axis("stage").size)
        clip_grads_(self.stages, max_norm, norm)
        return norm

    def step(self) -> None:
        """The second half of ``train_step``: the optimizer step (through the loss scaler under
        fp16), then the gradients cleared."""
        if self.scaler is not None:
            (opt,) = self.optimizer.optimizers  # fp16 runs without a pipeline: one stage
            self.scaler.step(opt)  # skipped when a gradient overflowed; then the scale halves
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient under the model's names, as the optimizer will apply it
        (after ``backward``; zeros where a parameter got none; under fp16 still loss-scaled).
        Collective: call on every rank."""
        grads: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            for name, p in named_params(stage).items():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                grads[name] = g.detach().cpu().clone()
        return self._with_aliases(self._from_every_stage(grads))

    def _from_every_stage(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under a pipeline, every stage's entries on every rank (one rank of each stage shares)."""
        dims = self.plan.strategy.dims
        if dims.pp == 1:
            return mine
        share = mine if dims.coordinate(dist.get_rank(), "stage") == 0 else {}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, share)
        return {k: v for part in gathered for k, v in part.items()}

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor) -> float:
        """Mean loss of this replica's batch over all ranks, without gradients or updates."""
        self._check_weights()
        self._start_counting(batch, "eval")
        return self.mean_loss(self.schedule.eval(self, batch))

    def _optimizer_aliases(self, optim: dict[str, Any]) -> dict[str, Any]:
        """Flattened optimizer entries (``state.<FQN>.<key>``, ``param_groups.<FQN>.<key>``) of a
        tied parameter under each of its names too: a plan that holds it under another name (a
        pipeline's head stage) finds its state."""
        out = dict(optim)
        for key, value in optim.items():
            section, _, rest = key.partition(".")
            name, _, leaf = rest.rpartition(".")
            for alias in self.aliases.get(name, ()):
                out.setdefault(f"{section}.{alias}.{leaf}", value)
        return out

    def _with_aliases(self, state: dict[str, Any]) -> dict[str, Any]:
        return {alias: v for k, v in state.items() for alias in self.aliases.get(k, (k,))}

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for ``torch.distributed.checkpoint`` under the original
        model's names (a tied weight under each of its names; ``runtime.state``)."""
        state = local_state(self.stages, self.optimizer.optimizers)
        state["model"] = self._with_aliases(state["model"])
        state["optimizer"] = self._optimizer_aliases(state["optimizer"])
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return map_dtensors(state, unstride)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict`` (after ``torch.distributed.checkpoint.load`` into it)."""
        if self.plan.strategy.tp > 1:  # fused-QKV shards were saved as plain shards
            like = placements_of(local_state(self.stages, self.optimizer.optimizers))
            state = map_dtensors(state, restride, like=like)
        load_local_state(self.stages, self.optimizer.optimizers, state)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.needs_weights = False

    def save(self, path: str) -> None:
        """Save model and optimizer state to the checkpoint folder ``path``, replacing what is
        there only once every rank has written (``runtime.checkpoint``). Collective."""
        from autopar.runtime.checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load(self, path: str) -> None:
        """Load the checkpoint folder ``path``, saved under any plan of this model; another
        model's checkpoint is refused in one line. Collective."""
        from autopar.runtime.checkpoint import load_checkpoint

        load_checkpoint(self, path)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (the model's own ``state_dict()`` names, on the CPU, the same on
        every rank): each rank copies in only its stages' slices."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        for stage in self.stages:
            names = [fqn(k) for k in get_model_state_dict(stage)]
            missing = [k for k in names if k not in state]
            if missing:
                raise AutoparError(f"the state dict has no {missing[0]!r}: it is not this model's")
            mine: dict[str, Any] = {k: state[k] for k in names}
            set_model_state_dict(stage, mine, options=StateDictOptions(full_state_dict=True))
        self.needs_weights = False

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters under the original names, from every stage (collective: call
        on every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            sd = get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True))
            full.update({fqn(k): v.detach().cpu() for k, v in sd.items() if isinstance(v, torch.Tensor)})
        return self._with_aliases(self._from_every_stage(full))


__all__ = ["ParallelModel"]
