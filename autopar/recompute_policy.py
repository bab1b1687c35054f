"""Per-operator recompute policies and the names a recompute choice may take.

A ``RecomputePolicy`` is data a plan carries (``Strategy.policies``): which ATen calls of a
block keep their outputs for backward; the planner finds them (``planner.recompute_ilp``) and
``passes.recompute`` applies them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from autopar.errors import StrategyError

RECOMPUTE = ("none", "selective", "full")
"""The recompute choices every model has; a strategy adds its per-operator policies after them."""
SAC = "sac"
"""Constraint name of every per-operator policy (``RecomputePolicy``) of a model: sac1, sac2, …"""
ALLOWED_RECOMPUTE = ("none", "selective", SAC, "full")
"""What the planner may choose per block by default: every choice and every policy."""
_POLICY_NAME = re.compile(r"sac[1-9][0-9]*")
_CALL_KEY = re.compile(r".+#[0-9]+")


def is_recompute_name(name: str) -> bool:
    """A name a recompute constraint may hold: none, selective, full, ``sac`` (every
    per-operator policy) or one policy (``sac1``, ``sac2``, …)."""
    return name in ALLOWED_RECOMPUTE or bool(_POLICY_NAME.fullmatch(name))


@dataclass(frozen=True, kw_only=True)
class RecomputePolicy:
    """Selective activation checkpointing of a block: the forward's ATen calls whose outputs are
    kept for backward; every other call is recomputed in backward (from the block's input and
    the kept outputs). The planner finds a few per model (``planner.recompute_ilp``), between
    recomputing nothing and everything."""

    name: str
    """``sac1``, ``sac2``, … (fewest bytes kept first)."""
    keep: tuple[str, ...]
    """Kept calls as ``op#k``: the k-th call of operator ``op`` in one forward of the block
    (``graph.dispatch``), e.g. ``mm#0``, ``sdpa#0``."""
    calls: int
    """Calls of the block a policy may keep (for the plan's text: how many it recomputes)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _POLICY_NAME.fullmatch(self.name):
            raise StrategyError(f"a recompute policy is named sac1, sac2, …; got {self.name!r}")
        bad = [k for k in self.keep if not isinstance(k, str) or not _CALL_KEY.fullmatch(k)]
        if bad or len(set(self.keep)) != len(self.keep):
            raise StrategyError(
                f"policy {self.name}: kept calls must be distinct 'op#k' names, got {list(self.keep)!r}"
            )
        if not isinstance(self.calls, int) or self.calls < len(self.keep):
            raise StrategyError(f"policy {self.name}: {self.calls!r} calls, fewer than it keeps")

    @property
    def summary(self) -> str:
        """E.g. ``keep 5 mm, sdpa (6 of 31 calls)``: the rest are recomputed."""
        kinds = Counter(k.rpartition("#")[0] for k in self.keep)
        kept = ", ".join(f"{n} {op}" if n > 1 else op for op, n in kinds.most_common()) or "nothing"
        return f"keep {kept} ({len(self.keep)} of {self.calls} calls)"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"name": self.name, "keep": list(self.keep), "calls": self.calls}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecomputePolicy:
        """Inverse of ``to_dict``."""
        return cls(name=d["name"], keep=tuple(d["keep"]), calls=d["calls"])
