"""Per-operator recompute policies of a model's block: a small ILP per memory budget.

Between keeping everything autograd saves (no recompute) and keeping only the block's input
(full recompute) lie the policies of selective activation checkpointing: keep the outputs of
some forward calls, recompute the rest in backward. Each kept call costs its output bytes and
saves its recompute time (``cost_models.recompute``), so the best policy for a budget of kept
bytes is a 0/1 knapsack:

    maximise  Σ_c x_c · recompute_s(c)          (recompute time saved)
    s.t.      Σ_c x_c · out_bytes(c) ≤ budget   (kept bytes beyond the block's input)

(the formulation of PyTorch's ``torch.distributed._tools.sac_ilp``, per block type instead of
per module, without its memory-timeline constraint: the layout ILP prices memory per stage).
Solved at a few budgets between full recompute and none, the distinct answers on the lower
convex hull of (bytes kept, seconds redone) form the frontier of policies ``sac1`` (leanest) …
``sacK``; a policy keeping as many bytes as no recompute is dominated by it and dropped. The
layout ILP then chooses per block among none, selective, full and these.
"""

from __future__ import annotations

import pulp

from autopar.cluster import Cluster
from autopar.cost_models.memory import layer_activation_bytes
from autopar.cost_models.profile import ModelProfile
from autopar.cost_models.recompute import call_time_s, kept_bytes, recompute_s
from autopar.errors import AutoparError
from autopar.planner.solver import mip_solver, solve
from autopar.recompute_policy import RECOMPUTE, SAC, RecomputePolicy

BUDGETS = (0.125, 0.25, 0.5, 0.75)
"""Kept bytes beyond the block's input, as shares of what no recompute keeps beyond it."""


def frontier(profile: ModelProfile, cluster: Cluster, dtype: str) -> tuple[RecomputePolicy, ...]:
    """The model's per-operator policies, leanest first (empty for a profile without calls)."""
    layer = profile.layer_types[profile.layers[1]]
    calls = [c for c in layer.calls if c.keepable]
    if not calls:
        return ()
    none = layer_activation_bytes(layer, tp=1, sp=False, recompute="none", input_bytes=profile.input_bytes)
    room = none - profile.input_bytes
    seconds = [call_time_s(c, cluster.device, dtype, tp=1, stream_share=1.0) for c in calls]
    found: dict[frozenset[str], tuple[float, float]] = {}  # keep → (bytes kept, seconds redone)
    for share in BUDGETS:
        keep = _knapsack([c.key for c in calls], seconds, [c.out_bytes for c in calls], share * room)
        kept = kept_bytes(layer, keep, tp=1, sp=False, input_bytes=profile.input_bytes)
        if keep and kept < none:  # keeping nothing is full recompute; as much as none, dominated
            found[keep] = (kept, recompute_s(layer, keep, cluster.device, dtype, tp=1, stream_share=1.0))
    full = (
        float(profile.input_bytes),
        recompute_s(layer, frozenset(), cluster.device, dtype, tp=1, stream_share=1.0),
    )
    ordered = _lower_hull(found, full, (none, 0.0))
    order = {c.key: i for i, c in enumerate(calls)}
    return tuple(
        RecomputePolicy(
            name=f"{SAC}{i + 1}", keep=tuple(sorted(keep, key=order.__getitem__)), calls=len(calls)
        )
        for i, keep in enumerate(ordered)
    )


def _lower_hull(
    points: dict[frozenset[str], tuple[float, float]], full: tuple[float, float], none: tuple[float, float]
) -> list[frozenset[str]]:
    """The policies on the lower convex hull of (bytes kept, seconds redone) between full and
    none, leanest first. One above it is beaten by mixing its two neighbours over the blocks (as
    the layout ILP does), and every choice offered makes the layout ILP larger."""
    hull: list[tuple[float, float, frozenset[str] | None]] = [(*full, None)]
    ordered: list[tuple[frozenset[str] | None, tuple[float, float]]] = sorted(
        points.items(), key=lambda x: x[1]
    )
    for keep, (b, t) in [*ordered, (None, none)]:
        while len(hull) >= 2:
            (b0, t0, _), (b1, t1, _) = hull[-2], hull[-1]
            if (t1 - t0) * (b - b0) >= (t - t0) * (b1 - b0):  # the middle point is not below the chord
                hull.pop()
            else:
                break
        hull.append((b, t, keep))
    return [k for _, _, k in hull if k is not None]


def _knapsack(keys: list[str], seconds: list[float], nbytes: list[int], budget: float) -> frozenset[str]:
    """The calls to keep: most recompute seconds saved within ``budget`` kept bytes."""
    prob = pulp.LpProblem("recompute_policy", pulp.LpMaximize)
    x = [pulp.LpVariable(f"keep_{i}", cat="Binary") for i in range(len(keys))]
    scale_s = max(seconds) or 1.0  # in units of the slowest call, bytes of the budget: well scaled
    scale_b = budget or 1.0
    prob += pulp.lpSum(xi * s / scale_s for xi, s in zip(x, seconds, strict=True)), "recompute_s_saved"
    prob += pulp.lpSum(xi * b / scale_b for xi, b in zip(x, nbytes, strict=True)) <= 1.0, "kept_bytes"
    assert solve(prob, mip_solver(time_limit_s=5.0, gap_rel=1e-6)), "keeping nothing is always feasible"
    return frozenset(k for k, xi in zip(keys, x, strict=True) if (xi.value() or 0) > 0.5)


def recompute_choices(
    allowed: tuple[str, ...], policies: tuple[RecomputePolicy, ...]
) -> tuple[tuple[str, ...], tuple[RecomputePolicy, ...]]:
    """The choices a constraint allows (``sac``: every policy) and the policies among them."""
    names = [p.name for p in policies]
    unknown = [a for a in allowed if a not in (*RECOMPUTE, SAC, *names)]
    if unknown:
        have = ", ".join(names) or "none"
        raise AutoparError(
            f"recompute policy {unknown[0]!r} does not exist for this model and cluster (its "
            f"policies: {have}; `autopar plan --recompute {SAC}` chooses among them)"
        )
    used = tuple(p for p in policies if SAC in allowed or p.name in allowed)
    choices = tuple(a for a in allowed if a in RECOMPUTE) + tuple(p.name for p in used)
    if not choices:
        raise AutoparError(
            f"--recompute {','.join(allowed)}: this model has no per-operator policy; "
            "allow none, selective or full"
        )
    return choices, used


__all__ = ["BUDGETS", "frontier", "recompute_choices"]
