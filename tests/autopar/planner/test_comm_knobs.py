"""Communication knobs in the search: the gradient reduction's dtype (bf16 where it loses
nothing the plan keeps, lossy only when allowed), on a commodity Ethernet cluster and on DGX."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import AutoparError, Cluster, Constraints, PlanRequest
from autopar.cli import main
from autopar.cost_models.estimate import estimate
from autopar.planner import ModelProfiles, make_plan
from autopar.planner.comm_knobs import BUCKET_MBS
from autopar.planner.search import outer_strategies


def _request(
    dtype: str, *, lossy: bool = False, preset: str = "dgx-h100", nodes: int = 2, seq: int = 2048
) -> PlanRequest:
    return PlanRequest(
        model="llama3-8b",
        cluster=Cluster.preset(preset, nodes=nodes),
        global_batch=64,
        seq=seq,
        dtype=dtype,
        constraints=Constraints(allow_lossy_comm=lossy),
    )


def test_a_lossy_reduction_needs_the_users_consent() -> None:
    with pytest.raises(AutoparError, match="--allow-lossy-comm"):
        PlanRequest(
            model="llama3-8b",
            cluster=Cluster.preset("dgx-h100"),
            global_batch=8,
            seq=2048,
            dtype="fp32",
            constraints=Constraints(grad_reduce="bf16"),
        )


@pytest.mark.parametrize(
    ("dtype", "lossy"), [("fp32", False), ("fp16", False), ("fp32", True), ("bf16", False)]
)
def test_the_reductions_the_search_prices(dtype: str, lossy: bool) -> None:
    """bf16 reduction where it is lossless (a bf16 plan) or allowed; then bf16 alone on FSDP2
    (never slower: same compute and memory, half the bytes) and both on DDP (its hook's casts
    cost compute), with int8 too where lossy communication is allowed (always lossy); fp32
    alone at dp 1; never lossy without consent."""
    strategies = outer_strategies(_request(dtype, lossy=lossy), blocks=32, heads=32)
    half = dtype == "bf16" or lossy
    for st in strategies:
        if st.dp == 1 or not half:
            assert st.grad_reduce == "fp32", st
        elif not st.uses_ddp:
            assert st.grad_reduce == "bf16", st
    ddp = {st.grad_reduce for st in strategies if st.uses_ddp}
    assert ddp == ({"fp32", "bf16", "int8"} if lossy else {"fp32", "bf16"} if half else {"fp32"})
    assert any(st.lossy_comm for st in strategies) == lossy


@pytest.mark.slow
def test_ethernet_gets_bf16_reduction_and_it_is_faster() -> None:
    """Llama-3 8B on 4 nodes of 8 A100-PCIe on 25 GbE, bf16: the plan reduces gradients in bf16
    and is predicted faster than the same plan reducing in fp32. On DGX H100 an fp32 plan
    reduces in fp32 (bf16 would be lossy) in the plan and every runner-up."""
    request = _request("bf16", preset="a100-pcie-25gbe", nodes=4)
    profiles = ModelProfiles.of("llama3-8b", dtype="bf16", seq=2048)
    result = make_plan(request, profiles)
    st = result.plan.strategy
    assert st.dp > 1 and st.grad_reduce == "bf16"
    slower = estimate(profiles.at(st.micro_batch), request.cluster, replace(st, grad_reduce="fp32"))
    assert result.plan.predicted["step_time_s"] < slower.step_time_s
    assert "gradients reduced in bf16 (the precision of a bf16 plan)" in result.plan.text()
    fp32 = make_plan(_request("fp32"), ModelProfiles.of("llama3-8b", dtype="fp32", seq=2048))
    assert all(c.strategy.grad_reduce == "fp32" for c in fp32.alternatives)
    assert fp32.plan.strategy.grad_reduce == "fp32"


def test_cli_refuses_a_lossy_reduction_without_the_flag(capsys) -> None:
    argv = ["plan", "gpt2", "--cluster", "dgx-h100", "--global-batch", "16", "--dtype", "fp32"]
    assert main([*argv, "--grad-reduce", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allow-lossy-comm" in err
    assert main([*argv, "--grad-reduce", "bf16", "--allow-lossy-comm", "--dp", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as printed, wrapped at the terminal's width
    assert "gradients reduced in bf16 (lossy, allowed by --allow-lossy-comm)" in out


def test_the_hsdp_groups_the_search_prices() -> None:
    """HSDP only at ZeRO-2/3 where the DP axis leaves the node, with shard groups of one or two
    nodes' DP ranks; a fixed replica count where it divides dp, leaving groups of 2 or more."""
    strategies = outer_strategies(_request("bf16", nodes=4), blocks=32, heads=32)
    for st in strategies:
        if st.dp_replicate > 1:
            assert st.zero >= 2 and st.dp_shard * st.tp in (8, 16) and st.dp * st.tp > 8, st
    assert {st.dp_replicate for st in strategies if st.tp == 1 and st.pp == 1 and st.zero == 3} == {1, 2, 4}
    fixed = replace(_request("bf16", nodes=4), constraints=Constraints(dp_replicate=4, zero=3))
    assert {(st.dp_replicate, st.dp % 4) for st in outer_strategies(fixed, blocks=32, heads=32)} == {(4, 0)}


@pytest.mark.slow
def test_ethernet_fp32_weighs_hsdp_and_calls_a_close_race_a_tie() -> None:
    """Llama-3 8B in fp32 at seq 4096 on 4 nodes of 8 A100-PCIe on 25 GbE, no lossy knob allowed:
    ZeRO sharded within each node and replicated across nodes (HSDP) exposes less DP time than
    the same plan sharded over every DP rank, for the memory of 4 replicas. The planner weighs the
    two and, where they land within the chosen plan's held-out error band (they are 1% apart at
    the fitted constants), says they are tied rather than claiming a win."""
    request = _request("fp32", preset="a100-pcie-25gbe", nodes=4, seq=4096)
    profiles = ModelProfiles.of("llama3-8b", dtype="fp32", seq=4096)
    result = make_plan(request, profiles)
    found = [(result.plan.strategy, None), *((c.strategy, c) for c in result.alternatives)]
    hsdp, candidate = next((st, c) for st, c in found if st.dp_replicate > 1)
    assert hsdp.dp_shard * hsdp.tp == 8 and hsdp.grad_reduce == "fp32", hsdp
    prof = profiles.at(hsdp.micro_batch)
    shared, flat = (estimate(prof, request.cluster, replace(hsdp, dp_replicate=r)) for r in (4, 1))
    assert shared.breakdown_s["dp_comm"] < flat.breakdown_s["dp_comm"]
    if candidate is None:  # HSDP chosen: the plan says so
        assert (
            f"HSDP: {hsdp.dp_replicate} replicas of {hsdp.dp_shard}-rank shard groups" in result.plan.text()
        )
    else:  # a runner-up: tied where it is within the band
        row = result.plan.why["alternatives"][result.alternatives.index(candidate)]
        assert row["slower_by"] < 1.05 and row["tied"]  # a close race, and said to be one


def _gpt2_request(lossy: bool) -> PlanRequest:
    return PlanRequest(
        model="gpt2",
        cluster=Cluster.preset("a100-pcie-25gbe", nodes=4),
        global_batch=64,
        seq=1024,
        dtype="fp32",
        constraints=Constraints(allow_lossy_comm=lossy),
    )


def test_powersgd_only_with_consent_on_ddp_across_nodes() -> None:
    free = outer_strategies(_gpt2_request(False), blocks=12, heads=12)
    assert {st.powersgd_rank for st in free} == {0}
    lossy = outer_strategies(_gpt2_request(True), blocks=12, heads=12)
    compressed = [st for st in lossy if st.powersgd_rank]
    assert compressed and all(st.uses_ddp and st.grad_reduce == "fp32" and st.dp > 8 for st in compressed)


def test_ethernet_gets_powersgd_when_allowed_and_it_is_faster() -> None:
    """GPT-2 (124M) in fp32 on 4 × 8 A100-PCIe on 25 GbE with --allow-lossy-comm: DDP with PowerSGD
    at rank 4, predicted faster than the same plan without it; the plan says it is lossy."""
    request = _gpt2_request(True)
    profiles = ModelProfiles.of("gpt2", dtype="fp32", seq=1024)
    result = make_plan(request, profiles)
    st = result.plan.strategy
    assert st.powersgd_rank == 4 and st.uses_ddp, st
    plain = estimate(profiles.at(st.micro_batch), request.cluster, replace(st, powersgd_rank=0))
    assert result.plan.predicted["step_time_s"] < plain.step_time_s
    assert "PowerSGD at rank 4 (lossy, allowed by --allow-lossy-comm)" in result.plan.text()


def test_cli_powersgd_needs_the_flag_and_verify_refuses_it(capsys) -> None:
    argv = ["plan", "gpt2", "--cluster", "a100-pcie-25gbe", "--nodes", "4", "--global-batch", "64"]
    assert main([*argv, "--dtype", "fp32", "--powersgd-rank", "4"]) == 2
    assert "--allow-lossy-comm" in capsys.readouterr().err
    verify = [
        "verify",
        "gpt2",
        "--nproc",
        "2",
        "--dp",
        "2",
        "--zero",
        "0",
        "--global-batch",
        "4",
        "--seq",
        "64",
    ]
    assert main([*verify, "--powersgd-rank", "4", "--allow-lossy-comm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--powersgd-rank 0" in err


def test_the_bucket_sizes_the_search_prices() -> None:
    """DDP plans whose all-reduce leaves the node: torch's 25 MiB and 4× and 16× it; inside a node
    and on every plan not on DDP: 25 alone; a constraint fixes it on DDP plans only."""
    across = outer_strategies(_gpt2_request(False), blocks=12, heads=12)
    buckets = {st.bucket_mb for st in across if st.uses_ddp and st.dp > 8}
    assert buckets == set(BUCKET_MBS) == {25.0, 100.0, 400.0}
    assert {st.bucket_mb for st in across if not (st.uses_ddp and st.dp > 8)} == {25.0}
    one_node = replace(_gpt2_request(False), cluster=Cluster.preset("a100-pcie-25gbe", nodes=1))
    assert {st.bucket_mb for st in outer_strategies(one_node, blocks=12, heads=12)} == {25.0}
    fixed = replace(_gpt2_request(False), constraints=Constraints(bucket_mb=50))
    strategies = outer_strategies(fixed, blocks=12, heads=12)
    assert {st.bucket_mb for st in strategies if st.uses_ddp} == {50}
    assert {st.bucket_mb for st in strategies if not st.uses_ddp} == {25.0}


def test_ddp_across_dgx_nodes_gets_the_fastest_bucket_size() -> None:
    """GPT-2 as DDP over 4 DGX-H100 nodes: bandwidth-bound (its 0.5 GB of fp32 gradients take
    longer to all-reduce than backward), so fewer buckets pay fewer latencies; the plan's cap is
    the fastest of the three priced, faster than torch's default, and the plan says it."""
    request = PlanRequest(
        model="gpt2",
        cluster=Cluster.preset("dgx-h100", nodes=4),
        global_batch=64,
        seq=1024,
        dtype="bf16",
        constraints=Constraints(tp=1, pp=1, zero=0, grad_reduce="fp32"),
    )
    profiles = ModelProfiles.of("gpt2", dtype="bf16", seq=1024)
    result = make_plan(request, profiles)
    st = result.plan.strategy
    times = {
        b: estimate(profiles.at(st.micro_batch), request.cluster, replace(st, bucket_mb=b)).step_time_s
        for b in BUCKET_MBS
    }
    assert st.bucket_mb == min(times, key=times.__getitem__) != 25.0, times
    assert result.plan.predicted["step_time_s"] == pytest.approx(times[st.bucket_mb])
    assert times[st.bucket_mb] < times[25.0]
    assert f"DDP buckets of {st.bucket_mb:g} MiB" in result.plan.text()
