"""The gradient reduction's dtype (``Strategy.grad_reduce``): bytes on the wire, DDP's
compression casts, validation and the plan's JSON."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import Cluster
from autopar.cost_models.compression import DDP_COMPRESS_BYTES_PER_PARAM
from autopar.cost_models.estimate import estimate
from autopar.cost_models.terms import build_terms
from autopar.strategy import Strategy, StrategyError

SEQ = 128  # the seq of the conftest small_gpt_profile


def test_validation_lossiness_and_json() -> None:
    with pytest.raises(StrategyError, match="grad_reduce must be one of fp32, bf16"):
        Strategy(dp=2, global_batch=2, grad_reduce="fp16")
    assert not Strategy(dp=2, global_batch=2, grad_reduce="bf16").lossy_comm  # a bf16 plan
    assert Strategy(dp=2, global_batch=2, dtype="fp32", grad_reduce="bf16").lossy_comm
    assert Strategy(dp=2, global_batch=2, dtype="fp16", grad_reduce="bf16").lossy_comm
    st = Strategy(dp=2, global_batch=2, grad_reduce="bf16")
    assert Strategy.from_dict(st.to_dict()) == st
    old = {k: v for k, v in st.to_dict().items() if k != "grad_reduce"}  # a plan from before the knob
    assert Strategy.from_dict(old).grad_reduce == "fp32"


@pytest.mark.parametrize("zero", [0, 2])
def test_bf16_reduction_halves_the_exposed_gradient_bytes(small_gpt_profile, zero: int) -> None:
    """Two nodes of one GPU on 25 GbE: the gradient collective is exposed, and its bandwidth
    term (σ · params · bytes; all-reduce under DDP at ZeRO-0, m reduce-scatters at ZeRO-2 without
    a pipeline) loses exactly σ · params · 2 bytes per collective in bf16. DDP also pays its
    hook's casts: 16 bytes per parameter at HBM bandwidth, in the optimizer term."""
    cluster = Cluster.preset("a100-pcie-25gbe", nodes=2, gpus_per_node=1)
    st = Strategy(dp=2, zero=zero, global_batch=4, micro_batch=1, seq=SEQ)
    fp32, bf16 = (
        estimate(small_gpt_profile, cluster, st),
        estimate(small_gpt_profile, cluster, replace(st, grad_reduce="bf16")),
    )
    terms = build_terms(small_gpt_profile, cluster, st)
    params = small_gpt_profile.total_params
    per_byte, collectives = (terms.ar_s_per_byte, 1) if zero == 0 else (terms.rs_s_per_byte, st.micro_batches)
    saved = fp32.breakdown_s["dp_comm"] - bf16.breakdown_s["dp_comm"]
    assert saved == pytest.approx(collectives * per_byte * params * (4 - 2), rel=1e-9)
    casts = bf16.breakdown_s["optimizer"] - fp32.breakdown_s["optimizer"]
    hbm = cluster.device.hbm_bandwidth_bytes_per_s
    assert casts == pytest.approx(
        params * DDP_COMPRESS_BYTES_PER_PARAM / hbm if zero == 0 else 0.0, abs=1e-15
    )
    assert bf16.step_time_s < fp32.step_time_s
    assert [m.peak_bytes for m in bf16.memory] == [m.peak_bytes for m in fp32.memory]


def test_a_measured_bf16_reduction_prices_bf16_gradients(small_gpt_profile) -> None:
    """With a comm profile, a bf16 gradient reduction takes the ``_bf16`` fit (gloo adds bf16
    in software: slower per byte), and the fp32 fit where bf16 was not measured."""
    from autopar.measurements import CollectiveFit, CommProfile

    def fit(name: str, per_byte: float) -> CollectiveFit:
        return CollectiveFit(
            collective=name,
            group_size=2,
            crosses_nodes=False,
            latency_s=1e-4,
            seconds_per_byte=per_byte,
            sizes_bytes=(4, 8),
            times_s=(1e-4, 1e-4),
        )

    fits = [fit("all_reduce", 1e-9), fit("reduce_scatter", 5e-10)]
    measured = CommProfile(
        backend="gloo",
        device="cpu",
        world_size=2,
        gpus_per_node=2,
        torch_version="x",
        fits=tuple(fits),
        overlap=1.0,
    )
    cluster = Cluster.preset("cpu").from_profile(comm=measured)
    st = Strategy(dp=2, global_batch=2, seq=SEQ, dtype="fp32", grad_reduce="bf16")
    assert build_terms(small_gpt_profile, cluster, st).ar_s_per_byte == 1e-9  # fp32's fit: the same bytes
    with_bf16 = replace(measured, fits=(*fits, fit("all_reduce_bf16", 3e-9)))
    terms = build_terms(small_gpt_profile, Cluster.preset("cpu").from_profile(comm=with_bf16), st)
    assert terms.ar_s_per_byte == 3e-9 and terms.rs_s_per_byte == 5e-10
    fp32_terms = build_terms(
        small_gpt_profile, Cluster.preset("cpu").from_profile(comm=with_bf16), replace(st, grad_reduce="fp32")
    )
    assert fp32_terms.ar_s_per_byte == 1e-9


def test_int8_reduction_is_priced_as_an_all_gather_of_codes(small_gpt_profile) -> None:
    """int8 (DDP only, lossy): 1 + 8/512 bytes per gradient element from each rank, all-gathered —
    a bucket of B wire bytes gathers p·B — so its seconds per wire byte are p · σ_ag(p·B); the
    hook's kernels cost 45 + 33·p HBM bytes per parameter. Cheaper than fp32's all-reduce on 2
    ranks across a slow network, dearer on 64 (the gathered bytes grow with p)."""
    from autopar.cost_models import comm
    from autopar.cost_models.compression import (
        GRAD_REDUCE_BYTES,
        INT8_HBM_BYTES_PER_PARAM,
        INT8_HBM_BYTES_PER_PARAM_PER_RANK,
        compress_s_per_param,
    )
    from autopar.cost_models.dp_comm import dp_coefficients

    with pytest.raises(StrategyError, match="int8 gradient reduction is a DDP comm hook"):
        Strategy(dp=2, zero=2, global_batch=2, grad_reduce="int8")
    assert Strategy(dp=2, global_batch=2, grad_reduce="int8").lossy_comm
    assert GRAD_REDUCE_BYTES["int8"] == 1 + 8 / 512
    slow = Cluster.preset("a100-pcie-25gbe", nodes=2, gpus_per_node=1)
    st = Strategy(dp=2, global_batch=4, micro_batch=1, seq=SEQ, dtype="fp32")
    int8 = replace(st, grad_reduce="int8")
    bucket = 1e6
    _, _, (lat, spb) = dp_coefficients(slow, int8, 1.0, 1.0, bucket)
    link = comm.group_link(slow, int8.dims.axis("dp_cp"))
    assert (lat, spb) == pytest.approx(
        (
            comm.coefficients("all_gather", 2, link, 2 * bucket)[0],
            2 * comm.coefficients("all_gather", 2, link, 2 * bucket)[1],
        )
    )
    hbm = slow.device.hbm_bandwidth_bytes_per_s
    assert compress_s_per_param(slow, int8) == pytest.approx(
        (INT8_HBM_BYTES_PER_PARAM + 2 * INT8_HBM_BYTES_PER_PARAM_PER_RANK) / hbm
    )
    fp32_2, int8_2 = estimate(small_gpt_profile, slow, st), estimate(small_gpt_profile, slow, int8)
    assert int8_2.breakdown_s["dp_comm"] < fp32_2.breakdown_s["dp_comm"] / 2
    wide = Cluster.preset("a100-pcie-25gbe", nodes=64, gpus_per_node=1)
    st64 = replace(st, dp=64, global_batch=64)
    fp32_64, int8_64 = (
        estimate(small_gpt_profile, wide, st64),
        estimate(small_gpt_profile, wide, replace(st64, grad_reduce="int8")),
    )
    assert int8_64.breakdown_s["dp_comm"] > fp32_64.breakdown_s["dp_comm"]


def test_the_planner_offers_int8_only_where_lossy_communication_is_allowed(small_gpt_profile) -> None:
    from autopar.planner.comm_knobs import _grad_reduces
    from autopar.request import Constraints, PlanRequest

    def offered(**c: object) -> list[str]:
        request = PlanRequest(
            model="gpt2",
            cluster=Cluster.preset("cpu"),
            global_batch=2,
            seq=SEQ,
            dtype="fp32",
            constraints=Constraints(**c),  # type: ignore[arg-type]
        )
        return _grad_reduces(request, tp=1, pp=1, dp=2, zero=0, ep=1)

    assert offered() == ["fp32"]
    assert offered(allow_lossy_comm=True) == ["fp32", "bf16", "int8"]
