"""Local process groups, started cheaply: ``launch`` is ``torch.multiprocessing.spawn`` whose
children are forked from one server process that imported torch and autopar's runtime once.

Why: a spawned child starts a fresh interpreter and imports torch, FSDP2, pipelining and
autopar again — about 1 s per rank on 2 cores (a 2-rank group 2.2–2.5 s, 4 ranks 4.6 s, 8 ranks
10.4 s before any work). A forkserver pays those imports once, in its server (the first launch:
2.9 s for 2 ranks), and forks each child from it: later launches of 2, 4 and 8 ranks started in
0.08, 0.12 and 0.21 s (``python benchmarks/launch_speed.py``, torch 2.13 CPU, 2 cores).
``autopar verify`` and the test suite start every local group through it.

The server forks children with its own environment, taken when it started; ``launch`` hands
each child the caller's environment of the moment, so a child sees what a spawned one would
(the working directory and ``sys.path`` already travel with multiprocessing's own
preparation data)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "autopar.runtime",
    "autopar.measure.verify",
)
"""What the server imports before it forks: torch and everything a rank running a plan
imports (the runtime imports FSDP2, DTensor, pipelining and DCP on first use)."""


class _Entry:
    """A child's body: the caller's environment, then ``fn(rank, *args)``. Picklable whenever
    ``fn`` is (a module-level function), as ``spawn`` requires."""

    def __init__(self, fn: Callable[..., Any], env: dict[str, str]) -> None:
        self.fn, self.env = fn, env

    def __call__(self, rank: int, *args: Any) -> Any:
        os.environ.clear()
        os.environ.update(self.env)
        return self.fn(rank, *args)


def launch(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1, join: bool = True) -> Any:
    """Run ``fn(rank, *args)`` in ``nprocs`` local processes, as ``torch.multiprocessing.spawn``
    does (same arguments, same errors: a child's exception is raised here as
    ``ProcessRaisedException``; ``join=False`` returns the ``ProcessContext``)."""
    import torch.multiprocessing as mp

    # the first launch starts the server with these imports; later calls change nothing
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    entry = _Entry(fn, dict(os.environ))
    return mp.start_processes(entry, args=args, nprocs=nprocs, join=join, start_method="forkserver")
