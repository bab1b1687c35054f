"""Checkpoint helpers for ``ParallelModel.state_dict``: ZeRO-1 optimizer state by parameter name,
and fused-QKV ``_StridedShard`` DTensors saved as plain shards (DCP can't plan strided chunks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def flatten(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = tree


def map_dtensors(
    tree: Any, fn: Callable[..., Any], like: dict[str, Any] | None = None, prefix: str = ""
) -> Any:
    """Apply ``fn`` to every DTensor leaf of a nested state dict (``like``: placements by flat key)."""
    if isinstance(tree, dict):
        return {k: map_dtensors(v, fn, like, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()}
    if hasattr(tree, "placements"):
        return fn(tree) if like is None else fn(tree, like.get(prefix))
    return tree


def unstride(t: Any) -> Any:
    """DCP can't save ``_StridedShard`` (fused QKV shards): save it as a plain ``Shard(0)`` of the
    same global tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if any(isinstance(p, _StridedShard) for p in t.placements):
        plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements]
        return distribute_tensor(t.full_tensor(), t.device_mesh, plain)
    return t


def restride(t: Any, placements: Any) -> Any:
    """Inverse of ``unstride`` after loading: back to the placements training uses."""
    from torch.distributed.tensor import distribute_tensor

    if placements is None or tuple(t.placements) == tuple(placements):
        return t
    return distribute_tensor(t.full_tensor(), t.device_mesh, list(placements))


def _zero1_params(pm: Any) -> dict[str, nn.Parameter]:
    inner = pm.module.module if hasattr(pm.module, "module") else pm.module  # DDP's wrapped model
    assert isinstance(inner, nn.Module)
    return dict(inner.named_parameters())


def zero1_state(pm: Any) -> dict[str, Any]:
    """ZeRO-1 optimizer state as {"state": {param name: {key: tensor}}, "param_groups": [...]}.

    Each rank lists only the parameters whose state it owns; DCP merges the ranks' keys, so the
    checkpoint holds every parameter's state once, under the parameter's name."""
    local = pm.optimizer.optim  # ZeroRedundancyOptimizer's shard
    if not local.state:
        _create_optimizer_state(local)  # a fresh model: give DCP the tensors to load into
    names = {p: n for n, p in _zero1_params(pm).items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in pm.optimizer.param_groups
    ]  # the layout get_state_dict gives the other ZeRO stages
    return {"state": {names[p]: dict(s) for p, s in local.state.items()}, "param_groups": groups}


@torch.no_grad()
def _create_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create an optimizer's per-parameter state without changing any parameter: one step on
    zero gradients with the learning rate set to 0 (what get_state_dict does for the other stages)."""
    saved_lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, saved_lrs, strict=True):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def load_zero1_state(pm: Any, optim: dict[str, Any]) -> None:
    local = pm.optimizer.optim
    params = _zero1_params(pm)
    mine = {p for g in local.param_groups for p in g["params"]}
    for name, entry in optim["state"].items():
        if params[name] in mine:
            local.state[params[name]] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()
            }
    for group, saved in zip(pm.optimizer.param_groups, optim["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
