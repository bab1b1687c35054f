"""Checkpoint state of a placed model, for ``torch.distributed.checkpoint`` (DCP).

Every plan saves the same layout: ``{"model": {FQN: tensor}, "optimizer": {flattened key:
value}}`` under the original model's names (``get_model_state_dict`` and
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` per local stage: keys
``state.<FQN>.<key>`` and ``param_groups.<FQN>.<key>``, which DCP reshards between plans,
pipeline stages included). Two things DCP cannot do alone are handled here:

- ZeRO-1 (``ZeroRedundancyOptimizer``) keeps each parameter's state on the rank that owns it;
  that rank saves it under the same flattened keys, so DCP merges the ranks' entries and a
  ZeRO-1 checkpoint loads under any other ZeRO stage or world size, and back;
- fused-QKV shards are ``_StridedShard`` DTensors, which DCP can't plan: they are saved as plain
  ``Shard`` DTensors of the same global tensor (``unstride``) and restored on load (``restride``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

WRAPPED = "_checkpoint_wrapped_module."
"""What ``checkpoint_wrapper`` inserts into parameter names (removed to get the model's FQNs)."""


def fqn(name: str) -> str:
    """A parameter name with wrapper prefixes removed: the original model's FQN."""
    return name.replace(WRAPPED, "")


def flatten(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    """Nested dicts → ``out`` keyed by dotted paths."""
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


def _is_zero1(opt: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(opt, ZeroRedundancyOptimizer)


def named_params(stage: nn.Module) -> dict[str, nn.Parameter]:
    """The stage's parameters by the model's FQNs (inside DDP's wrapper, without recompute's)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = stage.module if isinstance(stage, DistributedDataParallel) else stage
    assert isinstance(inner, nn.Module)
    return {fqn(n): p for n, p in inner.named_parameters()}


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


def zero1_state(stage: nn.Module, opt: Any) -> dict[str, Any]:
    """ZeRO-1 optimizer state, flattened as DCP flattens the others: ``state.<name>.<key>`` for
    the parameters whose state this rank owns, ``param_groups.<name>.<key>`` for every one."""
    local = opt.optim  # ZeroRedundancyOptimizer's shard
    if not local.state:
        _create_optimizer_state(local)  # a fresh model: give DCP the tensors to load into
    names = {p: n for n, p in named_params(stage).items()}
    out = {f"state.{names[p]}.{k}": v for p, s in local.state.items() for k, v in s.items()}
    for g in opt.param_groups:
        out.update(
            {f"param_groups.{names[p]}.{k}": v for p in g["params"] for k, v in g.items() if k != "params"}
        )
    return out


def _by_name(optim: dict[str, Any], section: str) -> dict[str, dict[str, Any]]:
    """Flattened ``<section>.<name>.<key>`` entries → {name: {key: value}} (keys have no dots)."""
    found: dict[str, dict[str, Any]] = {}
    for key, value in optim.items():
        if key.startswith(section + "."):
            name, _, k = key[len(section) + 1 :].rpartition(".")
            found.setdefault(name, {})[k] = value
    return found


def load_zero1_state(stage: nn.Module, opt: Any, optim: dict[str, Any]) -> None:
    """Inverse of ``zero1_state``: this rank's parameters' state, every group's settings."""
    local = opt.optim
    params = named_params(stage)
    mine = {p for g in local.param_groups for p in g["params"]}
    for name, entry in _by_name(optim, "state").items():
        if name in params and params[name] in mine:  # (a tied weight's other names: skipped)
            local.state[params[name]] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()
            }
    names = {p: n for n, p in params.items()}
    groups = _by_name(optim, "param_groups")
    for group in opt.param_groups:
        group.update(groups.get(names[group["params"][0]], {}))


def local_state(stages: Sequence[nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
    """This rank's model and optimizer entries of every local stage, merged, under the model's
    names (optimizer state flattened by FQN, as DCP keys it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for stage, opt in zip(stages, optimizers, strict=True):
        model.update({fqn(k): v for k, v in get_model_state_dict(stage).items()})
        if _is_zero1(opt):
            optim.update(zero1_state(stage, opt))
        else:
            optim.update({fqn(k): v for k, v in get_optimizer_state_dict(stage, opt, options=flat).items()})
    return {"model": model, "optimizer": optim}


def placements_of(state: dict[str, Any]) -> dict[str, Any]:
    """Flattened key → DTensor placements of a state dict (to undo ``unstride`` on load)."""
    flat: dict[str, Any] = {}
    flatten(state, "", flat)
    return {k: v.placements for k, v in flat.items() if hasattr(v, "placements")}


def load_local_state(stages: Sequence[nn.Module], optimizers: Sequence[Any], state: dict[str, Any]) -> None:
    """Inverse of ``local_state``: each stage takes the entries under its own names."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for stage, opt in zip(stages, optimizers, strict=True):
        names = [fqn(k) for k in get_model_state_dict(stage)]
        set_model_state_dict(stage, {k: state["model"][k] for k in names if k in state["model"]})
        if _is_zero1(opt):
            load_zero1_state(stage, opt, state["optimizer"])
            continue
        optim_names = get_optimizer_state_dict(stage, opt, options=flat)
        mine = {k: state["optimizer"][fqn(k)] for k in optim_names if fqn(k) in state["optimizer"]}
        set_optimizer_state_dict(stage, opt, mine, options=flat)


__all__ = [
    "WRAPPED",
    "flatten",
    "fqn",
    "load_local_state",
    "load_zero1_state",
    "local_state",
    "map_dtensors",
    "named_params",
    "placements_of",
    "restride",
    "unstride",
    "zero1_state",
]
