"""Error types for user mistakes.

Every ``AutoparError`` is a ``ValueError``: the CLI turns it into one line on stderr and exit
code 2. An invariant a user depends on raises a real exception too (``PlanInvariantError``),
never an ``assert`` (``python -O`` drops those).
"""

from __future__ import annotations


class AutoparError(ValueError):
    """A user-facing error: the message says what was wrong and what to do."""


class ClusterSpecError(AutoparError):
    """A cluster description (preset name, YAML file or dict) is invalid."""


class ModelSpecError(AutoparError):
    """A MODEL argument (zoo name, ``file.py:factory``, ``pkg.mod:factory``) is invalid."""


class StrategyError(AutoparError):
    """A strategy violates a constraint (the message names it)."""


class CaptureError(AutoparError):
    """The model cannot be captured into a graph (names the module and source line)."""


class InfeasibleError(AutoparError):
    """No plan fits in memory (the message says what would)."""


class PlanInvariantError(RuntimeError):
    """A plan breaks an invariant the runtime depends on (``plan.validate_plan``): a planner bug,
    exit code 1 on the CLI."""
