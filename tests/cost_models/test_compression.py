"""PowerSGD's pricing (``cost_models.compression``) by hand: bytes on the wire from the model's
matrix shapes, its kernels on the compute stream, its error-feedback memory; and the knob's
validation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import Cluster
from autopar.cost_models.compression import (
    POWERSGD_HBM_BYTES_PER_PARAM,
    compress_s_per_param,
    wire_bytes_per_param,
)
from autopar.cost_models.estimate import estimate
from autopar.cost_models.terms import build_terms
from autopar.strategy import Strategy, StrategyError
from autopar.zoo import GPT, GPTConfig

SMALL_GPT_SEQ = 128  # the seq of the conftest small_gpt_profile

DDP = {"dp": 2, "global_batch": 4, "micro_batch": 1, "seq": SMALL_GPT_SEQ, "dtype": "fp32"}


def test_validation_and_lossiness() -> None:
    assert Strategy(powersgd_rank=4, **DDP).lossy_comm
    with pytest.raises(StrategyError, match="non-negative integer"):
        Strategy(powersgd_rank=-1, **DDP)
    for bad in ({"zero": 2}, {"grad_reduce": "bf16"}, {"dp": 1}):
        with pytest.raises(StrategyError, match="PowerSGD"):
            Strategy(**{**DDP, "powersgd_rank": 4, **bad})
    st = Strategy(powersgd_rank=4, **DDP)
    assert Strategy.from_dict(st.to_dict()) == st


def test_wire_bytes_from_the_matrices(small_gpt_profile) -> None:
    """4·(r·Σ(rows + columns) + vector params) / params, counted here from the model's own
    parameters (dim 0 × the rest, as powerSGD_hook views them; the tied head counted once)."""
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, block_size=SMALL_GPT_SEQ)
    params = list(GPT(cfg).parameters())
    sides = sum(p.shape[0] + p.numel() // p.shape[0] for p in params if p.dim() >= 2)
    vectors = sum(p.numel() for p in params if p.dim() < 2)
    total = sum(p.numel() for p in params)
    st = Strategy(powersgd_rank=4, **DDP)
    assert wire_bytes_per_param(small_gpt_profile, st) == pytest.approx(4 * (4 * sides + vectors) / total)
    assert wire_bytes_per_param(small_gpt_profile, replace(st, powersgd_rank=0)) == 4


def test_kernels_memory_and_the_exposed_all_reduce(small_gpt_profile) -> None:
    """Two 1-GPU nodes on 25 GbE: PowerSGD's kernels at max(24 FLOPs at the fp32 rate, 44 B at
    HBM) per parameter; 4 B per parameter of error feedback; the all-reduce's bytes ÷ by the
    compression and its latency × 3 (vectors, P, Q)."""
    cluster = Cluster.preset("a100-pcie-25gbe", nodes=2, gpus_per_node=1)
    st, plain = Strategy(powersgd_rank=4, **DDP), Strategy(**DDP)
    device = cluster.device
    expect = max(
        24 / device.achievable_flops("fp32"), POWERSGD_HBM_BYTES_PER_PARAM / device.hbm_bandwidth_bytes_per_s
    )
    assert compress_s_per_param(cluster, st) == pytest.approx(expect)
    terms, base = build_terms(small_gpt_profile, cluster, st), build_terms(small_gpt_profile, cluster, plain)
    assert terms.state_bytes_per_param == pytest.approx(base.state_bytes_per_param + 4)
    assert terms.ar_lat_s == pytest.approx(3 * base.ar_lat_s)
    assert (
        terms.grad_bytes == pytest.approx(wire_bytes_per_param(small_gpt_profile, st))
        and terms.grad_bytes < 1
    )
    fast, slow = estimate(small_gpt_profile, cluster, st), estimate(small_gpt_profile, cluster, plain)
    assert fast.breakdown_s["dp_comm"] < slow.breakdown_s["dp_comm"] / 4
