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
            module.get_submodule(name).compile(backend=backend, dynamic=False)
            done.append(name)
    return done


__all__ = ["BACKEND", "compile_blocks"]
