"""Pipeline-parallel and 3-D plans on gloo processes equal single-process training: PP2 and PP4
under GPipe, 1F1B and Interleaved1F1B, PP2×DP2 (ZeRO-3, recompute), PP2×TP2 (SP, selective
recompute), PP2×DP2×TP2 (8 processes), Hugging Face models, and a planner-made plan run
through ``autopar verify``. Each launch checks several plans; every plan also round-trips a
DCP checkpoint exactly."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch

import autopar
from autopar import Cluster, Constraints
from autopar.measure.verify import compare, run_reference, verify_runs
from autopar.plan import Plan
from autopar.runtime import lm_loss
from autopar.strategy import SHARDING
from autopar.zoo import GPT, GPTConfig, hf
from autopar.zoo.llama import Llama, LlamaConfig
from tests.conftest import default_init, plan_for

pytestmark = pytest.mark.slow  # process groups of 2, 4 and 8 ranks

STEPS, BATCH, SEQ = 2, 8, 16


def make_gpt4() -> torch.nn.Module:
    """4 blocks, tied embedding and head (their gradients add up across the pipeline)."""
    torch.manual_seed(0)
    return default_init(GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=64, block_size=SEQ)))


def make_gpt8() -> torch.nn.Module:
    """8 blocks, wide enough that the per-operator ILP shards them (Megatron) at tp 2."""
    torch.manual_seed(0)
    return default_init(GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, vocab_size=64, block_size=SEQ)))


def make_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layer=4, dim=256, n_head=8, n_kv_head=4, ffn_dim=512, vocab_size=64, max_seq_len=SEQ)
    return default_init(Llama(cfg))


_plan = functools.partial(plan_for, batch=BATCH, seq=SEQ)
"""The planner's plan with the given knobs fixed, for a one-node ``cpu`` cluster."""


def _run_and_check(
    make, plans: list[Plan], tmp_path, checkpoint: bool = True, hook=None
) -> list[tuple[float, float]]:
    """One launch for all ``plans``; each passes verify's verdict with its defaults (AdamW; fp32
    plans checked in float64, bf16 ones against a bf16-autocast single process; ``checkpoint``:
    each run also round-trips through DCP — a pipeline checkpoint's layout is the same for every
    schedule and degree, so the 4- and 8-process launches leave it to the 2-process ones)."""
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    verdicts = verify_runs(make, [(p, hook) for p in plans], data, str(tmp_path), checkpoint=checkpoint)
    figures = []
    for plan, v in zip(plans, verdicts, strict=True):
        st = plan.strategy
        name = f"PP{st.pp}×DP{st.dp}×TP{st.tp} {st.schedule} v{st.virtual_stages} ZeRO-{st.zero} {st.dtype}"
        gap, worst = v.max_grad_error, v.max_param_error
        print(f"{name}: gradient error {gap:.1e}, parameter error {worst:.1e}, losses {v.losses}")
        assert v.passed, (name, v.first_failure)
        figures.append((gap, worst))
    return figures


def _blocks_per_stage(plan: Plan) -> list[int]:
    return [len(s.recompute) for s in plan.stages]


def test_pp2_every_schedule(tmp_path) -> None:
    plans = [
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="gpipe"),
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="1f1b"),
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="interleaved", virtual_stages=2),
        _plan(make_gpt4, dtype="bf16", pp=2, dp=1, tp=1, schedule="1f1b"),  # autocast around the schedule
        # per-operator recompute policies on pipeline stages and on tensor-parallel blocks
        _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="1f1b", recompute=("sac",)),
        _plan(make_gpt4, pp=1, dp=1, tp=2, sequence_parallel=True, recompute=("sac",)),
    ]
    assert [p.strategy.schedule for p in plans][:4] == ["gpipe", "1f1b", "interleaved", "1f1b"]
    assert all(r.startswith("sac") for p in plans[4:] for r in p.recompute.values())
    _run_and_check(make_gpt4, plans, tmp_path)


def test_pp4_schedules_and_2d_layouts(tmp_path) -> None:
    plans = [
        _plan(make_gpt8, pp=4, dp=1, tp=1, schedule="gpipe"),
        _plan(make_gpt8, pp=4, dp=1, tp=1, schedule="1f1b"),
        _plan(make_gpt8, pp=4, dp=1, tp=1, schedule="interleaved", virtual_stages=2),
        _plan(make_gpt8, pp=2, dp=2, tp=1, zero=3, schedule="1f1b", recompute=("full",)),
        _plan(make_gpt8, pp=2, dp=1, tp=2, sequence_parallel=True, recompute=("selective",)),
    ]
    tp_plan = plans[-1]
    sharded = {k.split(":")[0]: n for k, n, _ in dict(tp_plan.tensor_parallel)["Block"] if n in SHARDING}
    assert sharded.get("attn.c_attn") == "column" and sharded.get("mlp.c_proj") == "row", sharded
    _run_and_check(make_gpt8, plans, tmp_path, checkpoint=False)


@contextlib.contextmanager
def expect_hsdp_mesh():
    """FSDP2 is handed the (replicate, shard) mesh: hybrid sharding, not one shard over dp."""
    import torch.distributed.fsdp as fsdp

    real = fsdp.fully_shard

    def checked(module, *, mesh, **kwargs):
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard"), mesh
        return real(module, mesh=mesh, **kwargs)

    fsdp.fully_shard = checked
    try:
        yield
    finally:
        fsdp.fully_shard = real


def test_hsdp_shards_in_groups_and_replicates_across(tmp_path) -> None:
    """DP4 as 2 replicas of 2-rank shard groups, ZeRO-3 with full recompute and ZeRO-2 reducing in
    bf16 (lossy on fp32: judged at bf16's bounds): equal to one process, the replicas identical
    (``replica_mismatch``), and the DCP checkpoint round-trips exactly."""
    plans = [
        _plan(make_gpt4, pp=1, dp=4, tp=1, zero=3, dp_replicate=2, recompute=("full",)),
        _plan(make_gpt4, pp=1, dp=4, tp=1, zero=2, dp_replicate=2, grad_reduce="bf16", allow_lossy_comm=True),
    ]
    assert [(p.strategy.dp_replicate, p.strategy.dp_shard) for p in plans] == [(2, 2), (2, 2)]
    assert "HSDP: 2 replicas of 2-rank shard groups" in plans[0].text()
    _run_and_check(make_gpt4, plans, tmp_path, hook=expect_hsdp_mesh)


def test_pp2_dp2_tp2_zero3_recompute_llama_eight_processes(tmp_path) -> None:
    """The one 8-process smoke test: the full 3-D mesh on Llama (GQA, RoPE); also ZBV on it, with
    ZeRO-2 (zero-bubble schedules refuse ZeRO-3)."""
    plan = _plan(
        make_llama, pp=2, dp=2, tp=2, zero=3, sequence_parallel=True, recompute=("full",), schedule="1f1b"
    )
    zbv = _plan(
        make_llama,
        pp=2,
        dp=2,
        tp=2,
        zero=2,
        micro_batch=1,
        sequence_parallel=True,
        recompute=("full",),
        schedule="zbv",
    )
    assert plan.mesh == (("pp", 2), ("dp", 2), ("tp", 2))
    sharded = {k.split(":")[0]: n for k, n, _ in plan.tensor_parallel[0][1] if n in SHARDING}
    assert sharded.get("attention.wq") == "column" and sharded.get("feed_forward.w2") == "row", sharded
    assert {r for s in plan.stages for _, r in s.recompute} == {"full"}
    _run_and_check(make_llama, [plan, zbv], tmp_path, checkpoint=False)


make_hf_gpt2 = functools.partial(hf.gpt2, layers=3, seq=SEQ)


def test_pp2_hugging_face_gpt2_uneven_stages(tmp_path) -> None:
    """3 blocks on 2 ranks: the planner's uneven split is what runs, under 1F1B and interleaved
    (4 chunks for 3 blocks: one chunk holds the embedding or the head alone)."""
    plans = [
        _plan(make_hf_gpt2, pp=2, dp=1, tp=1, schedule="1f1b"),
        _plan(make_hf_gpt2, pp=2, dp=1, tp=1, schedule="interleaved", virtual_stages=2),
    ]
    assert [sorted(_blocks_per_stage(p)) for p in plans] == [[1, 2], [1, 2]]
    chunks = [len(c) for s in plans[1].stages for c in s.chunks]
    assert sorted(chunks) == [1, 1, 1, 2], plans[1].text()  # the embedding or the head alone in one
    _run_and_check(make_hf_gpt2, plans, tmp_path)


def test_planner_made_plan_runs_through_verify(capsys, tmp_path) -> None:
    """``autopar.plan`` for a 4-process cpu cluster (pipeline fixed at 2, the rest planned),
    written to JSON and run exactly by ``autopar verify --plan`` on Hugging Face Llama."""
    from autopar.cli import main

    spec = "autopar.zoo.hf:llama"  # 2 blocks, GQA 4/2 heads, seq 32
    made = autopar.plan(
        spec,
        Cluster.preset("cpu", gpus_per_node=4),
        global_batch=8,
        seq_len=32,
        dtype="fp32",
        constraints=Constraints(pp=2),
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(made.to_json())
    args = [
        "verify",
        spec,
        "--nproc",
        "4",
        "--plan",
        str(plan_file),
        "--steps",
        "2",
    ]  # default flags: AdamW, checked in float64
    code = main([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report
    assert Plan.from_dict(report["plan"]) == made
    diffs = f"gradient error {report['max_grad_error']:.1e}, parameter error {report['max_param_error']:.1e}"
    print(f"verify of the planner's plan ({made.text().splitlines()[0]}): {diffs}")


def test_fp16_pipelines_are_refused_clearly() -> None:
    from autopar.errors import AutoparError
    from autopar.runtime import check_runnable

    plan = _plan(make_gpt4, pp=2, dp=1, tp=1)
    bad = Plan.from_dict({**plan.to_dict(), "strategy": {**plan.strategy.to_dict(), "dtype": "fp16"}})
    with pytest.raises(AutoparError, match="--dtype bf16"):
        check_runnable(bad)


def meta_worker(rank: int, world: int, init: str, plan_json: str, data: torch.Tensor, out: str) -> None:
    """Build the model with meta parameters, parallelize, load the reference weights, train."""
    import datetime

    import torch.distributed as dist

    from autopar.errors import AutoparError
    from autopar.measure.ranks import LR

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        plan = Plan.from_json(plan_json)
        with autopar.meta_parameters():
            model = make_llama()
        pm = autopar.parallelize(model, plan, optimizer_cls=torch.optim.SGD, optimizer_kwargs={"lr": LR})
        local = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for s in pm.stages for p in s.parameters()
        )
        st = plan.strategy
        rows = slice(pm.dp_rank * BATCH // st.dp, (pm.dp_rank + 1) * BATCH // st.dp)
        try:
            pm.train_step(data[0, rows])
            refused = ""
        except AutoparError as e:
            refused = str(e)
        pm.load_full_state_dict(make_llama().state_dict())
        losses = [pm.train_step(data[step, rows]) for step in range(STEPS)]
        evaluated = pm.eval_step(data[0, rows])  # forward-only schedule on the trained weights
        state = pm.full_state_dict()
        counts: list[int] = [0] * world
        dist.all_gather_object(counts, local)
        if rank == 0:
            result = {"losses": losses, "state": state, "local": counts, "refused": refused}
            result["eval"] = evaluated
            result["still_meta"] = all(p.is_meta for p in model.parameters())
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_meta_model_materialises_only_its_stages(tmp_path) -> None:
    """PP2×DP2 ZeRO-3 from meta parameters: each rank allocates its stage's shard only, training
    is refused until weights are loaded, then equals the single-process run."""
    from autopar.measure.launch import launch

    plan = _plan(make_llama, pp=2, dp=2, tp=1, zero=3, schedule="1f1b")
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    out = str(tmp_path / "meta.pt")
    launch(meta_worker, args=(4, f"file://{tmp_path}/init", plan.to_json(), data, out), nprocs=4, join=True)
    got = torch.load(out)
    total = sum(p.numel() for p in make_llama().parameters())
    assert got["still_meta"] and "load its weights first" in got["refused"]
    assert max(got["local"]) < 0.3 * total, (got["local"], total)  # about a quarter each
    reference = run_reference(make_llama, data, STEPS, optimizer="sgd")
    gap, worst = compare(reference, got)
    trained = make_llama()
    trained.load_state_dict(reference[1])
    with torch.no_grad():
        want = float(lm_loss(trained(data[0]), data[0]))
    assert abs(got["eval"] - want) <= 1e-5, (got["eval"], want)
    diffs = f"loss diff {gap:.1e}, param diff {worst:.1e}"
    print(f"meta → PP2×DP2 ZeRO-3: parameters per rank {got['local']} of {total}; {diffs}")
    assert gap <= 1e-5 and worst <= 1e-6


def save_worker(rank: int, world: int, init: str, plan_json: str, data: torch.Tensor, path: str) -> None:
    """Train one step under the plan and save a DCP checkpoint (and rank 0 the full weights)."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    try:
        pm = autopar.parallelize(make_gpt4(), Plan.from_json(plan_json))
        pm.train_step(data[0])
        dcp.save(pm.state_dict(), checkpoint_id=path)
        full = pm.full_state_dict()
        if rank == 0:
            torch.save(full, f"{path}.full.pt")
    finally:
        dist.destroy_process_group()


def test_pipeline_checkpoint_loads_into_the_plain_model(tmp_path) -> None:
    """The stages' DCP checkpoint names everything as the model does (tied weight under both of
    its names): a single process loads it into the unmodified model."""
    import torch.distributed.checkpoint as dcp

    from autopar.measure.launch import launch

    plan = _plan(make_gpt4, pp=2, dp=1, tp=1, schedule="1f1b")
    data = torch.randint(0, 64, (1, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "ckpt")
    launch(save_worker, args=(2, f"file://{tmp_path}/init", plan.to_json(), data, path), nprocs=2, join=True)
    model = make_gpt4()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    want = torch.load(f"{path}.full.pt")
    assert set(want) == set(model.state_dict())
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert not torch.equal(model.wte.weight, make_gpt4().wte.weight)  # the trained weights, not init
