"""``autopar.Adaptive``: a training run that measures itself, re-plans on what it measured, and
moves to the new plan in process when the move pays for itself.

    adaptive = autopar.Adaptive(build_model, cluster, steps=1000, global_batch=16, seq=1024)
    for step in range(steps):
        pm = adaptive.pm                         # read it every step: a switch replaces it
        loss = pm.train_step(dataset[batches.local(step, pm)])
        adaptive.step_done(step, loss)           # collective at the end of each window

Each window of ``AdaptConfig.every`` timed steps (after ``warmup`` untimed ones per placement):

1. measure: the window's median step (rank 0's ``last_step_s``: ``train_step`` ends on the
   loss's all-reduce, so it is the slowest rank's), every rank's peak memory, and — once per
   run — the links: the collectives the planner prices, timed on this world's groups
   (``measure.comm.measure_comm``, a short sweep: what ``autopar profile-comm`` measures);
2. calibrate: the described cluster with the measured links and the device's speed scaled so
   the running plan's priced step equals the measured one (``measure.calibrate.
   calibrate_cluster``: two physical quantities, nothing fitted per plan);
3. re-plan for the same world on the calibrated cluster (rank 0; the captures are reused);
4. decide (``cost_models.switch``): switch when the time saved over the steps left, the new
   plan's prediction taken ``margin`` too optimistic, exceeds the switch's cost (a placement as
   measured at the start plus the state written and read once; a switch's measured time once
   one has run). A rank whose peak passed ``memory_limit`` of its device re-plans with the
   memory the model did not price kept free, and switches to any plan that fits so. A plan
   left is never returned to, and at most ``max_switches`` happen: no flapping on noise.
5. act: rank 0's decision and plan are broadcast, every rank checks the plan's hash
   (``runtime.distributed.agree_on_plan``), and ``runtime.switch.switch_plan`` moves the state.

Every decision is a line on stderr (rank 0), an event in the metrics' sinks (JSONL, TensorBoard,
Prometheus) and ``autopar report --metrics``'s table, and is kept in ``decisions``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.adapt.policy import (
    PROBE_MIN_BYTES,
    AdaptConfig,
    Decision,
    Replanner,
    Window,
    describe,
    probe_problem,
    strategy_key,
    verdict,
)
from autopar.cluster import Cluster
from autopar.cost_models.switch import state_bytes, switch_time_s
from autopar.errors import AutoparError
from autopar.groups import MixedCluster
from autopar.measure.disk import CheckpointCost
from autopar.measurements import CommProfile
from autopar.monitor.metrics import Metrics, peak_memory_bytes
from autopar.plan import Plan
from autopar.request import Constraints
from autopar.runtime import ParallelModel, init_distributed
from autopar.runtime import parallelize as place
from autopar.runtime.distributed import from_rank0, slowest_s
from autopar.runtime.loss import LossFn
from autopar.runtime.switch import switch_plan


class Adaptive:
    """A run placed by a plan that re-plans on its own measurements (module doc). Construct and
    call on every rank, inside torchrun."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        start: Plan | Cluster,
        *,
        steps: int,
        global_batch: int | None = None,
        seq: int | None = None,
        config: AdaptConfig | None = None,
        constraints: Constraints | None = None,
        loss_fn: LossFn | None = None,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        optimizer_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        metrics: dict[str, Any] | None = None,
        peak_bytes: Callable[[], float] = peak_memory_bytes,
        on_switch: Callable[[ParallelModel], None] | None = None,
    ) -> None:
        """``build_model()`` builds the model (the same weights on every rank; called again at a
        switch, and on the meta device for rank 0's planning copy); ``start``: the first plan, or
        the cluster to plan for (``global_batch`` and ``seq`` then needed); ``steps``: the run's
        length (what a switch's gain is counted over); ``constraints``: knobs every plan keeps;
        ``metrics``: ``autopar.Metrics``' keyword arguments (its sinks also get the decisions);
        ``peak_bytes``: this rank's peak memory (default the allocator's peak, or RSS);
        ``on_switch(pm)``: called on every rank after a switch with the new ParallelModel (what
        holds the old optimizer, an LR scheduler, is rebuilt there)."""
        if isinstance(start, MixedCluster) or (isinstance(start, Plan) and "groups" in start.cluster):
            raise AutoparError(
                "Adaptive re-plans one type of node; train node groups with autopar.parallelize"
            )
        self.timeout_s = init_distributed(timeout_s)
        self.config = config or AdaptConfig()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        global_batch, seq = _checked(self.config, start, global_batch, seq)
        self.build_model, self.steps = build_model, steps
        self.peak_bytes, self.on_switch = peak_bytes, on_switch
        self.loss_fn, self.optimizer_cls, self.optimizer_kwargs = loss_fn, optimizer_cls, optimizer_kwargs
        cluster = start if isinstance(start, Cluster) else Cluster.from_dict(start.cluster)
        self.replanner: Replanner | None = None
        """Rank 0's planner (None on the other ranks)."""
        if self.rank == 0:
            self.replanner = _replanner(build_model, cluster, global_batch, seq, constraints, self.config)
        if isinstance(start, Cluster):  # rank 0 plans; every rank gets its plan
            start = Plan.from_json(from_rank0(lambda: self._rank0.plan().to_json()))
        began = time.perf_counter()
        self.pm: ParallelModel = self._place(build_model(), start)
        self.place_s = slowest_s(time.perf_counter() - began)
        """The first placement's time, the slowest rank's (a switch's estimate starts from it)."""
        self.metrics = Metrics(self.pm, **metrics) if metrics is not None else None
        self.decisions: list[Decision] = []
        self.windows: list[Window] = []
        """What each decision was made on (rank 0's measurements are the ones that count)."""
        self.comm: CommProfile | None = None
        """The links measured at the first window (a ``CommProfile``), None before."""
        self.disk: CheckpointCost | None = None
        """A checkpoint's save and load in the switch folder, measured at the first window."""
        self._left: set[str] = set()
        self._window: list[float] = []
        self._since = 0
        self._switch_s: float | None = None

    @property
    def _rank0(self) -> Replanner:
        assert self.replanner is not None, "rank 0 plans"
        return self.replanner

    # ---- the loop --------------------------------------------------------

    def step_done(self, step: int, loss: float) -> Decision | None:
        """Record step ``step`` (just trained by ``self.pm``, which returned ``loss``); at the end
        of a window calibrate, re-plan and decide (collective); returns the decision then."""
        if self.metrics is not None:
            self.metrics.step_done(step, loss)
        self._since += 1
        if self._since > self.config.warmup:
            self._window.append(self.pm.last_step_s)
        if len(self._window) < self.config.every or step + 1 >= self.steps:
            return None
        return self._window_done(step)

    @property
    def switches(self) -> list[Decision]:
        """The switches made so far."""
        return [d for d in self.decisions if d.action == "switch"]

    def close(self) -> None:
        """Close the metrics' sinks."""
        if self.metrics is not None:
            self.metrics.close()

    def _window_done(self, step: int) -> Decision:
        peaks: list[Any] = [None] * self.world
        dist.all_gather_object(peaks, float(self.peak_bytes()))
        if self.config.probe and self.disk is None:
            self._probe()
        window = Window(
            step=step,
            steps_s=tuple(self._window),
            peaks=tuple(peaks),
            remaining=self.steps - step - 1,
            switch_s=self._switch_s or self._switch_estimate_s(),
            switched=len(self.switches),
            left=frozenset(self._left),
            comm=self.comm,
        )
        self.windows.append(window)
        decision: Decision = from_rank0(lambda: self._rank0.decide(self.pm.plan, window))
        if decision.action == "switch":
            decision = self._switch(decision)
        self.decisions.append(decision)
        if self.rank == 0:
            print(f"autopar: {decision.text}", file=sys.stderr, flush=True)
        if self.metrics is not None:
            self.metrics.event(step, {"event": "adapt", **decision.event()})
        self._window = []
        return decision

    def _probe(self) -> None:
        """Measure the links (``measure.comm``, a short sweep) and a checkpoint's save and load
        in the switch folder (``measure.disk``)."""
        from autopar.measure.comm import measure_comm
        from autopar.measure.disk import checkpoint_cost

        problem = probe_problem(self.world, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        if problem is None:
            top = self.config.probe_max_bytes
            self.comm = measure_comm(min_bytes=PROBE_MIN_BYTES, max_bytes=top, repeat=3)
        elif self.rank == 0 and self.world > 1:
            print(f"autopar: links not probed ({problem}): their description is kept", file=sys.stderr)
        tensors = sum(len(part) for part in self.pm.state_dict().values() if isinstance(part, dict))
        self.disk = checkpoint_cost(self.config.folder or tempfile.gettempdir(), tensors=max(1, tensors))

    def _switch_estimate_s(self) -> float:
        """A first switch's cost: a placement as the first took, the state saved and loaded once
        as measured (a placement alone where nothing was measured)."""
        if self.disk is None:
            return self.place_s
        d = self.disk
        return switch_time_s(
            place_s=self.place_s,
            state_bytes=max(state_bytes(m) for m in self.pm.plan.predicted["memory"]),  # slowest rank
            save_latency_s=d.save_latency_s,
            save_s_per_byte=d.save_s_per_byte,
            load_latency_s=d.load_latency_s,
            load_s_per_byte=d.load_s_per_byte,
        )

    # ---- acting (every rank) ---------------------------------------------

    def _switch(self, decision: Decision) -> Decision:
        assert decision.plan is not None
        plan = Plan.from_json(decision.plan)
        old = self.pm.plan.strategy
        folder = from_rank0(lambda: self.config.folder or tempfile.mkdtemp(prefix="autopar-switch-"))
        began = time.perf_counter()
        where = Path(folder) / f"step-{decision.step}"
        self.pm = switch_plan(self.pm, self.build_model, plan, where, place=self._place)
        took = slowest_s(time.perf_counter() - began)
        if self.config.folder is None and self.rank == 0:
            os.rmdir(folder)
        self._left.add(strategy_key(old))
        self._switch_s, self._since = took, 0
        if self.metrics is not None:
            self.metrics.rebind(self.pm)
        if self.on_switch is not None:
            self.on_switch(self.pm)
        text = f"{decision.text}; the switch took {took:.3g} s (estimated {decision.switch_s:.3g} s)"
        return replace(decision, text=text, took_s=took)

    def _place(self, model: nn.Module, plan: Plan) -> ParallelModel:
        return place(
            model,
            plan,
            loss_fn=self.loss_fn,
            optimizer_cls=self.optimizer_cls,
            optimizer_kwargs=self.optimizer_kwargs,
            timeout_s=self.timeout_s,
        )


def _checked(
    config: AdaptConfig, start: Plan | Cluster, global_batch: int | None, seq: int | None
) -> tuple[int, int]:
    """The run's (global batch, seq); one line for what can't run: a run across nodes without a
    shared folder, a cluster to plan for without the batch's shape."""
    world = dist.get_world_size()
    if config.folder is None and int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise AutoparError(
            "this run spans nodes: give AdaptConfig(folder=...) on a file system every node reads "
            "(a switch moves the state through it)"
        )
    if isinstance(start, Plan):
        return start.strategy.global_batch, start.strategy.seq
    if global_batch is None or seq is None:
        raise AutoparError("Adaptive needs global_batch= and seq= to plan (or start from a Plan)")
    return global_batch, seq


def _replanner(
    build_model: Callable[[], nn.Module],
    cluster: Cluster,
    global_batch: int,
    seq: int,
    constraints: Constraints | None,
    config: AdaptConfig,
) -> Replanner:
    """Rank 0's planner, on a copy of the model built on the meta device (captured on fake
    tensors, never allocated)."""
    with torch.device("meta"):
        meta = build_model()
    dtype = "bf16" if next(meta.parameters()).dtype == torch.bfloat16 else "fp32"
    return Replanner(
        meta,
        cluster,
        global_batch=global_batch,
        seq=seq,
        dtype=dtype,
        constraints=constraints or Constraints(),
        config=config,
    )


__all__ = ["AdaptConfig", "Adaptive", "Decision", "Replanner", "Window", "describe", "verdict"]
