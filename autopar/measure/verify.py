"""Check a plan against single-process training: same model, same data, several steps.

``run_reference`` trains one process on the whole global batch; ``dp_worker``
is the per-rank body of a distributed run (spawned with gloo on CPU). Both
use AdamW with the same settings, so losses and final parameters must agree
up to floating-point reassociation of the gradient averages.
"""

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

from autopar.errors import AutoparError
from autopar.measure.arithmetic import (
    HALF,
    arithmetic_of,
    batch_dependent,
    draws_masks,
    float64_arithmetic,
    in_eval_mode,
    model_for_check,
)
from autopar.measure.verdict import Trace, Verdict, as_trace, judge, with_dropout
from autopar.plan import Plan
from autopar.runtime import check_runnable, parallelize
from autopar.runtime.distributed import check_model
from autopar.runtime.loss import loss_of
from autopar.runtime.state import named_params
from autopar.zoo.spec import build_model, load_factory

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


def run_reference(
    make_model: Callable[[], nn.Module],
    data: torch.Tensor,
    steps: int,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
    *,
    autocast: torch.dtype | None = None,
    max_grad_norm: float = math.inf,
    micro_rows: int | None = None,
) -> Trace:
    """Train on the full batch ``data`` (steps × global batch × seq) in this process, recording
    each step's loss, gradients, gradient norm and parameters (``autocast``: the forward under
    torch.autocast in that dtype, for half-precision plans; ``max_grad_norm``: clipped to it by
    ``torch.nn.utils.clip_grad_norm_``; ``micro_rows``: the batch's forward and backward in
    micro-batches of that many rows, gradients accumulated — what a model whose rows depend on
    their batch computes under a plan of that micro-batch, ``batch_dependent``)."""
    loss_fn = resolve_loss(loss_spec)
    model = make_model()
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=LR)
    named = list(model.named_parameters(remove_duplicate=False))  # a tied weight under each name
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, grads, params, norms = [], [], [], []
    for step in range(steps):
        chunks = data[step].split(micro_rows or data.shape[1])
        loss = torch.zeros(())
        for chunk in chunks:  # equal chunks: the mean of their mean losses is the batch's
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                part = loss_of(model, chunk, loss_fn) / len(chunks)
            part.backward()
            loss = loss + part.detach()
        grads.append(
            {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in named}
        )
        norms.append(
            math.sqrt(
                sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
            )
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return Trace(
        losses=losses, state=params[-1], grads=grads, params=params, initial=initial, norms=tuple(norms)
    )


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
                pm = parallelize(
                    model,
                    plan,
                    loss_fn=resolve_loss(loss_spec),
                    optimizer_cls=OPTIMIZERS[optimizer],
                    optimizer_kwargs={"lr": job.lr},
                )
                result = _traced_steps(pm, data, steps)
                result["replicas"] = replica_mismatch(pm)
            if job.checkpoint:
                result.update(
                    _checkpoint_round_trip(
                        pm, job.make_model, plan, f"{out}.dcp{len(results)}", optimizer, loss_spec
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


def _traced_steps(pm: Any, data: torch.Tensor, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps on this rank's rows of ``data``, recording what ``Trace`` holds; the
    functional collectives of the first step are counted (``collectives``: op name → count)."""
    st = pm.plan.strategy
    local, at = st.global_batch // st.dp, pm.dp_rank
    comm = CollectiveCounter()
    out: dict[str, Any] = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        with comm if step == 0 else contextlib.nullcontext():
            micro = pm.backward(data[step, at * local : (at + 1) * local])
        scale = float(pm.scaler.get_scale()) if pm.scaler is not None else 1.0
        grads = pm.full_grads()  # collective; rank 0 keeps the trace (its memory is the cost)
        out.setdefault("grad_norms", []).append(pm.clip_grad_norm(math.inf))  # measures only
        with comm if step == 0 else contextlib.nullcontext():
            pm.step()
        out["losses"].append(pm.mean_loss(micro))
        if pm.scaler is not None:  # every rank's loss scale after the step (an overflow halves it)
            scales: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(scales, float(pm.scaler.get_scale()))
            out.setdefault("scales", []).append(scales)
        params = pm.full_state_dict()
        if dist.get_rank() == 0:
            out["grads"].append({k: g / scale for k, g in grads.items()})
            out["params"].append({k: v.detach().clone() for k, v in params.items()})
        del grads, params
    out["collectives"] = dict(comm.counts)
    out["state"] = out["params"][-1] if out["params"] else {}
    return out


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
        (plan.strategy.global_batch // plan.strategy.dp, plan.strategy.seq),
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
) -> list[dict[str, Any]]:
    """Run every plan (same world size) on local gloo processes, one launch; rank 0's results
    (``hooks``: see ``Hook``; ``checkpoint``, ``lr``: see ``Job``)."""
    hooks = hooks or [None] * len(plans)
    jobs = [Job(make_model, p.to_json(), h, checkpoint, lr) for p, h in zip(plans, hooks, strict=True)]
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


def compare(reference: Trace, result: dict[str, Any]) -> tuple[float, float]:
    """(largest loss difference over the steps, largest parameter difference after the last
    step) against ``run_reference``'s output; every reference parameter must be in the result."""
    gap = max(abs(a - b) for a, b in zip(result["losses"], reference.losses, strict=True))
    missing = sorted(set(reference.state) - set(result["state"]))
    if missing:
        raise AutoparError(f"the distributed run returned no {missing[0]!r}")
    worst = max((result["state"][k] - v).abs().max().item() for k, v in reference.state.items())
    return gap, worst


def _available_bytes() -> float | None:
    """Memory this machine can still give (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_memory(param_bytes: int, nproc: int, steps: int) -> None:
    """Refuse in one line, before any process starts, a check this machine can't hold. Each rank
    holds the model with gradients and two Adam states, twice (the checkpoint round trip builds a
    second copy): 8× the weights; rank 0 and the reference also keep every step's gradients and
    parameters (2 × steps), and the reference its own model and optimizer (4×)."""
    need = param_bytes * (8 * nproc + 4 * steps + 4)
    have = _available_bytes()
    if have is not None and need > 0.9 * have:
        raise AutoparError(
            f"verify needs about {need / 2**30:.1f} GiB here ({param_bytes / 2**30:.2f} GiB of weights as "
            f"checked, {nproc} processes, {steps} steps) but {have / 2**30:.1f} GiB is free: verify a "
            "smaller configuration of the model, or fewer --nproc or --steps"
        )


def verify_plan(
    spec: str,
    plan: Plan,
    *,
    nproc: int,
    steps: int,
    vocab: int,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
) -> Verdict:
    """Run ``plan`` on ``nproc`` local gloo processes and the single-process reference on the same
    tokens, both with ``optimizer`` (``OPTIMIZERS``), and judge the run (``verify_runs``)."""
    import tempfile

    st = plan.strategy
    if st.world_size != nproc:
        raise AutoparError(f"the plan is for {st.world_size} processes but --nproc is {nproc}")
    check_runnable(plan)
    make = functools.partial(build_model, spec)
    model = model_for_check(make, arithmetic_of(st.dtype))
    check_model(model, plan)  # one line now, not a traceback from every worker
    _check_memory(sum(p.numel() * p.element_size() for p in model.parameters()), nproc, steps)
    del model
    data = torch.randint(
        0, vocab, (steps, st.global_batch, st.seq), generator=torch.Generator().manual_seed(1)
    )
    with tempfile.TemporaryDirectory() as tmp:
        return verify_runs(make, [(plan, None)], data, tmp, loss_spec=loss_spec, optimizer=optimizer)[0]


def verify_runs(
    make_model: Callable[[], nn.Module],
    cases: list[tuple[Plan, Hook]],
    data: torch.Tensor,
    tmp: str,
    *,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
    checkpoint: bool = True,
) -> list[Verdict]:
    """The verdict on each (plan, hook) for one model (``verify_cases``)."""
    return verify_cases(
        [(make_model, plan, hook) for plan, hook in cases],
        data,
        tmp,
        loss_spec=loss_spec,
        optimizer=optimizer,
        checkpoint=checkpoint,
    )


Case = tuple[Callable[[], nn.Module], Plan, Hook]
"""(builds the model, the plan, its ``Hook``)."""


def verify_cases(
    cases: list[Case],
    data: torch.Tensor,
    tmp: str,
    *,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
    checkpoint: bool = True,
) -> list[Verdict]:
    """The verdict on each (model, plan, hook) — plans for one world size, run in one launch —
    against single-process training of its model on ``data`` (steps × global batch × seq). A model
    that draws dropout masks is compared with dropout off, and its plans also run with dropout on
    (and without recompute where they recompute) for ``verdict.with_dropout``. ``checkpoint``:
    each run also round-trips through a checkpoint (``Job.checkpoint``)."""
    jobs: list[Job] = []
    where: list[tuple[int, int | None, int | None]] = []  # per case: its jobs (off, on, twin)
    random: dict[Callable[[], nn.Module], bool] = {}  # per model: whether it draws masks
    double: dict[Callable[[], nn.Module], str] = {}  # per model: ``float64_arithmetic``
    offs: dict[tuple[Callable[[], nn.Module], str], Callable[[], nn.Module]] = {}  # as compared
    batchwise: dict[Callable[[], nn.Module], bool] = {}  # per model: ``batch_dependent``
    keys: list[tuple[Callable[[], nn.Module], str, int | None]] = []  # per case: its reference
    for make_model, plan, hook in cases:
        if make_model not in random:
            random[make_model] = draws_masks(make_model, resolve_loss(loss_spec), data[0])
            double[make_model] = float64_arithmetic(make_model, resolve_loss(loss_spec), data[0, :1])
        arithmetic = arithmetic_of(plan.strategy.dtype, double[make_model])
        make = functools.partial(model_for_check, make_model, arithmetic)
        off = offs.setdefault(
            (make_model, arithmetic), functools.partial(in_eval_mode, make) if random[make_model] else make
        )
        if make_model not in batchwise:
            rows = data[0, :2]  # two rows: does either's loss change with the other beside it?
            batchwise[make_model] = len(rows) > 1 and batch_dependent(off, resolve_loss(loss_spec), rows)
        keys.append((make_model, arithmetic, plan.strategy.micro_batch if batchwise[make_model] else None))
        i_off, i_on, i_twin = len(jobs), None, None
        jobs.append(Job(off, plan.to_json(), hook, checkpoint))
        if random[make_model]:
            i_on = len(jobs)
            jobs.append(Job(make, plan.to_json(), hook, checkpoint))
        if random[make_model] and any(c != "none" for c in plan.recompute.values()):
            i_twin = len(jobs)
            jobs.append(Job(make, without_recompute(plan).to_json(), hook, checkpoint))
        where.append((i_off, i_on, i_twin))
    world = cases[0][1].strategy.world_size
    results = spawn_jobs(jobs, world, data, tmp, loss_spec=loss_spec, optimizer=optimizer)
    train = functools.partial(run_reference, data=data, steps=len(data), loss_spec=loss_spec)
    train = functools.partial(train, optimizer=optimizer)
    references = {k: train(offs[k[:2]], autocast=HALF.get(k[1]), micro_rows=k[2]) for k in set(keys)}
    verdicts = []
    for (make_model, plan, _), (i_off, i_on, i_twin), key in zip(cases, where, keys, strict=True):
        arithmetic = arithmetic_of(plan.strategy.dtype, double[make_model])
        ref = references[key]
        judged = "float32" if arithmetic == "float64" and double[make_model] == "lowered" else arithmetic
        judged = "bf16" if plan.strategy.lossy_comm else judged  # bf16 on the wire: bf16's bounds
        verdict = judge(ref, results[i_off], judged)
        if i_on is not None:
            twin = as_trace(results[i_twin], ref.initial) if i_twin is not None else None
            verdict = with_dropout(verdict, results[i_on], twin)
        verdicts.append(verdict)
    return verdicts


def without_recompute(plan: Plan) -> Plan:
    """``plan`` with every block kept (no recompute): what its recomputation must reproduce."""
    import dataclasses

    kept = [tuple((name, "none") for name, _ in s.recompute) for s in plan.stages]
    stages = tuple(dataclasses.replace(s, recompute=r) for s, r in zip(plan.stages, kept, strict=True))
    return dataclasses.replace(plan, stages=stages)
