"""What ``autopar.Adaptive`` decides at the end of a window, without a process group: the
configuration, the decision, the rule (``verdict``) and ``Replanner`` — the cluster calibrated
on the run's measurements, the model re-planned on it, and the rule applied. Rank 0 runs it;
``autopar.adapt`` measures and acts."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from torch import nn

from autopar.cluster import Cluster
from autopar.cost_models.switch import switch_gain_s, switch_pays
from autopar.errors import AutoparError, InfeasibleError
from autopar.measure.calibrate import RunCalibration, calibrate_cluster
from autopar.measurements import CommProfile
from autopar.plan import Plan
from autopar.planner import ModelProfiles, Pricer, make_plan
from autopar.request import Constraints, PlanRequest
from autopar.strategy import Strategy

PROBE_MIN_BYTES = 64 * 2**10
"""The link probe's smallest message (latency-bound on every link)."""


@dataclass(frozen=True, kw_only=True)
class AdaptConfig:
    """How ``Adaptive`` measures and when it switches."""

    every: int = 10
    """Timed steps per calibration window; a decision at the end of each."""
    warmup: int = 2
    """Steps not timed after each placement (first calls allocate, warm caches, compile)."""
    margin: float = 0.15
    """A new plan's predicted step is taken this much too optimistic before it is compared: the
    cost model's error on plans it has not seen run (the corpus's held-out median is 11.3%)."""
    memory_limit: float = 0.9
    """A rank whose peak memory passes this share of its device's re-plans for memory."""
    max_switches: int = 3
    """Switches allowed in one run."""
    probe: bool = True
    """At the first window, time the collectives on this world's groups (else the cluster's
    description of its links is kept and only the device's speed is calibrated) and a
    checkpoint's save and load in the switch folder (else a switch is estimated at a
    placement's time alone, until one ran)."""
    probe_max_bytes: int = 16 * 2**20
    """The link probe's largest message."""
    folder: str | None = None
    """Where a switch writes the state: a folder every rank reads (a shared file system across
    nodes). None: a new temporary folder, on one node only."""

    def __post_init__(self) -> None:
        checks = [
            ("every", self.every, self.every >= 1, "an integer ≥ 1"),
            ("warmup", self.warmup, self.warmup >= 0, "an integer ≥ 0"),
            ("margin", self.margin, 0 <= self.margin < 1, "a fraction in [0, 1)"),
            ("memory_limit", self.memory_limit, 0 < self.memory_limit <= 1, "a fraction in (0, 1]"),
            ("max_switches", self.max_switches, self.max_switches >= 0, "an integer ≥ 0"),
            ("probe_max_bytes", self.probe_max_bytes, self.probe_max_bytes >= PROBE_MIN_BYTES, "≥ 65536"),
        ]
        for name, value, ok, want in checks:
            if not ok:
                raise AutoparError(f"AdaptConfig.{name}={value!r}: give {want}")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What one calibration window decided."""

    step: int
    """The step after which it was made."""
    action: str
    """"switch" or "stay"."""
    trigger: str
    """"time" (the step time), "memory" (a rank near its device's memory) or "" (staying)."""
    text: str
    """The line printed."""
    measured_s: float
    """The window's median step."""
    now_s: float
    """The running plan's step on the calibrated cluster."""
    new_s: float
    """The re-planned plan's step on the calibrated cluster (``now_s`` where none was found)."""
    switch_s: float
    """What a switch was expected to cost."""
    compute_scale: float
    """κ: the device's measured time per priced second of compute."""
    plan: str | None = None
    """The plan switched to, as JSON."""
    took_s: float | None = None
    """The switch's measured time (the slowest rank's)."""

    def event(self) -> dict[str, Any]:
        """The decision as a metrics event (no plan JSON)."""
        return {k: v for k, v in asdict(self).items() if k != "plan"}


@dataclass(frozen=True, kw_only=True)
class Window:
    """What a run measured in one window, and where it stands."""

    step: int
    """The window's last step."""
    steps_s: tuple[float, ...]
    """Its timed steps (seconds)."""
    peaks: tuple[float, ...]
    """Every rank's peak memory (bytes), by rank."""
    remaining: int
    """Steps left in the run."""
    switch_s: float
    """What a switch costs: estimated, or measured once one ran."""
    switched: int = 0
    """Switches made so far."""
    left: frozenset[str] = frozenset()
    """The plans left (``strategy_key``), never returned to."""
    comm: CommProfile | None = None
    """The links measured, if probed."""


def probe_problem(world: int, per_node: int) -> str | None:
    """Why this world's links can't be probed (``measure.comm`` pairs ranks for send/recv: an
    even count of ranks, and of nodes when there are several), or None. Every rank decides alike."""
    nodes = world // per_node
    if world < 2:
        return "one rank has no links"
    if world % 2 or (nodes > 1 and nodes % 2):
        return f"send/recv pairs need an even count of ranks and nodes ({world} ranks, {nodes} nodes)"
    return None


def describe(st: Strategy, other: Strategy | None = None) -> str:
    """A plan's degrees in a few words: ``tp2 × dp2 ZeRO-1, mb 4×2``; where ``other``'s words
    are the same, the knobs that differ from it too (``pp2, mb 1×4 (schedule 1f1b, …)``)."""
    axes = [f"{name}{n}" for name, n in (("pp", st.pp), ("dp", st.dp), ("cp", st.cp), ("tp", st.tp)) if n > 1]
    zero = f" ZeRO-{st.zero}" if st.dp > 1 and st.zero else ""
    words = f"{' × '.join(axes) or 'one rank'}{zero}, mb {st.micro_batch}×{st.micro_batches}"
    if other is None or other == st or describe(other) != words:
        return words
    mine, theirs = st.to_dict(), other.to_dict()
    differ = [f"{k} {mine[k]}" for k in mine if mine[k] != theirs.get(k)]
    return f"{words} ({', '.join(differ)})"


def strategy_key(st: Strategy) -> str:
    """A strategy as a key (its JSON, sorted)."""
    return json.dumps(st.to_dict(), sort_keys=True)


def verdict(
    config: AdaptConfig,
    *,
    same: bool,
    switched: int,
    pressure: bool,
    left: bool,
    now_s: float,
    new_s: float,
    remaining: int,
    switch_s: float,
) -> tuple[str, str, str]:
    """(action, trigger, why) for a window whose re-plan is ``same`` as the running plan or not:
    ``switched`` switches made, a rank under memory ``pressure``, the new plan one ``left``
    earlier, both plans' steps on the calibrated cluster, ``remaining`` steps, a switch's cost.
    Memory first (a rank near its limit moves whatever the speed), then the payoff rule
    (``cost_models.switch``); a plan left is never returned to, and at most ``max_switches``."""
    if same:
        return "stay", "", f"the calibrated model plans it again ({now_s:.3g} s a step predicted)"
    if switched >= config.max_switches:
        return "stay", "", f"is preferred, but {switched} switches were made (AdaptConfig.max_switches)"
    if pressure:
        return "switch", "memory", f"a rank's peak passed {config.memory_limit:.0%} of its memory"
    if left:
        return "stay", "", "is preferred, but it was left earlier: not returned to"
    gain = switch_gain_s(now_s=now_s, new_s=new_s, remaining_steps=remaining, margin=config.margin)
    if switch_pays(
        now_s=now_s, new_s=new_s, remaining_steps=remaining, margin=config.margin, switch_s=switch_s
    ):
        return "switch", "time", ""
    return (
        "stay",
        "",
        (
            f"predicted {new_s:.3g} s a step against {now_s:.3g} s; with the {config.margin:.0%} margin it "
            f"saves {gain:.3g} s over {remaining} steps, a switch costs {switch_s:.3g} s"
        ),
    )


class Replanner:
    """Rank 0's planner for a run: the model's captures (made once, on a meta copy), the described
    cluster, the knobs every plan keeps; ``decide`` calibrates, re-plans and applies ``verdict``."""

    def __init__(
        self,
        model: nn.Module,
        cluster: Cluster,
        *,
        global_batch: int,
        seq: int,
        dtype: str,
        constraints: Constraints,
        config: AdaptConfig,
        profiles: ModelProfiles | None = None,
    ) -> None:
        """``model``: the planning copy (on the meta device: it is captured on fake tensors,
        never run); ``profiles``: its captures, if made already."""
        self.model, self.cluster, self.config = model, cluster, config
        self.global_batch, self.seq, self.dtype, self.constraints = global_batch, seq, dtype, constraints
        self.profiles = profiles or ModelProfiles.of(model, dtype=dtype, seq=seq)

    def pricer(self, cluster: Cluster) -> Pricer:
        """The model priced on ``cluster``."""
        return Pricer(self.profiles, cluster, dtype=self.dtype, reserve_bytes=self.constraints.reserve_bytes)

    def plan(self, cluster: Cluster | None = None, constraints: Constraints | None = None) -> Plan:
        """The best plan on ``cluster`` (default the described one) under ``constraints``."""
        request = PlanRequest(
            model=self.model,
            cluster=cluster or self.cluster,
            global_batch=self.global_batch,
            seq=self.seq,
            dtype=self.dtype,
            constraints=constraints or self.constraints,
        )
        return make_plan(request, self.profiles).plan

    def decide(self, running: Plan, window: Window) -> Decision:
        """Calibrate on ``window``, re-plan, and decide whether ``running`` gives way."""
        st = running.strategy
        measured = statistics.median(window.steps_s)
        cal = calibrate_cluster(self.cluster, self.pricer, st, step_s=measured, comm=window.comm)
        now_s = cal.calibrated_step_s
        reserve = memory_reserve(running, window.peaks, self.cluster.device.memory_bytes, self.config)
        keep = self.constraints if reserve is None else replace(self.constraints, reserve_bytes=reserve)
        facts: dict[str, Any] = {
            "step": window.step,
            "measured_s": measured,
            "now_s": now_s,
            "switch_s": window.switch_s,
            "compute_scale": cal.compute_scale,
        }
        try:
            new = self.plan(cal.cluster, keep)
        except InfeasibleError as e:
            why = "with the memory measured kept free, " if reserve is not None else ""
            text = f"step {window.step}: kept {describe(st)}: {why}no plan fits: {e}"
            return Decision(action="stay", trigger="", text=text, new_s=now_s, **facts)
        new_s = float(new.predicted["step_time_s"])
        action, trigger, why = verdict(
            self.config,
            same=new.strategy == st,
            switched=window.switched,
            pressure=reserve is not None,
            left=strategy_key(new.strategy) in window.left,
            now_s=now_s,
            new_s=new_s,
            remaining=window.remaining,
            switch_s=window.switch_s,
        )
        if action == "stay":
            other = "" if new.strategy == st else f"{describe(new.strategy, st)} "
            text = f"step {window.step}: kept {describe(st)}: {other}{why}"
            return Decision(action="stay", trigger="", text=text, new_s=new_s, **facts)
        faster = 1 - new_s / now_s
        text = (
            f"step {window.step}: switching {describe(st)} → {describe(new.strategy, st)}: "
            f"{cause(cal) if trigger == 'time' else why}; predicted {100 * abs(faster):.0f}% "
            f"{'faster' if faster >= 0 else 'slower'} ({now_s:.3g} → {new_s:.3g} s a step)"
        )
        return Decision(action="switch", trigger=trigger, text=text, plan=new.to_json(), new_s=new_s, **facts)


def memory_reserve(
    running: Plan, peaks: tuple[float, ...], capacity: float, config: AdaptConfig
) -> float | None:
    """None when every rank's peak is within ``memory_limit`` of ``capacity``; else the memory to
    keep free when re-planning: the most any rank used beyond what its stage was priced at (its
    predicted peak less the plan's reserve), plus the share of ``capacity`` above the limit."""
    if max(peaks) <= config.memory_limit * capacity:
        return None
    dims, memory = running.strategy.dims, running.predicted["memory"]
    by_stage = {m["stage"]: m for m in memory}
    unpriced = 0.0
    for rank, peak in enumerate(peaks):
        stage = by_stage.get(dims.coordinate(rank, "pp"), memory[0])
        unpriced = max(unpriced, peak - (stage["peak_bytes"] - stage["reserve"]))
    return unpriced + (1 - config.memory_limit) * capacity


def cause(cal: RunCalibration) -> str:
    """Why the calibrated model prefers another plan: the running plan's term whose price moved
    most, and the device's measured speed."""
    term, ratio = cal.worst_term()
    speed = f"compute {cal.compute_scale:.2g}× its price"
    if term in ("compute", "recompute", "optimizer", "bubble") or math.isclose(ratio, 1.0, rel_tol=0.05):
        return f"{speed} measured"
    times = f"{ratio:,.0f}" if ratio >= 10 else f"{ratio:.2g}"
    return f"{term} priced from the measured links {times}× its described price, {speed}"


__all__ = [
    "PROBE_MIN_BYTES",
    "AdaptConfig",
    "Decision",
    "Replanner",
    "Window",
    "cause",
    "describe",
    "memory_reserve",
    "probe_problem",
    "strategy_key",
    "verdict",
]
