"""What a plan is asked for: the model, the cluster, the batch and sequence, and the user's
constraints. ``PlanRequest`` is built once (by ``autopar.plan``, ``autopar.parallelize``, the
CLI or a benchmark) and handed to the planner whole."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass, replace
from typing import TYPE_CHECKING, Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.groups import MixedCluster
from autopar.knobs import constraint_fields, constraint_problem, knobs

if TYPE_CHECKING:
    from torch import nn

from autopar.recompute_policy import ALLOWED_RECOMPUTE, is_recompute_name
from autopar.strategy import DTYPES, Strategy

_Fixed: Any = make_dataclass("_Fixed", constraint_fields(Strategy), frozen=True, kw_only=True)
"""A field per knob the user may fix (``Knob.fixable``), made from ``Strategy``'s declarations:
``T | None``, None letting the planner pick (``Knob.free``: the value kept unless told)."""


@dataclass(frozen=True, kw_only=True)
class Constraints(_Fixed):
    """What the user fixed or forbade; None means free: a field per knob of ``Strategy`` the user
    may fix (``Constraints(tp=8, zero=1)``; the knob's ``Strategy`` field documents it, its
    ``Knob`` says whether it is fixable: ``autopar.knobs``), and the planner's own limits:"""

    recompute: tuple[str, ...] = ALLOWED_RECOMPUTE
    """Recompute choices allowed per block: none, selective, full, ``sac`` (every per-operator
    policy the planner finds for the model) or single policies (``sac2``)."""
    allow_lossy_comm: bool = False
    """Let the planner pick communication knobs that drop precision the plan's dtype keeps
    (``Strategy.lossy_comm``: bf16 gradient reduction of an fp32 or fp16 plan, PowerSGD)."""
    memory_cap_bytes: float | None = None
    """Plan for at most this much memory per GPU (below the device's)."""
    max_micro_batch: int = 16
    """Largest micro-batch tried."""
    reserve_bytes: float | None = None
    """Memory kept back per GPU (default: 1 GiB context + 5% for fragmentation)."""

    def __post_init__(self) -> None:
        if why := constraint_problem(Strategy, self):  # each fixed knob's type, bounds, choices
            raise AutoparError(why)
        r = self.dp_replicate
        if r is not None and r > 1 and self.zero is not None and self.zero < 2:
            raise AutoparError(f"HSDP (dp_replicate {r}) shards with ZeRO-2 or 3, not ZeRO-{self.zero}")
        if not self.recompute or not all(isinstance(r, str) and is_recompute_name(r) for r in self.recompute):
            raise AutoparError(
                f"recompute takes a non-empty subset of {', '.join(ALLOWED_RECOMPUTE)} or policy names "
                f"(sac1, sac2, …), got {self.recompute!r}"
            )
        if self.memory_cap_bytes is not None and not self.memory_cap_bytes > 0:
            raise AutoparError(f"memory_cap_bytes must be positive, got {self.memory_cap_bytes!r}")
        if self.reserve_bytes is not None and not self.reserve_bytes >= 0:
            raise AutoparError(f"reserve_bytes must be non-negative, got {self.reserve_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One planning problem."""

    model: str | nn.Module
    """A MODEL spec (zoo name, ``file.py:factory``, ``package.module:factory``) or a module
    (captured on fake tensors: its weights are never read)."""
    cluster: Cluster | MixedCluster
    """Where it trains (with measured profiles attached, if any: ``Cluster.from_profile``), or
    node groups of different devices (``groups.MixedCluster``)."""
    global_batch: int
    """Sequences per optimizer step."""
    seq: int
    """Sequence length."""
    dtype: str = "bf16"
    """Training dtype (bf16 / fp16 keep fp32 master weights)."""
    constraints: Constraints = field(default_factory=Constraints)
    """What the user fixed or forbade."""
    top_k: int = 5
    """Runners-up to keep besides the plan (those the search met on the way to proving the optimum)."""
    proven_runners_up: int = 0
    """Runners-up the search must prove the fastest after the plan, as it proves the plan (at most
    ``top_k``; more layout ILPs): ``autopar plan --check K`` asks for K − 1."""
    time_limit_s: float = 10.0
    """Wall-time budget of the layout ILPs together."""
    name: str | None = None
    """What the plan calls the model (default: the spec, or the module's class name)."""

    def __post_init__(self) -> None:
        for what in ("global_batch", "seq", "top_k"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AutoparError(f"{what} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise AutoparError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.proven_runners_up <= self.top_k:
            raise AutoparError(
                f"proven_runners_up must be within 0..top_k ({self.top_k}), got {self.proven_runners_up!r}"
            )
        if self.time_limit_s <= 0:
            raise AutoparError(f"time_limit_s must be positive, got {self.time_limit_s!r}")
        c = self.constraints
        if c.grad_reduce not in (None, "fp32", self.dtype) and not c.allow_lossy_comm:
            raise AutoparError(
                f"a {c.grad_reduce} gradient reduction of a {self.dtype} plan drops precision the plan "
                "keeps; pass --allow-lossy-comm (allow_lossy_comm=True) to allow it, or reduce in fp32"
            )
        if c.powersgd_rank and not c.allow_lossy_comm:
            raise AutoparError(
                f"PowerSGD (rank {c.powersgd_rank}) approximates every gradient; pass --allow-lossy-comm "
                "(allow_lossy_comm=True) to allow it, or --powersgd-rank 0"
            )

    @property
    def model_name(self) -> str:
        """The name the plan records."""
        if self.name is not None:
            return self.name
        return self.model if isinstance(self.model, str) else type(self.model).__name__

    @property
    def one_type(self) -> Cluster:
        """The cluster of one type of node (a mixed cluster is planned by ``planner.mixed``
        through its ``ideal`` cluster)."""
        if isinstance(self.cluster, MixedCluster):
            raise TypeError("this step plans one type of node: give it the mixed cluster's ideal()")
        return self.cluster

    @property
    def capacity_bytes(self) -> float:
        """Memory a plan may use per GPU: the device's, or the cap if lower."""
        cluster = self.cluster.ideal() if isinstance(self.cluster, MixedCluster) else self.cluster
        cap = self.constraints.memory_cap_bytes
        return min(cluster.device.memory_bytes, cap) if cap else cluster.device.memory_bytes


def pinned(request: PlanRequest, st: Strategy) -> PlanRequest:
    """``request`` with every knob the user may fix fixed to ``st``'s value: planned again, it gives
    ``st`` as a whole plan (its per-block layout and TP table solved again; a runner-up of
    ``make_plan`` becomes a ``Plan`` this way)."""
    fixed = {name: getattr(st, name) for name, k in knobs(Strategy).items() if k.fixable}
    return replace(request, constraints=replace(request.constraints, **fixed), top_k=1, proven_runners_up=0)


__all__ = ["Constraints", "PlanRequest", "pinned"]
