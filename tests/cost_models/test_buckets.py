"""DDP's gradient buckets (``Strategy.bucket_mb``): validation, the count and the last bucket by
hand, the exposed all-reduce with the overlap the first bucket's wait leaves, and the buffers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from autopar import Cluster
from autopar.cost_models.buckets import ddp_buckets, last_bucket_s, overlap_share
from autopar.cost_models.dp_overlap import dp_exposed_s
from autopar.cost_models.memory import comm_buffer_bytes
from autopar.cost_models.rank_load import rank_load
from autopar.cost_models.terms import build_terms
from autopar.strategy import Strategy, StrategyError
from autopar.zoo import GPT, GPTConfig

from .conftest import SMALL_GPT_SEQ


@pytest.mark.parametrize(
    ("knobs", "why"),
    [
        ({"dp": 2, "zero": 3, "bucket_mb": 100}, "needs a plan on DDP"),
        ({"dp": 1, "bucket_mb": 100}, "needs a plan on DDP"),
        ({"dp": 2, "bucket_mb": 0}, "positive number of MiB"),
        ({"dp": 2, "bucket_mb": True}, "positive number of MiB"),
        ({"dp": 2, "bucket_mb": math.inf}, "positive number of MiB"),
    ],
)
def test_validation(knobs: dict, why: str) -> None:
    with pytest.raises(StrategyError, match=why):
        Strategy(global_batch=4, **knobs)


def test_json_round_trip_and_old_plans() -> None:
    st = Strategy(dp=2, global_batch=4, bucket_mb=0.5)
    assert Strategy.from_dict(st.to_dict()) == st
    old = {k: v for k, v in st.to_dict().items() if k != "bucket_mb"}  # a plan from before the knob
    assert Strategy.from_dict(old).bucket_mb == 25.0


def test_count_and_last_bucket_by_hand() -> None:
    """10M parameters = 40 MB of fp32 gradients: ⌈40e6 / 25 MiB⌉ = 2 buckets, ⌈40e6 / 1 MiB⌉ = 39;
    the last bucket holds 25 MiB / 4 = 6,553,600 of them (all 10M at a 100 MiB cap)."""
    ddp = Strategy(dp=2, global_batch=4)
    assert ddp_buckets(10e6, ddp) == 2
    assert ddp_buckets(10e6, replace(ddp, bucket_mb=1)) == 39
    assert ddp_buckets(10e6, Strategy(dp=2, zero=3, global_batch=4)) == 1  # FSDP2: per block
    assert last_bucket_s(10e6, ddp, 1e-3, 1e-9) == pytest.approx(1e-3 + 6_553_600e-9)
    assert last_bucket_s(10e6, replace(ddp, bucket_mb=100), 1e-3, 1e-9) == pytest.approx(1e-3 + 10e6 * 1e-9)
    assert last_bucket_s(10e6, Strategy(global_batch=4), 1e-3, 1e-9) == 0.0  # dp 1
    assert [overlap_share(n) for n in (1, 2, 4)] == [0.0, 0.5, 0.75]


def test_exposed_all_reduce_by_hand(small_gpt_profile) -> None:
    """DP 4 over 2 nodes of 2 GPUs on 25 GbE, ZeRO-0 at a 1 MiB cap: n = ⌈4P / 1 MiB⌉ buckets of
    the real model's P parameters; exposed max(B, n·α + σ·4P − (1 − 1/n)·O) with O the backward
    after the first block's (``dp_exposed_s``)."""
    cluster = Cluster.preset("a100-pcie-25gbe", nodes=2, gpus_per_node=2)
    st = Strategy(dp=4, global_batch=4, seq=SMALL_GPT_SEQ, dtype="bf16", bucket_mb=1)
    terms = build_terms(small_gpt_profile, cluster, st)
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, block_size=SMALL_GPT_SEQ)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    n = math.ceil(4 * params / 2**20)
    assert terms.ddp_buckets == n > 10
    load = rank_load(terms, 0, st.blocks_per_rank(4)[0])
    assert load.params == pytest.approx(params)
    overlap = terms.overlap * (load.bwd_s - terms.block["none"].bwd_s)
    tail = terms.ar_lat_s + terms.ar_s_per_byte * 4 * 2**20 / 4  # 1 MiB of fp32 gradients
    all_reduce = n * terms.ar_lat_s + terms.ar_s_per_byte * 4 * params
    assert terms.last_bucket_s == pytest.approx(tail)
    exposed = max(tail, all_reduce - (1 - 1 / n) * overlap)
    s = terms.overlap_slowdown  # the hidden part costs s of itself: E + s·(C − E)
    assert s == cluster.device.overlap_slowdown > 0
    assert dp_exposed_s(terms, load) == pytest.approx(exposed + s * (all_reduce - exposed))
    one = build_terms(small_gpt_profile, cluster, replace(st, bucket_mb=100))  # one bucket: no overlap
    assert one.ddp_buckets == 1
    assert dp_exposed_s(one, load) == pytest.approx(one.ar_lat_s + one.ar_s_per_byte * 4 * params)


def test_two_buckets_of_the_cap_in_memory() -> None:
    sizes = {"block_params": 1.0, "edge_params": (1.0, 1.0), "p2p_bytes": 0.0}
    st = Strategy(dp=2, global_batch=4, bucket_mb=100)
    assert comm_buffer_bytes(st, **sizes) == (2 * 100 * 2**20,)
    assert comm_buffer_bytes(replace(st, zero=3, bucket_mb=25), **sizes) == (2 * 1.0 * 2,)
