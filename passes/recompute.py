"""Activation recomputation: wrap the blocks a plan recomputes in ``checkpoint_wrapper``.

``recompute(module, choices)`` works on the model as written (its blocks are submodules) and on
a pipeline or tensor-parallel stage whose blocks ``pipeline_split.outline_blocks`` installed at
their own paths: ``full`` wraps the whole block, ``selective`` only its attention (Korthikanti
et al. 2022, §5: the attention core saves the s² tensors and is cheap to recompute), outlined
first where the block is a graph. Non-reentrant checkpointing, so gradients are exact.
"""

from __future__ import annotations

from torch import fx, nn

from autopar.passes.pipeline_split import is_attention, outline_attention


def has_submodule(module: nn.Module, path: str) -> bool:
    """Whether ``module`` holds a submodule at ``path`` (a pipeline stage holds only its blocks)."""
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def recompute(module: nn.Module, choices: dict[str, str]) -> nn.Module:
    """Wrap the blocks of ``module`` that ``choices`` (block path → none | selective | full)
    recompute; blocks it does not hold are left to the stages that do. Returns ``module``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, choice in choices.items():
        if choice == "none" or not has_submodule(module, name):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        block = getattr(parent, child)
        if choice == "full":
            setattr(parent, child, checkpoint_wrapper(block))
            continue
        if isinstance(block, fx.GraphModule):
            block, attn = outline_attention(block, name)
        else:
            attn = next((n for n, _ in block.named_children() if is_attention(n)), None)
        if attn is not None:
            setattr(block, attn, checkpoint_wrapper(getattr(block, attn)))
        setattr(parent, child, block)
    return module


__all__ = ["has_submodule", "recompute"]
