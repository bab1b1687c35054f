"""Check a plan against single-process training: same model, same data, several steps.

``run_reference`` trains one process on the whole global batch; ``dp_worker``
is the per-rank body of a distributed run (spawned with gloo on CPU). Both
use AdamW with the same settings, so losses and final parameters must agree
up to floating-point reassociation of the gradient averages.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.plan import Plan
from autopar.runtime import lm_loss, parallelize

LR = 1e-2


def run_reference(
    make_model: Callable[[], nn.Module], data: torch.Tensor, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train on the full batch ``data`` (steps × global batch × seq) in this process."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = lm_loss(model(data[step]), data[step])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def dp_worker(
    rank: int,
    world: int,
    init_method: str,
    make_model: Callable[[], nn.Module],
    plans: list[str],
    data: torch.Tensor,
    steps: int,
    out: str,
) -> None:
    """One rank: run each plan (JSON) for ``steps`` steps on this rank's rows; rank 0 saves results."""
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    try:
        for text in plans:
            plan = Plan.from_json(text)
            pm = parallelize(make_model(), plan, optimizer_kwargs={"lr": LR})
            local = plan.strategy.global_batch // world
            losses = [pm.train_step(data[step, rank * local : (rank + 1) * local]) for step in range(steps)]
            state = pm.full_state_dict()
            results.append({"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
