"""The composed estimate: activations vs Korthikanti, bubbles, ranking, errors (published runs:
tests/benchmarks/test_published.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from autopar import Cluster, capture
from autopar.cli import main
from autopar.cost_models import comm, nccl
from autopar.cost_models.estimate import estimate, stage_layer_names
from autopar.cost_models.memory import layer_activation_bytes
from autopar.cost_models.profile import ModelProfile
from autopar.planner import ModelProfiles
from autopar.strategy import Strategy, StrategyError, check_strategy, even_split
from autopar.zoo import GPT, GPTConfig

S, B, H, A = 512, 2, 256, 8


@pytest.fixture(scope="module")
def megatron_small() -> ModelProfile:
    """A Megatron-2022-style GPT (masked softmax, dropout): what Korthikanti's formulas describe."""
    cfg = GPTConfig(
        n_layer=8, n_embd=H, n_head=A, vocab_size=1024, block_size=S, attention="math", dropout=0.1
    )
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    return ModelProfile.from_captured(capture(model, batch=B, seq=S))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("variant", ["tp", "sp", "selective", "selective+sp", "full", "full+sp"])
def test_activation_bytes_match_korthikanti(megatron_small: ModelProfile, t: int, variant: str) -> None:
    sbh = S * B * H
    sp = variant.endswith("sp") and t > 1
    recompute = (
        "selective" if variant.startswith("selective") else "full" if variant.startswith("full") else "none"
    )
    layer = megatron_small.layer_types["Block"]
    got = layer_activation_bytes(
        layer, tp=t, sp=sp, recompute=recompute, input_bytes=megatron_small.input_bytes
    )
    if recompute == "full":
        expected = 2 * sbh / (t if sp else 1)  # the layer input only
        extras = 0.0
    elif recompute == "selective":
        expected = 34 * sbh / t if sp else sbh * (10 + 24 / t)
        # LayerNorm mean/rstd, which Korthikanti omits: 2 norms × 2 × b·s in bf16 (CPU kernel)
        extras = 8 * S * B / (t if sp else 1)
    else:
        expected = sbh / t * (34 + 5 * A * S / H) if sp else sbh * (10 + 24 / t + 5 * A * S / (H * t))
        # + LayerNorm statistics + each block's bool causal-mask slice (s² bytes, split with heads)
        extras = 8 * S * B / (t if sp else 1) + S * S / t
    assert got == pytest.approx(expected + extras, rel=1e-9)


def test_pipeline_bubble_fraction(megatron_small: ModelProfile) -> None:
    cluster = Cluster.preset("dgx-h100", gpus_per_node=4)
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        st = Strategy(pp=4, micro_batch=B, global_batch=B * 8, seq=S, schedule=schedule, virtual_stages=v)
        est = estimate(megatron_small, cluster, st)
        b = est.breakdown_s
        per_mb = (b["compute"] + b["recompute"] + b["tp_comm"] + b["p2p"]) / st.micro_batches
        assert b["bubble"] / (st.micro_batches * per_mb) == pytest.approx((4 - 1) / (v * 8))


def test_stage_split_is_contiguous_and_balanced(megatron_small: ModelProfile) -> None:
    assert even_split(10, 4) == [2, 3, 3, 2]  # extras to the middle stages
    st = Strategy(pp=4, micro_batch=B, global_batch=8 * B, seq=S)
    names = stage_layer_names(megatron_small, st)
    assert [len(n) for n in names] == [1 + 2, 2, 2, 2 + 1]
    assert [x for n in names for x in n] == list(megatron_small.layer_names)
    laid = Strategy(
        pp=4, micro_batch=B, global_batch=8 * B, seq=S, layout=((1, 0, 0), (3, 0, 0), (2, 1, 0), (0, 0, 1))
    )
    assert [len(n) for n in stage_layer_names(megatron_small, laid)] == [2, 3, 3, 2]


def test_interleaved_chunks_follow_each_ranks_blocks(megatron_small: ModelProfile) -> None:
    """Interleaving with ranks of 3 and 5 of the 8 blocks: rank 0's chunks (0 and 2) hold 1 and 2
    (the embedding's is the lighter), rank 1's (1 and 3) hold 3 and 2 (the head's lighter)."""
    st = Strategy(
        pp=2,
        virtual_stages=2,
        schedule="interleaved",
        micro_batch=B,
        global_batch=4 * B,
        seq=S,
        layout=((3, 0, 0), (5, 0, 0)),
    )
    assert st.chunk_blocks(8) == [1, 3, 2, 2]
    names = stage_layer_names(megatron_small, st)
    blocks = list(megatron_small.layer_names[1:-1])
    assert names[0] == [megatron_small.layer_names[0], blocks[0], *blocks[4:6]]
    assert names[1] == [*blocks[1:4], *blocks[6:8], megatron_small.layer_names[-1]]
    est = estimate(megatron_small, Cluster.preset("dgx-a100-80g", nodes=1, gpus_per_node=2), st)
    assert est.stage_layers == tuple(tuple(n) for n in names)
    # Llama 3 405B's layout: 126 blocks on 16 ranks × 8 chunks, the first and last stage one block
    # lighter: chunks of one block, the embedding and the head alone in theirs
    big = Strategy(
        pp=16,
        virtual_stages=8,
        schedule="interleaved",
        micro_batch=1,
        global_batch=16,
        seq=S,
        layout=((7, 0, 0), *[(8, 0, 0)] * 14, (7, 0, 0)),
    )
    assert big.chunk_blocks(126) == [0] + [1] * 126 + [0]
    # a rank short of its chunks is refused with the numbers
    short = replace(st, virtual_stages=3, layout=((1, 0, 0), (7, 0, 0)))
    with pytest.raises(StrategyError, match="rank 0 holds 1 blocks but its 3 chunks need 2"):
        check_strategy(short, world_size=2, blocks=8, heads=A)


def test_dp_comm_crosses_nodes_and_3d_beats_pure_dp_without_zero() -> None:
    profile = ModelProfiles.of("gpt3-175b", dtype="bf16", seq=2048).at(1)
    cluster = Cluster.preset("dgx-a100-80g", nodes=64)  # 512 GPUs
    three_d = estimate(
        profile, cluster, Strategy(tp=8, pp=8, dp=8, global_batch=1536, seq=2048, recompute="full")
    )
    pure_dp = estimate(profile, cluster, Strategy(dp=512, global_batch=1536, seq=2048, recompute="full"))
    assert three_d.fits and not pure_dp.fits  # 16 B/param of 175B on every GPU
    assert any("spans nodes" in note for note in three_d.notes)
    # ZeRO-3 over 512 GPUs pays per-layer gathers across nodes; more sharding, more traffic
    zero3 = estimate(
        profile, cluster, Strategy(dp=512, zero=3, global_batch=1536, seq=2048, recompute="full")
    )
    assert zero3.fits and zero3.memory[0].weights == pytest.approx(2 * profile.total_params / 512)


def test_zero3_gathers_ride_the_nodes_nics_and_pay_ring_latency_at_scale() -> None:
    """ZeRO-3 over every GPU (8 per node in each group) gathers over all eight NICs of a node
    (NCCL's ring: 200 GB/s on DGX A100, not one NIC's 25), so GPT-3 175B on 768 and 1536 A100s
    keeps its compute busy: the DP time it exposes is under a tenth of the step (the FSDP paper
    measured over 173 TFLOP/s per GPU on 512: zhao-2023-fsdp in the corpus). Cut the network to
    one NIC's worth per node, as the old model priced every such ring, and the same plan at 1536
    GPUs spends more of its step exposing DP traffic than computing. Each gather's ring latency
    grows with the ranks (n − 1 hops): the exposed DP time grows from 768 to 1536 GPUs while the
    compute per micro-batch halves."""
    exposed = []
    for nodes, b in ((96, 2), (192, 1)):  # 768 and 1536 GPUs, global batch 1536
        cluster = Cluster.preset("dgx-a100-80g", nodes=nodes)
        st = Strategy(
            dp=cluster.world_size, zero=3, micro_batch=b, global_batch=1536, seq=2048, recompute="full"
        )
        profile = ModelProfiles.of("gpt3-175b", dtype="bf16", seq=2048).at(b)
        est = estimate(profile, cluster, st)
        assert est.fits and est.breakdown_s["dp_comm"] < 0.1 * est.step_time_s
        exposed.append(est.breakdown_s["dp_comm"])
        dp = comm.nccl_group(cluster, st.dims.axis("dp"))
        assert dp is not None and dp.bus_bytes_per_s == pytest.approx(200e9)
    assert exposed[1] > exposed[0]
    net = cluster.inter_node
    one_nic = replace(cluster, inter_node=replace(net, bandwidth_bytes_per_s=net.bandwidth_bytes_per_s / 8))
    starved = estimate(profile, one_nic, st)
    assert starved.breakdown_s["dp_comm"] > starved.breakdown_s["compute"]


def test_memory_breakdown_and_fit(megatron_small: ModelProfile) -> None:
    cluster = Cluster.preset("cpu", gpus_per_node=2)
    est = estimate(megatron_small, cluster, Strategy(dp=2, zero=1, micro_batch=B, global_batch=4 * B, seq=S))
    m = est.memory[0]
    params = megatron_small.total_params
    assert m.weights == 2 * params and m.gradients == 2 * params and m.optimizer == 12 * params / 2
    assert m.peak_bytes == pytest.approx(
        m.weights + m.gradients + m.optimizer + m.activations + m.loss + m.comm_buffers + m.reserve
    )
    assert est.fits
    tiny = estimate(
        megatron_small,
        cluster,
        Strategy(dp=2, micro_batch=B, global_batch=2 * B, seq=S),
        reserve_bytes=cluster.device.memory_bytes,
    )
    assert not tiny.fits


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_cli_json(capsys) -> None:
    code, out, _ = _run(
        capsys,
        "estimate",
        "gpt2",
        "--cluster",
        "dgx-h100",
        "--tp",
        "2",
        "--pp",
        "2",
        "--global-batch",
        "64",
        "--micro-batch",
        "2",
        "--seq",
        "512",
        "--zero",
        "1",
        "--recompute",
        "selective",
        "--sequence-parallel",
        "--json",
    )
    assert code == 0
    rep = json.loads(out)
    for key in (
        "step_time_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "hfu",
        "fits",
        "memory",
        "breakdown_s",
    ):
        assert key in rep
    assert set(rep["breakdown_s"]) == {
        "compute",
        "recompute",
        "tp_comm",
        "p2p",
        "bubble",
        "dp_comm",
        "optimizer",
    }
    assert rep["strategy"]["dp"] == 2 and len(rep["memory"]) == 2
    assert rep["step_time_s"] == pytest.approx(sum(rep["breakdown_s"].values()))
    assert rep["tokens_per_s"] == pytest.approx(64 * 512 / rep["step_time_s"])
    assert "peak_bytes" in rep["memory"][0] and "activations" in rep["memory"][0]


def test_estimate_cli_table(capsys) -> None:
    code, out, _ = _run(
        capsys,
        "estimate",
        "llama3-8b",
        "--cluster",
        "dgx-h200",
        "--tp",
        "8",
        "--global-batch",
        "8",
        "--seq",
        "1024",
        "--schedule",
        "1f1b",
    )
    assert code == 0 and "step time" in out and "MFU" in out and "fits: yes" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3", "--dp", "1", "--cluster", "cpu"], "tp·pp·dp = 3·1·1 = 3 but the cluster has 2 GPUs"),
        (
            ["--tp", "8", "--pp", "2", "--dp", "4", "--nodes", "4"],
            "tp·pp·dp = 8·2·4 = 64 but the cluster has 32",
        ),
        (["--tp", "3", "--pp", "1", "--dp", "8", "--nodes", "3"], "tp=3 does not divide 16 heads"),
        (["--tp", "7", "--nodes", "8"], "tp·pp = 7 does not divide the cluster's 64 GPUs"),
        (
            ["--tp", "8", "--nodes", "4", "--micro-batch", "3", "--global-batch", "128"],
            "micro-batch 3 does not divide the per-replica batch 32",
        ),
        (["--tp", "8", "--nodes", "4", "--global-batch", "102"], "global batch 102 is not divisible by dp=4"),
        (["--pp", "32", "--dp", "1", "--nodes", "4"], "pp·v = 32 stages exceed the model's 24 layers"),
        (
            ["--pp", "2", "--tp", "4", "--nodes", "1", "--schedule", "interleaved", "--virtual-stages", "14"],
            "pp·v = 28 stages exceed the model's 24 layers (every chunk but the embedding's",
        ),
        (
            ["--pp", "4", "--nodes", "1", "--schedule", "interleaved", "--global-batch", "4"],
            "interleaved: 2 micro-batches are not a multiple of pp=4",
        ),
        (["--tp", "8", "--virtual-stages", "2"], "virtual stages 2 need a schedule of several chunks"),
        (["--sequence-parallel", "--dp", "8"], "sequence parallel needs tp > 1"),
        (["--cluster", "dgx-z"], "unknown cluster preset 'dgx-z'"),
    ],
)
def test_invalid_plans_exit_2_with_one_line(capsys, argv, message) -> None:
    base = ["estimate", "gpt2-medium", "--seq", "256", "--global-batch", "128", "--cluster", "dgx-h100"]
    code, _, err = _run(capsys, *base, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_model_without_blocks_is_a_clear_error(capsys, tmp_path) -> None:
    path = tmp_path / "flat.py"
    path.write_text(
        "import torch\n"
        "class Flat(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(16, 8)\n"
        "        self.out = torch.nn.Linear(8, 16)\n"
        "    def forward(self, idx):\n"
        "        return self.out(self.emb(idx))\n"
        "def make():\n"
        "    return Flat()\n"
    )
    code, _, err = _run(
        capsys, "estimate", f"{path}:make", "--cluster", "cpu", "--global-batch", "2", "--seq", "8"
    )
    assert code == 2 and "repeated blocks" in err and len(err.strip().splitlines()) == 1


def test_zero3_gathers_twice_per_micro_batch_even_under_full_recompute() -> None:
    """FSDP2 wraps the checkpointed block, so the gather before its backward also serves the
    recomputed forward: on a network too slow for compute to hide anything, full recompute only
    adds compute that hides more of the same two gathers (no third gather of the weights)."""
    import dataclasses

    from autopar.cluster import LinkSpec

    profile = ModelProfiles.of("gpt2-medium", dtype="bf16", seq=1024).at(1)
    base = Cluster.preset("dgx-a100-80g", nodes=2)
    slow = dataclasses.replace(base, inter_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1e-5))
    st = Strategy(dp=16, zero=3, global_batch=16, seq=1024)
    none = estimate(profile, slow, st)
    full = estimate(profile, slow, dataclasses.replace(st, recompute="full"))
    hidden_more = full.breakdown_s["recompute"]  # the recomputed forward, inside the backward
    assert none.breakdown_s["dp_comm"] > 10 * hidden_more  # communication-bound
    s = slow.device.overlap_slowdown  # what compute hides still costs s of itself
    expected = none.breakdown_s["dp_comm"] - (1 - s) * hidden_more
    assert full.breakdown_s["dp_comm"] == pytest.approx(expected, rel=1e-9)


def test_zero3_first_gather_and_last_reduce_scatter_stay_exposed() -> None:
    """On fast links with plenty of compute, ZeRO-3 still exposes one block's gather per
    direction and one block's reduce-scatter per micro-batch: nothing runs before the first
    block or after the last to hide them (α + σ·bytes of one block, ring over dp)."""
    from autopar.cost_models.dp_overlap import zero3_unhidden_s
    from autopar.cost_models.terms import build_terms

    profile = ModelProfiles.of("llama3-8b", dtype="bf16", seq=8192).at(2)
    h100 = Cluster.preset("dgx-h100")
    cluster = replace(h100, device=replace(h100.device, overlap_slowdown=0.0))  # hidden is free
    st = Strategy(dp=8, zero=3, micro_batch=2, global_batch=32, seq=8192)  # 2 micro-batches
    est = estimate(profile, cluster, st)
    terms = build_terms(profile, cluster, st)
    first, last = zero3_unhidden_s(terms)
    (block,) = set(profile.layers[1:-1])
    block_bytes = profile.layer_types[block].params * 2  # bf16 weights of one block
    node = comm.nccl_group(cluster, st.dims.axis("dp"))  # all-gather over 8 GPUs of a node
    assert node is not None and (node.ranks, node.nodes) == (8, 1)
    assert first == pytest.approx(nccl.choose("all_gather", block_bytes, node).seconds(block_bytes), rel=1e-6)
    assert est.breakdown_s["dp_comm"] == pytest.approx(2 * (2 * first + last), rel=1e-9)
    # overlapping gains nothing at slowdown 1: every gather (2 per block) and reduce-scatter in full
    blocks = len(profile.layers) - 2
    everything = replace(h100, device=replace(h100.device, overlap_slowdown=1.0))
    whole = build_terms(profile, everything, st)
    units, params = blocks + 1, profile.total_params  # FSDP2 units: the blocks and one root with the edges
    gather = units * whole.lat_s + whole.s_per_byte * params * whole.weight_bytes
    reduce = units * whole.rs_lat_s + whole.rs_s_per_byte * params * whole.grad_bytes
    total = estimate(profile, everything, st).breakdown_s["dp_comm"]
    assert total == pytest.approx(2 * (2 * gather + reduce), rel=1e-9)
    s = h100.device.overlap_slowdown  # in between: E + s·(C − E)
    assert estimate(profile, h100, st).breakdown_s["dp_comm"] == pytest.approx(
        (1 - s) * 2 * (2 * first + last) + s * total
    )


def test_estimate_names_the_peak_it_priced_with() -> None:
    profile = ModelProfiles.of("gpt2-medium", dtype="bf16", seq=1024).at(1)
    est = estimate(profile, Cluster.preset("h100-96g-500w"), Strategy(dp=8, global_batch=8, seq=1024))
    assert est.compute_basis.startswith("706 TFLOP/s bf16 peak × matmul efficiency 0.64 = 452 TFLOP/s")
    assert "H100-96GB-HBM2e-500W" in est.compute_basis and est.to_dict()["compute_basis"] == est.compute_basis
