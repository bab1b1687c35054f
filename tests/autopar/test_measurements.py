"""Measured profiles: file format, Cluster.from_profile, and how the cost model uses them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import Cluster
from autopar.cost_models import comm
from autopar.cost_models.estimate import estimate
from autopar.errors import AutoparError
from autopar.measure.comm import fit_line, groups_of, message_sizes
from autopar.measurements import (
    CollectiveFit,
    CommProfile,
    ComputeProfile,
    LayerTiming,
    dumps,
    load_comm,
    load_compute,
    write,
)
from autopar.mesh import Axis
from autopar.planner import ModelProfiles
from autopar.strategy import Strategy
from autopar.zoo import GPT, GPTConfig

SEQ = 32


def tiny() -> GPT:
    return GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=SEQ))


@pytest.fixture(scope="module")
def profile():
    import torch

    with torch.device("meta"):
        model = tiny()
    return ModelProfiles.of(model, dtype="fp32", seq=SEQ)


def compute_profile(prof, *, scale: float = 1.0, dtype: str = "fp32") -> ComputeProfile:
    """A synthetic measurement of every layer type at micro-batches 1 and 2, tp 1 and 2."""
    base = prof.at(1)
    timings = [
        LayerTiming(
            layer_type=name,
            micro_batch=b,
            tp=t,
            sequence_parallel=sp,
            forward_s=scale * 1e-3 * (k + 1) * b / t,
            backward_s=scale * 3e-3 * (k + 1) * b / t,
            saved_bytes=1000 * b,
            peak_bytes=None,
        )
        for k, name in enumerate(sorted(base.layer_types))
        for b in (1, 2)
        for t, sp in ((1, False), (2, False), (2, True))
    ]
    return ComputeProfile(
        model="tiny",
        layer_params=tuple(sorted((n, lc.params) for n, lc in base.layer_types.items())),
        seq=SEQ,
        dtype=dtype,
        device="cpu",
        threads=1,
        torch_version="test",
        warmup=1,
        repeat=1,
        layers=tuple(timings),
        optimizer_s_per_param=2e-9,
        optimizer_dtensor_s_per_param=8e-9,
    )


def comm_profile(a: float = 1e-4, b: float = 1e-9, overlap: float = 0.0) -> CommProfile:
    fits = tuple(
        CollectiveFit(
            collective=c,
            group_size=2,
            crosses_nodes=False,
            latency_s=a,
            seconds_per_byte=b,
            sizes_bytes=(4, 1024),
            times_s=(a + 4 * b, a + 1024 * b),
        )
        for c in ("all_gather", "all_reduce", "reduce_scatter", "send_recv")
    )
    return CommProfile(
        backend="gloo",
        device="cpu",
        world_size=2,
        gpus_per_node=2,
        torch_version="test",
        fits=fits,
        overlap=overlap,
    )


def test_files_round_trip_deterministically(profile, tmp_path) -> None:
    cp, kp = compute_profile(profile), comm_profile()
    write(cp, tmp_path / "p.json")
    write(kp, tmp_path / "c.json")
    assert load_compute(tmp_path / "p.json") == cp
    assert load_comm(tmp_path / "c.json") == kp
    assert (tmp_path / "p.json").read_text() == dumps(load_compute(tmp_path / "p.json"))
    text = (tmp_path / "p.json").read_text()
    assert list(json.loads(text)) == sorted(json.loads(text))  # sorted keys
    cluster = Cluster.preset("cpu").from_profile(compute=tmp_path / "p.json", comm=tmp_path / "c.json")
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


def test_bad_files_are_clear_errors(profile, tmp_path) -> None:
    with pytest.raises(AutoparError, match="does not exist"):
        load_compute(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(AutoparError, match="autopar profile"):
        load_compute(tmp_path / "x.json")
    d = compute_profile(profile).to_dict()
    d["version"] = 99
    (tmp_path / "v.json").write_text(json.dumps(d))
    with pytest.raises(AutoparError, match="version 99"):
        load_compute(tmp_path / "v.json")


def test_yaml_cluster_names_profiles_relative_to_itself(profile, tmp_path) -> None:
    write(compute_profile(profile), tmp_path / "p.json")
    write(comm_profile(), tmp_path / "c.json")
    (tmp_path / "c.yaml").write_text("preset: cpu\ncompute_profile: p.json\ncomm_profile: c.json\n")
    cluster = Cluster.from_yaml(tmp_path / "c.yaml")
    assert cluster.compute_profile == compute_profile(profile)
    assert cluster.comm_profile == comm_profile()


def _strategy(**kw) -> Strategy:
    base = dict(tp=1, pp=1, dp=2, zero=0, micro_batch=2, global_batch=8, seq=SEQ, dtype="fp32")
    return Strategy(**{**base, **kw})


def test_measured_compute_replaces_the_roofline(profile) -> None:
    cp = compute_profile(profile)
    cluster = Cluster.preset("cpu").from_profile(compute=cp)
    st = _strategy()
    est = estimate(profile.at(2), cluster, st)
    want = sum(
        (t.forward_s + t.backward_s) * (profile.at(2).blocks if t.layer_type == "Block" else 1)
        for t in cp.layers
        if t.micro_batch == 2 and t.tp == 1
    )
    assert est.breakdown_s["compute"] == pytest.approx(st.micro_batches * want, rel=1e-12)
    assert est.breakdown_s["optimizer"] == pytest.approx(
        2e-9 * sum(lc.params for lc in profile.at(2).layer_types.values())
        + 2e-9 * 3 * profile.at(2).layer_types["Block"].params,
        rel=1e-9,
    )
    assert not est.notes
    # a micro-batch that was not measured falls back to the roofline, and says so
    est4 = estimate(profile.at(4), cluster, _strategy(micro_batch=4))
    assert any("not measured: roofline used" in n for n in est4.notes)
    assert (
        est4.breakdown_s["compute"]
        == estimate(profile.at(4), Cluster.preset("cpu"), _strategy(micro_batch=4)).breakdown_s["compute"]
    )


def test_a_profile_of_another_model_is_refused(profile) -> None:
    import torch

    cp = compute_profile(profile)
    with torch.device("meta"):
        other = GPT(GPTConfig(n_layer=4, n_embd=96, n_head=4, vocab_size=128, block_size=SEQ))
    prof = ModelProfiles.of(other, dtype="fp32", seq=SEQ)
    with pytest.raises(AutoparError, match="measured for tiny"):
        estimate(prof.at(2), Cluster.preset("cpu").from_profile(compute=cp), _strategy())
    longer = ModelProfiles.of(tiny(), dtype="fp32", seq=2 * SEQ)
    with pytest.raises(AutoparError, match="sequence length 32"):
        estimate(longer.at(2), Cluster.preset("cpu").from_profile(compute=cp), _strategy(seq=2 * SEQ))


def test_measured_collectives_and_overlap(profile) -> None:
    link = comm.group_link(
        Cluster.preset("cpu").from_profile(comm=comm_profile(a=1e-3, b=2e-9)), Axis("group", 2, 1)
    )
    assert comm.allreduce_time_s(1e6, 2, link) == pytest.approx(1e-3 + 2e-3)
    assert comm.p2p_time_s(1e6, link) == pytest.approx(1e-3 + 2e-3)
    analytic = comm.group_link(Cluster.preset("cpu"), Axis("group", 2, 1))
    assert comm.allreduce_time_s(1e6, 2, analytic) == pytest.approx(2 * 50e-6 + 1e6 / 2e9)
    # group sizes not measured: alpha-beta, with a note
    four = Cluster.preset("cpu", gpus_per_node=4).from_profile(comm=comm_profile())
    est = estimate(profile.at(2), four, _strategy(dp=4, global_batch=8))
    assert any("all_reduce over dp 4" in n for n in est.notes)
    # overlap 0 (gloo, one rank per core): the gradient all-reduce is exposed whole
    st = _strategy()
    hidden = estimate(profile.at(2), Cluster.preset("cpu").from_profile(comm=comm_profile(overlap=1.0)), st)
    exposed = estimate(profile.at(2), Cluster.preset("cpu").from_profile(comm=comm_profile(overlap=0.0)), st)
    grads = (
        sum(lc.params for lc in profile.at(2).layer_types.values())
        + 3 * profile.at(2).layer_types["Block"].params
    )
    assert exposed.breakdown_s["dp_comm"] == pytest.approx(1e-4 + 1e-9 * 4 * grads, rel=1e-9)
    assert hidden.breakdown_s["dp_comm"] <= exposed.breakdown_s["dp_comm"]


def test_fit_line_recovers_a_line_and_clips() -> None:
    sizes = message_sizes(4, 4 * 4**6)
    assert sizes == [4, 16, 64, 256, 1024, 4096, 16384]
    a, b = fit_line(sizes, [3e-5 + 2e-9 * s for s in sizes])
    assert a == pytest.approx(3e-5, rel=1e-9) and b == pytest.approx(2e-9, rel=1e-9)
    assert fit_line(sizes, [1e-4] * len(sizes)) == pytest.approx((1e-4, 0.0))
    with pytest.raises(AutoparError):
        message_sizes(8, 4)


def test_groups_are_the_meshes_groups() -> None:
    got = groups_of(8, 4)  # two nodes of four
    assert [(n, crosses) for n, crosses, _ in got] == [(2, False), (4, False), (2, True)]
    assert got[0][2] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got[2][2] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for _, _, parts in got:
        assert sorted(r for p in parts for r in p) == list(range(8))


def test_optimizer_uses_the_dtensor_rate_where_parameters_are_dtensors(profile) -> None:
    from autopar.cost_models.compute import optimizer_s_per_param

    cluster = Cluster.preset("cpu").from_profile(compute=compute_profile(profile))
    assert optimizer_s_per_param(cluster, _strategy(zero=0)) == 2e-9
    assert optimizer_s_per_param(cluster, _strategy(zero=3)) == 8e-9  # FSDP2
    assert optimizer_s_per_param(cluster, _strategy(tp=2, dp=1)) == 8e-9
    other = dataclasses.replace(cluster, compute_profile=compute_profile(profile, dtype="bf16"))
    assert optimizer_s_per_param(other, _strategy()) == pytest.approx(30 / 14e9)
