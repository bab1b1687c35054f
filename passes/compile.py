"""Regional compilation: each block of a stage compiled by ``torch.compile``, as torchtitan does
(``apply_compile``: one compile per transformer block, not of the whole model).

``compile_blocks(module, blocks)`` works on the model as written (its blocks are submodules)
and on a pipeline or tensor-parallel stage whose blocks ``pipeline_split.outline_blocks``
installed at their own paths. It runs after recompute wrapping (a checkpointed block is
compiled with its checkpoint, which inductor's partitioner then honours) and before
data-parallel sharding (FSDP2's hooks stay outside the compiled code). ``nn.Module.compile``
compiles each block in place: parameter names, state dicts and checkpoints stay the model's.
Shapes are static (``dynamic=False``): a plan's micro-batch shape is fixed, and a block that
meets a new shape (an eval batch) compiles again for it rather than into a dynamic-shape
kernel that would differ from the first. Blocks of one class share their compiled code (dynamo
guards on the module's structure, not its identity); the outlined blocks of a captured graph
are one class each and compile each.

A tensor-parallel block (its parameters are DTensors, read with ``to_local``) keeps its
checkpoints outside compiled code. With torch 2.13, when a checkpoint's region is recomputed
inside a compiled graph, AOTAutograd's partitioner puts the DeviceMesh that ``to_local``'s
backward needs among the saved tensors and the first step fails ("expected all
tensors_saved_with_vc_check to be Tensors": seen under TP2 on Llama, GPT-2 and Falcon with
selective recompute, Llama and the zoo GPT with full). So a fully recomputed TP block compiles
the module inside its checkpoint, and a TP block with a checkpointed child (selective: its
attention) compiles only that child's module, inside its checkpoint; the rest of that block runs
eagerly. Compiling the rest around the checkpoint, with a graph break at it, trained Falcon's
parallel attention + MLP wrongly: its layer norms' gradients differed from eager's by up to
3e-3 (one SGD step at lr 1). A per-operator policy (a checkpoint with a ``context_fn``) is
compiled whole, as without TP (tested under TP2).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from autopar.passes.recompute import has_submodule

BACKEND = "inductor"
"""The ``torch.compile`` backend a compiled plan runs with (torch's default)."""


def compile_blocks(module: nn.Module, blocks: Iterable[str], *, backend: str = BACKEND) -> list[str]:
    """Compile in place each of ``blocks`` (paths; ``""``: ``module`` itself) that ``module``
    holds; returns those compiled (a pipeline stage holds only its own)."""
    done = []
    for name in blocks:
        if has_submodule(module, name):
            _compile_block(module.get_submodule(name), backend)
            done.append(name)
    return done


def _compile_block(block: nn.Module, backend: str) -> None:
    """Compile ``block`` in place; in a TP block, each plain checkpoint stays outside compiled code
    (see the module's docstring)."""
    if not _holds_dtensors(block):
        block.compile(backend=backend, dynamic=False)
        return
    checkpointed = [inner for m in block.modules() if (inner := _fully_checkpointed(m)) is not None]
    for inner in checkpointed:  # full: the block itself; selective: its attention
        inner.compile(backend=backend, dynamic=False)
    if not checkpointed:
        block.compile(backend=backend, dynamic=False)


def _holds_dtensors(block: nn.Module) -> bool:
    """Whether any parameter of ``block`` is a DTensor (a tensor-parallel block)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in block.parameters())


def _fully_checkpointed(module: nn.Module) -> nn.Module | None:
    """The module a ``checkpoint_wrapper`` without a selective policy (no ``context_fn``: all of
    it recomputed) wraps; None where ``module`` is no such wrapper."""
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    call = getattr(module, "checkpoint_fn", None)
    policy = getattr(call, "keywords", {}).get("context_fn")
    return inner if isinstance(inner, nn.Module) and policy is None else None


__all__ = ["BACKEND", "compile_blocks"]
