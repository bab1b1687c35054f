"""Check a plan against single-process training: same model, same data, several steps.

``run_reference`` trains one process on the whole global batch; ``ranks.dp_worker``
is the per-rank body of a distributed run (spawned with gloo on CPU). Both
use AdamW with the same settings, so losses and final parameters must agree
up to floating-point reassociation of the gradient averages.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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
from autopar.measure.ranks import LR, OPTIMIZERS, Hook, Job, resolve_loss, spawn_jobs
from autopar.measure.verdict import Trace, Verdict, as_trace, judge, with_dropout
from autopar.plan import Plan
from autopar.runtime import check_runnable
from autopar.runtime.distributed import check_model
from autopar.runtime.loss import loss_of, resolve_objective
from autopar.zoo.spec import build_model


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
    switch: tuple[int, Plan] | None = None,
) -> Verdict:
    """Run ``plan`` on ``nproc`` local gloo processes and the single-process reference on the same
    tokens, both with ``optimizer`` (``OPTIMIZERS``), and judge the run (``verify_runs``).
    ``switch`` (k, plan): before step k the run moves to that plan in process (``Job.switch``)."""
    import tempfile

    st = plan.strategy
    if st.world_size != nproc:
        raise AutoparError(f"the plan is for {st.world_size} processes but --nproc is {nproc}")
    check_runnable(plan)
    if switch is not None:
        check_switch(plan, switch, steps)
    make = functools.partial(build_model, spec)
    model = model_for_check(make, arithmetic_of(st.dtype))
    check_model(model, plan)  # one line now, not a traceback from every worker
    resolve_objective(model, resolve_loss(loss_spec), pp=st.pp, cp=st.cp)  # the loss the plan can train
    _check_memory(sum(p.numel() * p.element_size() for p in model.parameters()), nproc, steps)
    del model
    data = torch.randint(
        0, vocab, (steps, st.global_batch, st.seq), generator=torch.Generator().manual_seed(1)
    )
    with tempfile.TemporaryDirectory() as tmp:
        runs = verify_runs(
            make, [(plan, None)], data, tmp, loss_spec=loss_spec, optimizer=optimizer, switch=switch
        )
        return runs[0]


def check_switch(plan: Plan, switch: tuple[int, Plan], steps: int) -> None:
    """One line for a switch ``verify`` cannot run: another world, another shape of step, or a
    step outside the run."""
    at, target = switch
    if target.model != plan.model:
        raise AutoparError(
            f"the plan switched to is for {target.model!r}, the first for {plan.model!r}: "
            "give plans of one model"
        )
    a, b = plan.strategy, target.strategy
    if b.world_size != a.world_size or (b.global_batch, b.seq) != (a.global_batch, a.seq):
        raise AutoparError(
            f"the plan switched to is for {b.world_size} processes, global batch {b.global_batch}, seq "
            f"{b.seq}; the first for {a.world_size}, {a.global_batch}, {a.seq}: give plans of one run"
        )
    if not 1 <= at < steps:
        raise AutoparError(f"--switch-at {at}: give a step in 1..{steps - 1} (--steps is {steps})")
    check_runnable(target)


def verify_runs(
    make_model: Callable[[], nn.Module],
    cases: list[tuple[Plan, Hook]],
    data: torch.Tensor,
    tmp: str,
    *,
    loss_spec: str | None = None,
    optimizer: str = "adamw",
    checkpoint: bool = True,
    switch: tuple[int, Plan] | None = None,
) -> list[Verdict]:
    """The verdict on each (plan, hook) for one model (``verify_cases``)."""
    return verify_cases(
        [(make_model, plan, hook) for plan, hook in cases],
        data,
        tmp,
        loss_spec=loss_spec,
        optimizer=optimizer,
        checkpoint=checkpoint,
        switch=switch,
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
    switch: tuple[int, Plan] | None = None,
) -> list[Verdict]:
    """The verdict on each (model, plan, hook) — plans for one world size, run in one launch —
    against single-process training of its model on ``data`` (steps × global batch × seq). A model
    that draws dropout masks is compared with dropout off, and its plans also run with dropout on
    (and without recompute where they recompute) for ``verdict.with_dropout``. ``checkpoint``:
    each run also round-trips through a checkpoint (``Job.checkpoint``); ``switch`` (k, plan):
    each run moves to that plan before step k (``Job.switch``)."""
    moved = None if switch is None else (switch[0], switch[1].to_json())
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
        where.append(_add_jobs(jobs, off, make, plan, hook, checkpoint, moved, random[make_model]))
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


def _add_jobs(
    jobs: list[Job],
    off: Callable[[], nn.Module],
    make: Callable[[], nn.Module],
    plan: Plan,
    hook: Hook,
    checkpoint: bool,
    switch: tuple[int, str] | None,
    random: bool,
) -> tuple[int, int | None, int | None]:
    """Append one case's jobs — as compared (``off``), with dropout on where the model draws
    masks, and that without recompute where the plan recomputes — and return their indices."""
    i_off, i_on, i_twin = len(jobs), None, None
    jobs.append(Job(off, plan.to_json(), hook, checkpoint, switch=switch))
    if random:
        i_on = len(jobs)
        jobs.append(Job(make, plan.to_json(), hook, checkpoint, switch=switch))
    if random and any(c != "none" for c in plan.recompute.values()):
        i_twin = len(jobs)
        jobs.append(Job(make, without_recompute(plan).to_json(), hook, checkpoint, switch=switch))
    return i_off, i_on, i_twin


def without_recompute(plan: Plan) -> Plan:
    """``plan`` with every block kept (no recompute): what its recomputation must reproduce."""
    import dataclasses

    kept = [tuple((name, "none") for name, _ in s.recompute) for s in plan.stages]
    stages = tuple(dataclasses.replace(s, recompute=r) for s, r in zip(plan.stages, kept, strict=True))
    return dataclasses.replace(plan, stages=stages)
