"""``autopar dryrun`` at small scale: a simulated rank's memory equals the same rank's in a real
gloo run of the plan (the same storage counter on both), a broken plan fails in one line, and
the rank roles and refusals."""

from __future__ import annotations

import json

import pytest
import torch

from autopar.measure.dryrun import dry_run, measure_step, rank_roles
from autopar.zoo import GPT, GPTConfig
from tests.conftest import plan_for

SEQ, BATCH = 16, 8


def make_gpt(layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, n_embd=64, n_head=4, vocab_size=64, block_size=SEQ))


def _plan(**knobs):
    return plan_for(make_gpt, batch=BATCH, seq=SEQ, micro_batch=1, tp_objective="memory", **knobs)


def real_worker(rank: int, world: int, init: str, plan_json: str, out: str) -> None:
    """A real gloo rank: two steps of the plan on real tensors, the second measured as a dry run
    of two steps measures its simulated one; rank 0 writes the figures."""
    import datetime

    import torch.distributed as dist

    import autopar
    from autopar.plan import Plan

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        plan = Plan.from_json(plan_json)
        pm = autopar.parallelize(make_gpt(), plan)
        batch = torch.randint(0, 2, (BATCH // plan.strategy.dp, SEQ))
        pm.backward(batch)
        pm.step()
        found = measure_step(pm, batch, plan, rank)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(found.to_dict(), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a 4-rank process group
def test_simulated_rank_measures_what_the_real_rank_holds(tmp_path) -> None:
    from autopar.measure.launch import launch

    plans = [
        _plan(tp=2, pp=1, dp=2, zero=3),
        _plan(tp=1, pp=1, dp=4, zero=2, dp_replicate=2),
        _plan(tp=2, pp=2, dp=1, zero=0, sequence_parallel=True, schedule="1f1b"),
    ]
    for i, plan in enumerate(plans):
        out = tmp_path / f"real{i}.json"
        launch(
            real_worker, args=(4, f"file://{tmp_path}/init{i}", plan.to_json(), str(out)), nprocs=4, join=True
        )
        real = json.loads(out.read_text())
        simulated, first = dry_run(make_gpt, plan, 0, steps=2), dry_run(make_gpt, plan, 0)
        assert simulated.ok, simulated.failure
        # the default: the optimizer's state made without a step, the first step measured. It holds
        # what the second does, plus what a pipeline allocates once and keeps (its receive buffers)
        assert first.optimizer_bytes == real["optimizer_bytes"]
        assert simulated.peak_bytes <= first.peak_bytes <= 1.02 * simulated.peak_bytes
        head = plan.text().splitlines()[0]
        print(f"{head}: simulated peak {simulated.peak_bytes:,.0f} B, real {real['peak_bytes']:,.0f} B")
        assert simulated.peak_bytes == pytest.approx(real["peak_bytes"], rel=0.01)
        assert simulated.parameter_bytes == real["parameter_bytes"]
        assert simulated.optimizer_bytes == real["optimizer_bytes"]
        counted = {k: tuple(v.values()) for k, v in real["collectives"].items()}
        agreement = [k for k, v in counted.items() if k.startswith("allgather over") and v == (1, 8.0 * 4)]
        assert len(agreement) == 1  # agree_on_batch's all-gather of 4 sizes: skipped when simulated
        del counted[agreement[0]]
        assert counted == simulated.collectives


def test_a_simulated_step_counts_what_zero3_gathers() -> None:
    """ZeRO-3 × TP2 on 4 ranks simulated here: every FSDP unit gathered in forward and again in
    backward per micro-batch, reduce-scattered once per micro-batch (no processes started)."""
    plan = _plan(tp=2, pp=1, dp=2, zero=3)
    run = dry_run(make_gpt, plan, 0)
    assert run.ok, run.failure
    assert 0 < run.seconds < 120  # this rank's wall time, not a clock reading
    units, micro = 4 + 1, plan.strategy.micro_batches  # blocks, then the root
    assert run.collectives["allgather_base over dp"][0] == 2 * units * micro
    assert run.collectives["reduce_scatter_base over dp"][0] == units * micro
    # the cost model prices a gather and a reduce-scatter per unit (``RankLoad.zero_units``), as
    # many as the program issues: the blocks and one root holding the embedding and the head
    from autopar.cost_models.rank_load import edge_units

    st = plan.strategy
    assert sum(st.blocks_per_rank(4)[0]) + edge_units(st, 0) == units
    # and the bytes: each gather is handed the rank's shard, which is the cost model's ZeRO-3
    # weights per GPU; each reduce-scatter the whole gradient (dp × the shard, fp32 here); equal
    # but for FSDP2's padding of the shards
    shard = plan.predicted["memory"][0]["weights"]
    assert run.collectives["allgather_base over dp"][1] == pytest.approx(2 * micro * shard, rel=0.01)
    assert run.collectives["reduce_scatter_base over dp"][1] == pytest.approx(micro * st.dp * shard, rel=0.01)
    assert 0 < run.parameter_bytes < run.peak_bytes
    assert run.optimizer_bytes == pytest.approx(2 * run.parameter_bytes, rel=0.01)  # Adam's m, v (and steps)


def test_a_simulated_step_issues_the_tp_collectives_the_cost_model_priced() -> None:
    """TP2 with sequence parallelism: the all-gathers and reduce-scatters over tp of a simulated
    step are, call for call and byte for byte, the per-operator layout's priced collectives
    (``TPLayer.collectives``, per sequence) × layers × micro-batches: the forward gathers before
    the column-parallel linears, their gathers again in backward (``regather_saved``), the
    reduce-scatters after the row-parallel ones and the conjugates. A gather is handed this rank's
    1/t of the tensor, a reduce-scatter all of it."""
    from autopar import Cluster
    from autopar.planner.tp_layouts import TPLayouts
    from tests.conftest import profiles_of

    plan = _plan(tp=2, pp=1, dp=2, zero=3, sequence_parallel=True)
    st = plan.strategy
    profiles = profiles_of(make_gpt, dtype="fp32", seq=SEQ)
    layout = TPLayouts(profiles, Cluster.preset("cpu", gpus_per_node=4), "fp32")(st)
    assert layout is not None
    per_type = {layer.type: 0 for layer in profiles.captured(1).layers}
    for layer in profiles.captured(1).layers:
        per_type[layer.type] += 1
    seqs = st.micro_batch * st.micro_batches  # every layer runs once per micro-batch
    priced = {}
    for kind, share in (("all_gather", 1 / st.tp), ("reduce_scatter", 1.0)):
        calls = [(n, b) for name, n in per_type.items() for k, _, b in layout[name].collectives if k == kind]
        priced[kind] = (
            sum(n for n, _ in calls) * st.micro_batches,
            sum(n * b for n, b in calls) * seqs * share,
        )
    run = dry_run(make_gpt, plan, 0)
    assert run.ok, run.failure
    assert run.collectives["all_gather_into_tensor over tp"] == priced["all_gather"]
    assert run.collectives["reduce_scatter_tensor over tp"] == priced["reduce_scatter"]
    # 2 forward gathers, 2 regathers, 2 conjugates and the fused bias's per block: 7 per block
    assert priced["all_gather"][0] >= 7 * per_type["Block"] * st.micro_batches


def test_a_broken_plan_fails_in_one_line() -> None:
    plan = _plan(tp=2, pp=1, dp=2, zero=3)  # a plan for 4 blocks applied to a model of 2
    run = dry_run(lambda: make_gpt(2), plan, 0)
    assert not run.ok and "\n" not in run.failure
    assert run.failure.startswith("applying the plan"), run.failure


def test_pipeline_roles_step_under_every_schedule_shape() -> None:
    """The first and last pipeline rank of 1F1B, interleaved (ZeRO-2 over dp 2) and a V (both
    edges on rank 0): each sends and receives every micro-batch's activations and gradients."""
    plans = [
        _plan(tp=1, pp=2, dp=1, zero=0, schedule="1f1b"),
        _plan(tp=1, pp=2, dp=2, zero=2, schedule="interleaved", virtual_stages=2),
        _plan(tp=1, pp=2, dp=1, zero=0, schedule="zbv", virtual_stages=2),
    ]
    assert [r for r, _ in rank_roles(plans[1])] == [0, 2]
    assert rank_roles(plans[1])[0][1] == "pp 0 of 2 (embedding), dp 0, tp 0"
    assert rank_roles(plans[2])[0][1] == "pp 0 of 2 (embedding and head), dp 0, tp 0"
    for plan in plans:
        st = plan.strategy
        hops = st.micro_batches * (st.virtual_stages if st.schedule == "interleaved" else 1)
        for rank, role in rank_roles(plan):
            run = dry_run(make_gpt, plan, rank)
            assert run.ok, (role, run.failure)
            sends = run.collectives["send over pp"][0]
            assert sends == run.collectives["recv over pp"][0] >= hops, (plan.strategy.schedule, role)


def test_predictions_count_deferred_weight_gradients_and_the_tied_head() -> None:
    """The last rank of an interleaved zero-bubble pipeline keeps each chunk's weight-op
    gradients from its I to its W (``memory.deferred_grad_bytes``), and holds its own copy of the
    tied embedding: its dry-run peak within 10% of the prediction (it was 1.20× before the model
    counted either; 1F1B's same rank is at 1.04×), and the copy's bytes counted exactly."""
    plan = _plan(tp=1, pp=2, dp=1, zero=0, schedule="interleaved-zb")
    rank, _ = rank_roles(plan)[-1]
    run = dry_run(make_gpt, plan, rank)
    assert run.ok, run.failure
    assert run.parameter_bytes == run.predicted["weights"]
    assert 0.95 < run.peak_bytes / run.predicted_peak_bytes < 1.10


def test_zero_bubble_holds_no_gradient_per_micro_batch() -> None:
    """32 micro-batches over PP4 × v2 (8 blocks): torch's receive buffers, one per micro-batch
    (``memory.pipeline_buffer_bytes``), are priced, and the input gradient torch's split backward
    leaves on each of them is dropped (``runtime.schedules.drop_input_grads``): the middle rank
    within 5% of its prediction (1.37× with neither, 1.11× with the buffers priced alone)."""

    def make() -> torch.nn.Module:
        return make_gpt(layers=8)

    plan = plan_for(
        make, batch=32, seq=SEQ, micro_batch=1, tp=1, pp=4, dp=1, schedule="interleaved-zb", virtual_stages=2
    )
    rank, _ = rank_roles(plan)[1]
    run = dry_run(make, plan, rank)
    assert run.ok, run.failure
    assert 0.95 < run.peak_bytes / run.predicted_peak_bytes < 1.05


def test_ddp_is_refused() -> None:
    assert "DDP" in dry_run(make_gpt, _plan(tp=1, pp=1, dp=2, zero=1), 0).failure


def test_cli_runs_plans_and_refuses_in_one_line(capsys) -> None:
    from pathlib import Path

    from autopar.cli import main

    spec = f"{Path(__file__).resolve()}:make_gpt"
    common = [spec, "--cluster", "cpu", "--nodes", "2", "--global-batch", "8", "--seq", str(SEQ)]
    fixed = ["--micro-batch", "1", "--recompute", "none", "--dtype", "fp32"]
    assert main(["dryrun", *common, *fixed, "--tp", "2", "--dp", "2", "--zero", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (rank,) = out["ranks"]
    assert rank["failure"] == "" and rank["peak_bytes"] > rank["parameter_bytes"] > 0
    assert main(["dryrun", *common, *fixed, "--pp", "1", "--dp", "4", "--tp", "1", "--zero", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "a DDP plan" in err, err
    assert main(["dryrun", *common, *fixed, "--tp", "2", "--dp", "2", "--zero", "3", "--ranks", "9"]) == 2
    assert "the plan's ranks are 0…3" in capsys.readouterr().err


def test_expert_parallel_rank_routes_evenly() -> None:
    """EP2 over dp 2 (the zoo's Mixtral, 2 MoE layers): a simulated rank has no peer's counts,
    so every expert takes an even share (what ``expert_skew`` 1 prices); per micro-batch and MoE
    layer it runs the count exchange and two row exchanges forward, two backward."""
    from tests.autopar.runtime.test_expert_parallel import SEQ as EP_SEQ
    from tests.autopar.runtime.test_expert_parallel import zoo_mixtral

    plan = plan_for(zoo_mixtral, batch=4, seq=EP_SEQ, tp=1, pp=1, dp=2, ep=2, zero=1, micro_batch=1)
    run = dry_run(zoo_mixtral, plan, 0)
    assert run.ok, run.failure
    assert run.collectives["all_to_all_single over ep"][0] == plan.strategy.micro_batches * 2 * 5


def test_plan_check_dry_runs_the_plan(capsys) -> None:
    """``autopar plan --check``: each distinct rank dry-run, its need with the reserve against
    the memory the plan had; a rank that does not fit or fails is one line, exit 2."""
    from pathlib import Path

    from autopar.cli import main
    from autopar.cli.dryrun import check_verdict

    spec = f"{Path(__file__).resolve()}:make_gpt"
    argv = ["plan", spec, "--cluster", "cpu", "--nodes", "2", "--global-batch", "8", "--seq", str(SEQ)]
    fixed = [
        "--tp",
        "2",
        "--dp",
        "2",
        "--zero",
        "3",
        "--micro-batch",
        "1",
        "--dtype",
        "fp32",
        "--recompute",
        "none",
    ]
    assert main([*argv, *fixed, "--check", "--json"]) == 0
    (tried,) = json.loads(capsys.readouterr().out)["check"]
    assert tried["runner_up"] == 0 and tried["verdict"] == ""
    (checked,) = tried["ranks"]
    assert checked["fits"] and checked["needs_bytes"] > checked["peak_bytes"] > 0
    over = {**checked, "fits": False, "needs_bytes": 2.0**40}
    line = check_verdict([checked, over], capacity=2.0**33)
    assert (
        line.startswith("the plan's dry run: rank 0 (pp 0 of 1")
        and "1.0 TiB with the reserve, over the 8.0 GiB" in line
    )
    assert check_verdict([checked], capacity=2.0**33) == ""


def test_plan_check_falls_back_to_a_runner_up_that_passes(capsys, monkeypatch, tmp_path) -> None:
    """``autopar plan --check K``: when the chosen plan's dry run fails, its runners-up are planned
    with their knobs pinned and dry-run in order; the first that passes is the plan printed and
    written. With none left that passes: one line, exit 2, and nothing written."""
    from pathlib import Path

    import autopar.cli.dryrun as cli_dryrun
    from autopar.cli import main
    from autopar.plan import Plan

    real, calls = cli_dryrun.check, []

    def first_fails(args, plan):  # the chosen plan's ranks "do not fit"; the others as dry-run
        ranks = real(args, plan)
        calls.append(plan.hash)
        return [{**r, "fits": False, "needs_bytes": 2.0**50} for r in ranks] if len(calls) == 1 else ranks

    monkeypatch.setattr(cli_dryrun, "check", first_fails)
    spec = f"{Path(__file__).resolve()}:make_gpt"
    argv = ["plan", spec, "--cluster", "cpu", "--nodes", "2", "--global-batch", "8", "--seq", str(SEQ)]
    fixed = ["--tp", "2", "--dp", "2", "--zero", "3", "--dtype", "fp32"]
    out = tmp_path / "plan.json"
    assert main([*argv, *fixed, "--check", "2", "--json", "--out", str(out)]) == 0
    first, second = json.loads(capsys.readouterr().out)["check"]
    assert first["runner_up"] == 0 and "with the reserve, over the" in first["verdict"]
    assert second["runner_up"] == 1 and second["verdict"] == ""
    written = Plan.from_json(out.read_text())
    assert written.hash == second["hash"] != first["hash"]
    # K = 1: the chosen plan fails and nothing else is tried
    calls.clear()
    other = tmp_path / "none.json"
    assert main([*argv, *fixed, "--check", "--out", str(other)]) == 2
    assert "with the reserve, over the" in capsys.readouterr().err and not other.exists()


def test_per_operator_recompute_runs_off_zero_bubble_and_is_refused_on_it() -> None:
    """torch's selective activation checkpointing replays a block's saved outputs once, and a
    zero-bubble schedule runs backward twice over each block (input, then weight gradients):
    "Trying to backward an extra time" on every rank of such a plan (Llama 3 405B's ZB plan
    carried one sac1 block per stage). Under 1F1B a policy plan dry-runs; a zero-bubble plan may
    not carry policies, and asking for one with policies only is one line."""
    from dataclasses import replace

    from autopar.errors import AutoparError, StrategyError
    from autopar.strategy import check_strategy

    sac = plan_for(make_gpt, batch=BATCH, seq=SEQ, micro_batch=1, tp=1, pp=2, dp=1, recompute=("sac",))
    assert sac.strategy.policies and all(s.recompute_summary.startswith("2 sac") for s in sac.stages)
    for rank, role in rank_roles(sac):
        run = dry_run(make_gpt, sac, rank)
        assert run.ok, (role, run.failure)
    zbv = replace(sac.strategy, schedule="zbv", virtual_stages=2, layout=())
    with pytest.raises(StrategyError, match="zbv cannot run per-operator recompute policies"):
        check_strategy(zbv, world_size=2, blocks=4, heads=4)
    with pytest.raises(AutoparError, match="--schedule zbv cannot run per-operator recompute policies"):
        plan_for(make_gpt, batch=BATCH, seq=SEQ, micro_batch=1, pp=2, schedule="zbv", recompute=("sac",))
    zb = plan_for(
        make_gpt, batch=BATCH, seq=SEQ, micro_batch=1, pp=2, schedule="zbv", recompute=("sac", "full")
    )
    assert not zb.strategy.policies and all(s.recompute_summary == "2 full" for s in zb.stages)


def test_a_simulated_cp_rank_gathers_the_keys_and_values_the_cost_model_priced() -> None:
    """cp 2 × dp 2 at ZeRO-3 on a tiny Llama (2 key/value heads for 4 query heads), simulated:
    per block and micro-batch one all-gather of K and one of V over cp, handed this rank's half,
    and their reduce-scatters in backward, handed the whole — the bytes
    ``cost_models.context.kv_gathered_bytes`` prices at the keys' width before the repeat."""
    from autopar.cost_models.context import kv_gathered_bytes
    from autopar.zoo import Llama, LlamaConfig
    from tests.conftest import profiles_of

    cfg = LlamaConfig(n_layer=2, dim=48, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=80, max_seq_len=64)

    def make_llama() -> torch.nn.Module:
        torch.manual_seed(0)
        return Llama(cfg)

    seq = 40  # 10 positions a chunk: no dim of the model is 20 long
    plan = plan_for(make_llama, batch=BATCH, seq=seq, gpus=4, cp=2, dp=2, zero=3, micro_batch=1)
    st = plan.strategy
    run = dry_run(make_llama, plan, 0)
    assert run.ok, run.failure
    calls = 2 * cfg.n_layer * st.micro_batches  # K and V per block per micro-batch
    whole = kv_gathered_bytes(profiles_of(make_llama, dtype="fp32", seq=seq).at(1), st) * st.micro_batches
    assert whole == 2 * st.micro_batches * seq * 2 * 12 * 4  # b·s·(2 heads × 12) per K, V in fp32
    assert run.collectives["all_gather_into_tensor over cp"] == (calls, whole * cfg.n_layer / st.cp)
    assert run.collectives["reduce_scatter_tensor over cp"] == (calls, whole * cfg.n_layer)
