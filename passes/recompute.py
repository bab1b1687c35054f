"""Activation recomputation: wrap the blocks a plan recomputes in ``checkpoint_wrapper``.

``recompute(module, choices, policies)`` works on the model as written (its blocks are
submodules) and on a pipeline or tensor-parallel stage whose blocks ``pipeline_split.
outline_blocks`` installed at their own paths: ``full`` wraps the whole block, ``selective``
only its attention (Korthikanti et al. 2022, §5: the attention core saves the s² tensors and is
cheap to recompute), outlined first where the block is a graph, and a per-operator policy
(``Strategy.policies``) wraps the whole block under selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the calls it names keep their
outputs, every other call is recomputed in backward. Non-reentrant checkpointing, so gradients
are exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import fx, nn

from autopar.graph.dispatch import op_name
from autopar.passes.pipeline_split import is_attention, outline_attention
from autopar.recompute_policy import RecomputePolicy


def has_submodule(module: nn.Module, path: str) -> bool:
    """Whether ``module`` holds a submodule at ``path`` (a pipeline stage holds only its blocks)."""
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def policy_fn(keep: frozenset[str]) -> Callable[..., Any]:
    """A selective-checkpointing policy for one forward of a block: the k-th call of operator
    ``op`` (``graph.dispatch.op_name``) is kept when ``op#k`` is in ``keep``, else recomputed.
    Calls are counted separately in the forward and in the recomputation (older PyTorch asks
    the policy again while recomputing)."""
    from torch.utils.checkpoint import CheckpointPolicy

    seen: dict[tuple[bool, str], int] = {}

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op_name(func)
        k = seen.get((ctx.is_recompute, name), 0)
        seen[(ctx.is_recompute, name)] = k + 1
        if f"{name}#{k}" in keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def _contexts(keep: frozenset[str]) -> Any:
    """``context_fn`` of ``torch.utils.checkpoint``: fresh counters for every forward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy_fn(keep))


def selective(block: nn.Module, policy: RecomputePolicy) -> nn.Module:
    """``block`` checkpointed whole, keeping the outputs of the calls ``policy`` names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(block, context_fn=functools.partial(_contexts, frozenset(policy.keep)))


def recompute(
    module: nn.Module, choices: dict[str, str], policies: tuple[RecomputePolicy, ...] = ()
) -> nn.Module:
    """Wrap the blocks of ``module`` that ``choices`` (block path → none | selective | full |
    a policy's name) recompute; blocks it does not hold are left to the stages that do.
    Returns ``module``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    by_name = {p.name: p for p in policies}
    for name, choice in choices.items():
        if choice == "none" or not has_submodule(module, name):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        block = getattr(parent, child)
        if choice == "full":
            setattr(parent, child, checkpoint_wrapper(block))
            continue
        if choice in by_name:
            setattr(parent, child, selective(block, by_name[choice]))
            continue
        assert choice == "selective", f"unknown recompute choice {choice!r}"
        if isinstance(block, fx.GraphModule):
            block, attn = outline_attention(block, name)
        else:
            attn = next((n for n, _ in block.named_children() if is_attention(n)), None)
        if attn is not None:
            setattr(block, attn, checkpoint_wrapper(getattr(block, attn)))
        setattr(parent, child, block)
    return module


__all__ = ["has_submodule", "policy_fn", "recompute", "selective"]
