"""The whole model's gradient norm under any plan, and clipping by it (as
``torch.nn.utils.clip_grad_norm_`` does on one device).

Every rank sums the squares of the gradient elements it holds, each divided by how many ranks
hold that element, and one all-reduce of that scalar over the world adds them up:

    ‖g‖² = Σ_ranks Σ_local g² / copies

where copies = (ranks of a pipeline stage that hold the element) · (pipeline ranks that hold the
tensor): for a DTensor gradient on mesh M, the product of M's Replicate dimensions times the dp·tp
ranks of the stage outside M (a TP-only DTensor is copied on every DP replica); a plain tensor
(DDP) is on every one of the stage's dp·tp ranks; a tied weight (embedding = head) is on each
pipeline rank of its ``TiedGroup``. Clipping multiplies every gradient by
min(1, max_norm / (‖g‖ + 1e-6)), torch's rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.distributed import local_device


def _copies(grad: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks of one pipeline stage hold each element of ``grad``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return stage_ranks
    mesh = grad.device_mesh
    assert not any(p.is_partial() for p in grad.placements), "a gradient is still partial"
    replicated = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())
    return replicated * stage_ranks // mesh.size()


def _with_grads(stages: list[nn.Module]) -> Iterator[nn.Parameter]:
    """Each parameter of ``stages`` that has a gradient, once (a rank's chunks may share one)."""
    seen: set[int] = set()
    for stage in stages:
        for p in stage.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                yield p


def grad_norm(stages: list[nn.Module], tied: list[Any], *, stage_ranks: int) -> float:
    """The L2 norm of every parameter's gradient of the whole model (collective: one scalar
    all-reduce). ``tied``: the rank's ``TiedGroup``s; ``stage_ranks``: dp · tp."""
    shared = {id(p): dist.get_world_size(t.group) for t in tied for p in t.params}
    total = torch.zeros((), dtype=torch.float64, device=local_device())  # NCCL: device tensors
    for p in _with_grads(stages):
        g = p.grad
        assert g is not None
        local = g.to_local() if hasattr(g, "to_local") else g
        total += local.detach().double().pow(2).sum() / (_copies(g, stage_ranks) * shared.get(id(p), 1))
    dist.all_reduce(total)
    return math.sqrt(float(total))


def clip_grads_(stages: list[nn.Module], max_norm: float, norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6))."""
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for p in _with_grads(stages):
            assert p.grad is not None
            p.grad.mul_(coef)


__all__ = ["clip_grads_", "grad_norm"]
