"""What each rank of a verify launch runs: every job's plan trained for some steps on the rank's
rows, traced (losses, gradients, parameters, the first step's collectives), its checkpoint round
trip; and the launch itself (``spawn_jobs``: local gloo processes, ``measure.launch``).
``verify`` judges what rank 0 returns against one process."""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.plan import Plan
from autopar.runtime import parallelize
from autopar.runtime.state import named_params
from autopar.runtime.switch import switch_plan
from autopar.zoo.spec import load_factory

LR = 1e-2


def resolve_loss(spec: str | None) -> Callable[[Any, torch.Tensor], torch.Tensor] | None:
    """``module:fn`` or ``path/to/file.py:fn`` taking (model output, tokens); None: the default
    (the model's own loss where it computes one, else next-token CE: ``runtime.loss``)."""
    if spec is None:
        return None
    fn: Callable[[Any, torch.Tensor], torch.Tensor] = load_factory(spec)
    return fn


OPTIMIZERS: dict[str, Any] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
"""AdamW is what users train with; SGD moves parameters by lr × gradient, so a parameter
difference is a gradient difference (Adam's normalised step magnifies tiny ones)."""


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


class CollectiveCounter(TorchDispatchMode):
    """Counts the functional collectives (``_c10d_functional.*``) run under it, forward and backward
    (CommDebugMode's module tracker does not follow GraphModules)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


Hook = Callable[[], contextlib.AbstractContextManager[Any]] | None
"""A context manager (factory) a plan runs inside — the suite's mutations, which break a plan on
purpose to show the verdict fails; None: as is."""


class Job(NamedTuple):
    """One plan run in a launch."""

    make_model: Callable[[], nn.Module]
    """Builds the model (the same weights on every rank)."""
    plan: str
    """The plan, as JSON."""
    hook: Hook = None
    """Its ``Hook``."""
    checkpoint: bool = True
    """Also save the run, load it into a fresh placement and check it comes back exactly."""
    lr: float = LR
    """The optimizer's learning rate."""
    trace: bool = True
    """Keep every step's whole gradients and parameters (rank 0 gathers and returns them);
    False: the losses, gradient norms and the final parameters only, for long runs whose
    steps only their losses are compared."""
    switch: tuple[int, str] | None = None
    """(k, plan JSON): before step k the run moves to that plan in process
    (``runtime.switch.switch_plan``: what ``autopar.Adaptive`` does), then trains on under it."""


RUN_SEED = 1234
"""Each rank seeds RUN_SEED + rank before its plan is applied, as users who seed by rank do (the
runtime makes a TP group agree; ``runtime.distributed.agree_on_rng``)."""


def dp_worker(
    rank: int,
    world: int,
    init_method: str,
    jobs: list[Job],
    data: torch.Tensor,
    steps: int,
    out: str,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
) -> None:
    """One rank: run each job's plan for ``steps`` steps on this rank's rows; rank 0 saves results.
    ``loss_spec`` names the loss (resolved here: user modules don't pickle). The functional
    collectives of the first step are counted (``collectives``: op name → count); ``replicas``
    names the first parameter whose replicas differ after the run."""
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    try:
        for job in jobs:
            plan = Plan.from_json(job.plan)
            with job.hook() if job.hook else contextlib.nullcontext():
                model = job.make_model()
                torch.manual_seed(RUN_SEED + rank)
                place = functools.partial(
                    parallelize,
                    loss_fn=resolve_loss(loss_spec),
                    optimizer_cls=OPTIMIZERS[optimizer],
                    optimizer_kwargs={"lr": job.lr},
                )
                pm = place(model, plan)
                move = _mover(job, place, f"{out}.switch{len(results)}")
                pm, result = _traced_steps(pm, data, steps, job.trace, move)
                result["replicas"] = replica_mismatch(pm)
            if job.checkpoint:
                result.update(
                    _checkpoint_round_trip(
                        pm, job.make_model, pm.plan, f"{out}.dcp{len(results)}", optimizer, loss_spec
                    )
                )
            results.append(result)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def replica_mismatch(pm: Any) -> str | None:
    """The first parameter whose copies differ on ranks that should hold the same values (the
    mesh dimensions a DTensor parameter is replicated over: a norm weight on every TP rank).
    They drift apart when the replicated computation differs between ranks — different dropout
    masks, an update applied on one rank only. Collective: call on every rank."""
    from torch.distributed.tensor import DTensor

    first: str | None = None
    for stage in pm.stages:
        for name, p in named_params(stage).items():
            if not isinstance(p, DTensor):
                continue
            local, mesh = p.to_local().detach().contiguous(), p.device_mesh
            for dim, placement in enumerate(p.placements):
                if not placement.is_replicate() or mesh.size(dim) == 1:
                    continue
                copies = [torch.empty_like(local) for _ in range(mesh.size(dim))]
                dist.all_gather(copies, local, group=mesh.get_group(dim))
                if first is None and any(not torch.equal(c, copies[0]) for c in copies):
                    first = name
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, first)
    return next((f for f in found if f), None)


Mover = Callable[[int, Any], Any]
"""(step, ParallelModel) → the ParallelModel to train that step with."""


def _mover(job: Job, place: Callable[[nn.Module, Plan], Any], folder: str) -> Mover:
    """The job's switch as a ``Mover``: the same ParallelModel every step but the switch's, where it
    moves to the job's second plan."""
    if job.switch is None:
        return lambda step, pm: pm
    at_step, target = job.switch

    def move(step: int, pm: Any) -> Any:
        if step != at_step:
            return pm
        return switch_plan(pm, job.make_model, Plan.from_json(target), folder, place=place)

    return move


def _traced_steps(
    pm: Any, data: torch.Tensor, steps: int, trace: bool = True, move: Mover | None = None
) -> tuple[Any, dict[str, Any]]:
    """Train ``steps`` steps on this rank's rows of ``data``, recording what ``Trace`` holds (with
    ``trace`` False, the parameters after the last step only, and no gradients); the functional
    collectives of the first step are counted (``collectives``: op name → count). ``move``
    gives the model each step trains with (a switch of plan); returns the last one too."""
    comm = CollectiveCounter()
    out: dict[str, Any] = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        pm = move(step, pm) if move is not None else pm
        st = pm.plan.strategy
        start, stop = st.replica_rows(pm.dp_rank)
        with comm if step == 0 else contextlib.nullcontext():
            micro = pm.backward(data[step, start:stop])
        scale = float(pm.scaler.get_scale()) if pm.scaler is not None else 1.0
        grads = (
            pm.full_grads() if trace else {}
        )  # collective; rank 0 keeps the trace (its memory is the cost)
        out.setdefault("grad_norms", []).append(pm.clip_grad_norm(math.inf))  # measures only
        with comm if step == 0 else contextlib.nullcontext():
            pm.step()
        out["losses"].append(pm.mean_loss(micro))
        if pm.scaler is not None:  # every rank's loss scale after the step (an overflow halves it)
            scales: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(scales, float(pm.scaler.get_scale()))
            out.setdefault("scales", []).append(scales)
        params = pm.full_state_dict() if trace or step == steps - 1 else {}
        if dist.get_rank() == 0:
            out["grads"].append({k: g / scale for k, g in grads.items()})
            out["params"].append({k: v.detach().clone() for k, v in params.items()})
        del grads, params
    out["collectives"] = dict(comm.counts)
    out["state"] = out["params"][-1] if out["params"] else {}
    return pm, out


def _checkpoint_round_trip(
    pm: Any, make_model: Callable[[], nn.Module], plan: Plan, path: str, optimizer: str, loss_spec: str | None
) -> dict[str, Any]:
    """Save model + optimizer (``ParallelModel.save``: DCP), load into a freshly parallelized
    model, and take the next step on both: ``checkpoint_state_exact`` (the parameters came back
    bit for bit), ``checkpoint_step_gap`` (the largest difference of that step's loss and of
    the weights after it: the optimizer state came back) and ``checkpoint_exact`` (both exact).
    A compiled plan's two models run separately compiled kernels, so its step may differ in
    the last bit where its state does not."""
    pm.save(path)
    fresh = parallelize(
        make_model(),
        plan,
        loss_fn=resolve_loss(loss_spec),
        optimizer_cls=OPTIMIZERS[optimizer],
        optimizer_kwargs={"lr": LR},
    )
    fresh.load(path)
    mine, theirs = pm.full_state_dict(), fresh.full_state_dict()
    same = all(torch.equal(mine[k], theirs[k]) for k in mine)
    probe = torch.randint(
        0,
        16,
        (plan.strategy.replica_micro_batches(pm.dp_rank) * plan.strategy.micro_batch, plan.strategy.seq),
        generator=torch.Generator().manual_seed(7),
    )
    losses = []
    for model in (pm, fresh):  # the same draws on both (a model with dropout)
        torch.manual_seed(RUN_SEED)
        losses.append(model.train_step(probe))
    # the step's loss precedes the update; the weights after it show the optimizer state came back
    mine, theirs = pm.full_state_dict(), fresh.full_state_dict()
    gaps = [abs(losses[0] - losses[1]), *((mine[k] - theirs[k]).abs().max().item() for k in mine)]
    return {
        "checkpoint_state_exact": same,
        "checkpoint_step_gap": max(gaps),
        "checkpoint_exact": same and max(gaps) == 0,
        "checkpoint_compiled": plan.strategy.compile == "block",
    }


def spawn_plans(
    make_model: Callable[[], nn.Module],
    plans: list[Plan],
    data: torch.Tensor,
    tmp: str,
    *,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
    hooks: list[Hook] | None = None,
    checkpoint: bool = True,
    lr: float = LR,
    trace: bool = True,
) -> list[dict[str, Any]]:
    """Run every plan (same world size) on local gloo processes, one launch; rank 0's results
    (``hooks``: see ``Hook``; ``checkpoint``, ``lr``, ``trace``: see ``Job``)."""
    hooks = hooks or [None] * len(plans)
    jobs = [Job(make_model, p.to_json(), h, checkpoint, lr, trace) for p, h in zip(plans, hooks, strict=True)]
    return spawn_jobs(jobs, plans[0].strategy.world_size, data, tmp, loss_spec=loss_spec, optimizer=optimizer)


def spawn_jobs(
    jobs: list[Job],
    world: int,
    data: torch.Tensor,
    tmp: str,
    *,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
) -> list[dict[str, Any]]:
    """Run ``jobs`` (plans for ``world`` processes) in one launch of local gloo processes; rank 0's
    results, one per job."""
    from autopar.measure.launch import launch

    assert all(Plan.from_json(j.plan).strategy.world_size == world for j in jobs), "one world per launch"
    out = f"{tmp}/results.pt"
    args = (world, f"file://{tmp}/init", jobs, data, data.shape[0], out, loss_spec, optimizer)
    launch(dp_worker, args=args, nprocs=world)
    results: list[dict[str, Any]] = torch.load(out)
    return results
