"""What ``autopar.Adaptive`` decides, without processes: the cluster calibrated on a measured step
(links and device speed, nothing per plan), the decision rule, a run whose plan is already right
kept through noisy timings (no flapping), a measured link far slower than described switching
away from a communication-heavy plan, and a rank near its memory re-planning with what the
model did not price kept free."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from autopar.adapt.policy import (
    AdaptConfig,
    Replanner,
    Window,
    memory_reserve,
    probe_problem,
    strategy_key,
    verdict,
)
from autopar.cluster import Cluster, LinkSpec
from autopar.errors import AutoparError
from autopar.measure.calibrate import COMM_TERMS, calibrate_cluster
from autopar.measurements import CollectiveFit, CommProfile
from autopar.plan import Plan
from autopar.request import Constraints
from autopar.zoo import GPT, GPTConfig
from tests.conftest import profiles_of

BATCH, SEQ = 4, 32
FAST = LinkSpec(bandwidth_bytes_per_s=200e9, latency_s=1e-6)


def _gpt() -> torch.nn.Module:
    """Wide for its tokens: ZeRO-3's gathers outweigh its compute on slow links."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=256, block_size=SEQ))


def _replanner(cluster: Cluster, **config: object) -> Replanner:
    with torch.device("meta"):
        meta = _gpt()
    return Replanner(
        meta,
        cluster,
        global_batch=BATCH,
        seq=SEQ,
        dtype="fp32",
        constraints=Constraints(),
        config=AdaptConfig(**config),  # type: ignore[arg-type]
        profiles=profiles_of(_gpt, dtype="fp32", seq=SEQ),
    )


def _slow_links(latency_s: float = 1e-3, bandwidth: float = 0.2e9) -> CommProfile:
    """Gloo-like collectives on 2 ranks: 1 ms and 200 MB/s each (a CommProfile as profile-comm writes)."""
    sizes = (65536, 1048576)
    fits = tuple(
        CollectiveFit(
            collective=name,
            group_size=2,
            crosses_nodes=False,
            latency_s=latency_s,
            seconds_per_byte=1 / bandwidth,
            sizes_bytes=sizes,
            times_s=tuple(latency_s + s / bandwidth for s in sizes),
        )
        for name in (
            "all_gather",
            "all_reduce",
            "all_reduce_bf16",
            "reduce_scatter",
            "reduce_scatter_bf16",
            "send_recv",
        )
    )
    return CommProfile(
        backend="gloo",
        device="cpu",
        world_size=2,
        gpus_per_node=2,
        torch_version=torch.__version__,
        fits=fits,
        overlap=0.0,
    )


def _window(
    step_s: float, *, peaks: tuple[float, ...] = (1e8, 1e8), comm: CommProfile | None = None, **kw: object
) -> Window:
    args = {
        "step": 9,
        "steps_s": (step_s,) * 5,
        "peaks": peaks,
        "remaining": 1000,
        "switch_s": 1.0,
        "comm": comm,
    }
    return Window(**{**args, **kw})  # type: ignore[arg-type]


def test_config_refuses_a_bad_value_in_one_line() -> None:
    with pytest.raises(AutoparError, match=r"AdaptConfig.margin=1.5: give a fraction in \[0, 1\)"):
        AdaptConfig(margin=1.5)
    with pytest.raises(AutoparError, match=r"AdaptConfig\.every=0"):
        AdaptConfig(every=0)


def test_calibrated_cluster_prices_the_running_plan_at_the_measured_step() -> None:
    rp = _replanner(Cluster.preset("cpu"))
    plan = rp.plan()
    links = _slow_links()
    linked = rp.pricer(rp.cluster.from_profile(comm=links)).estimate(plan.strategy).breakdown_s
    comm = sum(linked[k] for k in COMM_TERMS)
    compute = sum(v for k, v in linked.items() if k not in COMM_TERMS)
    for measured in (comm + 0.5 * compute, comm + 3.0 * compute):
        cal = calibrate_cluster(rp.cluster, rp.pricer, plan.strategy, step_s=measured, comm=links)
        assert sum(cal.calibrated_s.values()) == pytest.approx(measured, rel=1e-6)
        assert cal.compute_scale == pytest.approx((measured - comm) / compute)
        # the links come from the measurement, the device's speed is scaled by κ, nothing else moves
        assert cal.cluster.comm_profile is links
        assert cal.cluster.device.peak_flops["fp32"] == pytest.approx(
            rp.cluster.device.peak_flops["fp32"] / cal.compute_scale
        )
        assert cal.cluster.device.memory_bytes == rp.cluster.device.memory_bytes
    # a step shorter than the priced communication: κ at its floor, compute 5% of the step
    short = calibrate_cluster(rp.cluster, rp.pricer, plan.strategy, step_s=0.5 * comm, comm=links)
    assert short.compute_scale == pytest.approx(0.05 * 0.5 * comm / compute)


def test_the_rule() -> None:
    cfg = AdaptConfig(margin=0.1, max_switches=2)
    common = {"now_s": 1.0, "new_s": 0.5, "remaining": 100, "switch_s": 5.0}
    assert verdict(cfg, same=True, switched=0, pressure=False, left=False, **common)[0] == "stay"
    assert verdict(cfg, same=False, switched=0, pressure=False, left=False, **common)[:2] == (
        "switch",
        "time",
    )
    assert (
        verdict(cfg, same=False, switched=2, pressure=True, left=False, **common)[0] == "stay"
    )  # max_switches
    assert (
        verdict(cfg, same=False, switched=0, pressure=False, left=True, **common)[0] == "stay"
    )  # never back
    assert verdict(cfg, same=False, switched=0, pressure=True, left=True, **common)[:2] == (
        "switch",
        "memory",
    )
    slower = {**common, "new_s": 1.2}
    assert verdict(cfg, same=False, switched=0, pressure=True, left=False, **slower)[:2] == (
        "switch",
        "memory",
    )
    assert verdict(cfg, same=False, switched=0, pressure=False, left=False, **slower)[0] == "stay"
    short = {**common, "remaining": 5}  # 5 · (1 − 0.55) = 2.25 s saved < 5 s
    stay = verdict(cfg, same=False, switched=0, pressure=False, left=False, **short)
    assert stay[0] == "stay" and "a switch costs 5 s" in stay[2]


def test_a_right_plan_is_kept_through_noisy_timings() -> None:
    """The run measures what its plan predicted, ±25% per window: the re-plan may find a plan
    within the noise, but the margin keeps the running one."""
    rp = _replanner(Cluster.preset("cpu"))
    plan = rp.plan()
    priced = plan.predicted["step_time_s"]
    noise = random.Random(0)
    for _ in range(6):
        steps = tuple(priced * noise.uniform(0.75, 1.25) for _ in range(5))
        decision = rp.decide(plan, _window(0.0, steps_s=steps))
        assert decision.action == "stay", decision.text


def test_links_far_slower_than_described_move_a_communication_heavy_plan() -> None:
    """Described with NVLink-class links, the planner picks ZeRO-3; the measured links are 1000×
    slower, and the calibrated model moves the run off it, naming the term that moved."""
    rp = _replanner(dataclasses.replace(Cluster.preset("cpu"), intra_node=FAST))
    plan = rp.plan()
    assert plan.strategy.zero == 3 and plan.strategy.dp == 2
    comm = _slow_links()
    measured = plan.predicted["step_time_s"] * 2.0
    decision = rp.decide(plan, _window(measured, comm=comm))
    assert decision.action == "switch" and decision.trigger == "time", decision.text
    assert "dp_comm priced from the measured links" in decision.text
    assert decision.new_s < decision.now_s / (1 + rp.config.margin)
    # a plan the run left earlier is never returned to, however good it looks
    assert decision.plan is not None
    target = Plan.from_json(decision.plan).strategy
    back = rp.decide(plan, _window(measured, comm=comm, left=frozenset({strategy_key(target)})))
    assert back.action == "stay" and "left earlier" in back.text, back.text


def test_a_rank_near_its_memory_replans_with_the_unpriced_memory_kept_free() -> None:
    cpu = Cluster.preset("cpu")
    rp = _replanner(cpu, memory_limit=0.9)
    plan = rp.plan(constraints=Constraints(zero=0, tp=1, pp=1))
    stage = plan.predicted["memory"][0]
    priced = stage["peak_bytes"] - stage["reserve"]
    capacity = cpu.device.memory_bytes
    assert memory_reserve(plan, (0.5 * capacity, 0.89 * capacity), capacity, rp.config) is None
    peaks = (0.5 * capacity, 0.95 * capacity)
    reserve = memory_reserve(plan, peaks, capacity, rp.config)
    assert reserve == pytest.approx(0.95 * capacity - priced + 0.1 * capacity)
    # the cpu rank's 10 GiB with ~10.5 GiB to keep free: no plan can fit, and the run is told so
    decision = rp.decide(plan, _window(plan.predicted["step_time_s"], peaks=peaks))
    assert decision.action == "stay" and "no plan fits" in decision.text


def test_memory_pressure_switches_to_a_leaner_plan_that_fits() -> None:
    """A device whose memory the running ZeRO-0 plan nearly fills (its priced peak 80% of it),
    with a rank measured at 95%: the re-plan keeps the 15% the model missed free, and ZeRO
    sharding of the optimizer state makes room."""
    cpu = Cluster.preset("cpu")
    rp0 = _replanner(cpu)
    plan = rp0.plan(constraints=Constraints(zero=0, tp=1, pp=1, dp=2, reserve_bytes=0.0))
    stage = plan.predicted["memory"][0]
    capacity = int(stage["peak_bytes"] / 0.8)
    small = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, memory_bytes=capacity))
    rp = _replanner(small, memory_limit=0.9)
    rp.constraints = Constraints(reserve_bytes=0.0)
    plan = rp.plan(constraints=Constraints(zero=0, tp=1, pp=1, dp=2, reserve_bytes=0.0))
    decision = rp.decide(
        plan, _window(plan.predicted["step_time_s"], peaks=(0.5 * capacity, 0.95 * capacity))
    )
    assert decision.action == "switch" and decision.trigger == "memory", decision.text
    assert decision.plan is not None
    new = Plan.from_json(decision.plan)
    kept = 0.95 * capacity - stage["peak_bytes"] + 0.1 * capacity
    assert max(m["peak_bytes"] for m in new.predicted["memory"]) <= capacity
    assert max(m["reserve"] for m in new.predicted["memory"]) == pytest.approx(kept)


def test_the_links_are_probed_only_where_ranks_pair_up() -> None:
    assert probe_problem(2, 2) is None and probe_problem(16, 8) is None and probe_problem(8, 8) is None
    assert "even count" in str(probe_problem(3, 3)) and "even count" in str(probe_problem(24, 8))
    assert probe_problem(1, 1) == "one rank has no links"


def test_node_groups_are_refused_in_one_line() -> None:
    """Adaptive re-plans on one type of node: a mixed cluster (or its plan) is refused before any
    process group is made."""
    from autopar.adapt import Adaptive
    from autopar.groups import MixedCluster

    one = Cluster.preset("cpu", gpus_per_node=1)
    mixed = MixedCluster(
        name="m",
        groups=(dataclasses.replace(one, name="a"), dataclasses.replace(one, name="b")),
        between=one.inter_node,
    )
    with pytest.raises(AutoparError, match="one type of node") as e:
        Adaptive(lambda: torch.nn.Linear(1, 1), mixed, steps=1, global_batch=2, seq=8)
    assert "\n" not in str(e.value)
