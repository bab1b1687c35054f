"""What a plan is asked for: the model, the cluster, the batch and sequence, and the user's
constraints. ``PlanRequest`` is built once (by ``autopar.plan``, ``autopar.parallelize``, the
CLI or a benchmark) and handed to the planner whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autopar.cluster import Cluster
from autopar.errors import AutoparError

if TYPE_CHECKING:
    from torch import nn

from autopar.recompute_policy import ALLOWED_RECOMPUTE, is_recompute_name
from autopar.strategy import (
    COMPILE,
    DTYPES,
    GRAD_REDUCE,
    SCHEDULES,
    TP_OBJECTIVES,
)


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """What the user fixed or forbade; None means free."""

    tp: int | None = None
    """Fix the tensor-parallel degree."""
    pp: int | None = None
    """Fix the pipeline-parallel degree."""
    dp: int | None = None
    """Fix the data-parallel degree."""
    zero: int | None = None
    """Fix the ZeRO stage."""
    micro_batch: int | None = None
    """Fix the micro-batch size."""
    schedule: str | None = None
    """Fix the schedule (gpipe, 1f1b, interleaved, interleaved-zb, zbv, dualpipev)."""
    virtual_stages: int | None = None
    """Fix v, the chunks per rank of a multi-chunk schedule."""
    sequence_parallel: bool | None = None
    """Force sequence parallelism on or off."""
    tp_objective: str | None = None
    """Fix what the per-operator TP choice minimises: ``time`` or ``memory`` (None: both are
    priced where their layouts differ)."""
    recompute: tuple[str, ...] = ALLOWED_RECOMPUTE
    """Recompute choices allowed per block: none, selective, full, ``sac`` (every per-operator
    policy the planner finds for the model) or single policies (``sac2``)."""
    grad_reduce: str | None = None
    """Fix the dtype of the data-parallel gradient reduction (fp32 or bf16; None: the planner
    picks, bf16 only where it loses nothing the plan keeps or ``allow_lossy_comm``)."""
    allow_lossy_comm: bool = False
    """Let the planner pick communication knobs that drop precision the plan's dtype keeps
    (``Strategy.lossy_comm``: bf16 gradient reduction of an fp32 or fp16 plan, PowerSGD)."""
    powersgd_rank: int | None = None
    """Fix PowerSGD's rank (``Strategy.powersgd_rank``; 0: off). None: the planner prices
    rank 4 on DDP plans whose DP axis leaves the node, only with ``allow_lossy_comm``."""
    dp_replicate: int | None = None
    """Fix HSDP's replica count (``Strategy.dp_replicate``; 1: no HSDP). None: the planner
    prices flat ZeRO-2/3 and shard groups of one and two nodes' data-parallel ranks."""
    bucket_mb: float | None = None
    """Fix DDP's gradient bucket cap in MiB on plans that run on DDP (``Strategy.bucket_mb``).
    None: torch's 25, and 100 and 400 priced too where DDP's all-reduce leaves the node."""
    ep: int | None = None
    """Fix the expert-parallel degree (``Strategy.ep``; 1: experts replicated). None: the planner
    prices every ep dividing dp and the model's routed experts (tp = 1)."""
    expert_skew: float = 1.0
    """The experts' load imbalance the plans are priced with (``Strategy.expert_skew``): routed
    rows on the busiest expert-parallel rank over an even share; 1 (balanced) by default."""
    compile: str | None = "off"
    """Fix how the plan compiles (``Strategy.compile``: off or block). None: the planner prices
    both and keeps the faster; off by default, as compiling costs minutes of warm-up and a
    model with graph breaks compiles in pieces."""
    memory_cap_bytes: float | None = None
    """Plan for at most this much memory per GPU (below the device's)."""
    max_micro_batch: int = 16
    """Largest micro-batch tried."""
    reserve_bytes: float | None = None
    """Memory kept back per GPU (default: 1 GiB context + 5% for fragmentation)."""

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise AutoparError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.grad_reduce is not None and self.grad_reduce not in GRAD_REDUCE:
            raise AutoparError(
                f"grad_reduce must be one of {', '.join(GRAD_REDUCE)}, got {self.grad_reduce!r}"
            )
        if self.compile is not None and self.compile not in COMPILE:
            raise AutoparError(f"compile must be one of {', '.join(COMPILE)} or None, got {self.compile!r}")
        for name, least in (("powersgd_rank", 0), ("ep", 1), ("dp_replicate", 1)):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < least):
                kind = "non-negative" if least == 0 else "positive"
                raise AutoparError(f"{name} must be a {kind} integer, got {k!r}")
        self._check_numbers()
        r = self.dp_replicate
        if r is not None and r > 1 and self.zero is not None and self.zero < 2:
            raise AutoparError(f"HSDP (dp_replicate {r}) shards with ZeRO-2 or 3, not ZeRO-{self.zero}")
        if self.tp_objective is not None and self.tp_objective not in TP_OBJECTIVES:
            raise AutoparError(
                f"tp_objective must be one of {', '.join(TP_OBJECTIVES)}, got {self.tp_objective!r}"
            )
        if not self.recompute or not all(isinstance(r, str) and is_recompute_name(r) for r in self.recompute):
            raise AutoparError(
                f"recompute takes a non-empty subset of {', '.join(ALLOWED_RECOMPUTE)} or policy names "
                f"(sac1, sac2, …), got {self.recompute!r}"
            )

    def _check_numbers(self) -> None:
        """The real-valued knobs: skew, bucket size, memory cap and reserve."""
        s = self.expert_skew
        if isinstance(s, bool) or not isinstance(s, int | float) or not 1 <= s < math.inf:
            raise AutoparError(f"expert_skew must be a number ≥ 1 (1: balanced experts), got {s!r}")
        b = self.bucket_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, int | float) or not 0 < b < math.inf):
            raise AutoparError(f"bucket_mb must be a positive number of MiB, got {b!r}")
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
    cluster: Cluster
    """Where it trains (with measured profiles attached, if any: ``Cluster.from_profile``)."""
    global_batch: int
    """Sequences per optimizer step."""
    seq: int
    """Sequence length."""
    dtype: str = "bf16"
    """Training dtype (bf16 / fp16 keep fp32 master weights)."""
    constraints: Constraints = field(default_factory=Constraints)
    """What the user fixed or forbade."""
    top_k: int = 5
    """Runners-up to keep besides the plan."""
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
    def capacity_bytes(self) -> float:
        """Memory a plan may use per GPU: the device's, or the cap if lower."""
        cap = self.constraints.memory_cap_bytes
        return min(self.cluster.device.memory_bytes, cap) if cap else self.cluster.device.memory_bytes


__all__ = ["Constraints", "PlanRequest"]
