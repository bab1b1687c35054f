"""How the planner's ILPs are solved: PuLP with HiGHS in-process (CBC, bundled with PuLP, where
HiGHS is missing), its banner kept off stdout. ``sol_status`` is checked, not ``LpStatus``
("Optimal" even when a time limit stopped the solve)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pulp


@contextlib.contextmanager
def stdout_silenced() -> Iterator[None]:
    """Point file descriptor 1 at /dev/null (C libraries write there directly)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def mip_solver(*, time_limit_s: float, gap_rel: float) -> pulp.LpSolver:
    """HiGHS proving a relative gap of ``gap_rel`` (not its default absolute gap of 1e-6 in
    whatever units), or CBC if HiGHS is missing."""
    if pulp.HiGHS().available():
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap_rel, gapAbs=0.0)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap_rel)


def solve(prob: pulp.LpProblem, solver: pulp.LpSolver) -> bool:
    """Solve ``prob`` silently; whether a feasible (optimal or time-limited) solution was found."""
    with stdout_silenced():  # HiGHS prints a banner once per process, even with msg=False
        prob.solve(solver)
    return prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


__all__ = ["mip_solver", "solve", "stdout_silenced"]
