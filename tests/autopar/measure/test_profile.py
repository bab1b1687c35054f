"""Profile, then compile, end to end on this CPU: ``autopar profile``, ``profile-comm`` and
``calibrate`` under torchrun, ``autopar plan --profile --comm``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from autopar.measurements import dumps, load_comm, load_compute
from autopar.planner import ModelProfiles
from autopar.zoo import GPT, GPTConfig

pytestmark = pytest.mark.slow  # torchrun and the CLI in subprocesses

SEQ = 32
FACTORY = textwrap.dedent(
    """
    from autopar.zoo import GPT, GPTConfig

    def tiny():
        return GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=32))

    def wider():
        return GPT(GPTConfig(n_layer=4, n_embd=96, n_head=4, vocab_size=128, block_size=32))
    """
)


def autopar(*argv: str, torchrun: int = 0, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "-m", "autopar"]
        if torchrun
        else [sys.executable, "-m", "autopar"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*launch, *argv], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("profiling")
    (d / "models.py").write_text(FACTORY)
    return d


@pytest.fixture(scope="module")
def profiled(work):
    spec = f"{work}/models.py:tiny"
    out = work / "profile.json"
    got = autopar(
        "profile", spec, "--device", "cpu", "--dtype", "fp32", "--seq", str(SEQ), "--batch", "1,2",
        "--tp-widths", "1,2", "--warmup", "1", "--repeat", "2", "--threads", "1", "--out", str(out), "--json",
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    return spec, out, json.loads(got.stdout)


def test_profile_measures_every_layer_type_width_and_batch(profiled) -> None:
    _, out, printed = profiled
    prof = load_compute(out)
    assert printed == json.loads(dumps(prof))
    keys = {(t.layer_type, t.micro_batch, t.tp, t.sequence_parallel) for t in prof.layers}
    assert keys == {
        (name, b, t, sp)
        for name in ("embed", "Block", "head")
        for b in (1, 2)
        for t, sp in ((1, False), (2, False), (2, True))
    }
    assert all(t.forward_s > 0 and t.backward_s > 0 for t in prof.layers)
    assert prof.optimizer_s_per_param > 0 and prof.optimizer_dtensor_s_per_param
    assert (prof.seq, prof.dtype, prof.threads, prof.device) == (SEQ, "fp32", 1, "cpu")
    # saved-tensor accounting against the graph's annotation of the same block (Korthikanti's terms)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=SEQ))
    block = ModelProfiles.of(model, dtype="fp32", seq=SEQ).at(2).layer_types["Block"]
    analytic = block.saved_stream_bytes + block.saved_sharded_bytes + block.saved_quadratic_bytes
    measured = {
        (t.tp, t.sequence_parallel): t.saved_bytes
        for t in prof.layers
        if t.layer_type == "Block" and t.micro_batch == 2
    }
    print(f"Block saved bytes at micro-batch 2: measured {measured}, graph annotation {analytic}")
    assert measured[1, False] == pytest.approx(analytic, rel=0.05)
    # at this size the per-operator ILP may keep the block whole at tp 2 (sharding does not pay)
    assert measured[2, False] <= measured[1, False]
    _check_call_bytes(prof, block, model)


def _check_call_bytes(prof, block, model) -> None:
    """The bytes each call of the block keeps, measured, equal the capture's at tp 1; a profiled
    cluster prices a per-operator policy with them (its activations: input + the kept calls)."""
    from autopar import Cluster
    from autopar.cost_models.terms import layer_units
    from autopar.recompute_policy import RecomputePolicy
    from autopar.strategy import Strategy

    timing = next(t for t in prof.layers if (t.layer_type, t.micro_batch, t.tp) == ("Block", 2, 1))
    calls = dict(timing.call_bytes)
    captured = {c.key: c.out_bytes for c in block.calls if c.keepable and c.out_bytes}  # not the output
    assert captured and {k: calls[k] for k in captured} == captured, (calls, captured)
    keep = tuple(k for k in calls if k.startswith(("addmm", "mm")))[:2]
    policy = RecomputePolicy(name="sac1", keep=keep, calls=len(calls))
    st = Strategy(micro_batch=2, global_batch=2, seq=SEQ, dtype="fp32", policies=(policy,))
    # a profile whose measured bytes differ from the capture's: those are what the unit keeps
    doubled = dataclasses.replace(timing, call_bytes=tuple((k, 2 * n) for k, n in calls.items()))
    other = dataclasses.replace(prof, layers=tuple(doubled if t is timing else t for t in prof.layers))
    cluster = Cluster.preset("cpu", gpus_per_node=1).from_profile(compute=other)
    units = layer_units(ModelProfiles.of(model, dtype="fp32", seq=SEQ).at(2), cluster, st)[0]
    assert units["sac1"].act_bytes == 2 * SEQ * 64 * 4 + sum(2 * calls[k] for k in keep)


def test_plan_from_measurements_and_a_mismatched_model(profiled, work, capsys) -> None:
    from autopar.cli import main

    spec, out, _ = profiled
    args = ["plan", spec, "--cluster", "cpu", "--global-batch", "4", "--seq", str(SEQ), "--dtype", "fp32"]
    assert main([*args, "--profile", str(out), "--micro-batch", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert not rep["predicted"]["notes"], rep["predicted"]["notes"]
    assert main([*args, "--profile", str(out), "--micro-batch", "4", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["predicted"]["notes"]
    assert any("micro-batch 4" in n and "roofline used" in n for n in notes)
    wrong = ["plan", f"{work}/models.py:wider", *args[2:], "--profile", str(out)]
    assert main(wrong) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "measured for" in err and "autopar profile" in err


def test_profile_comm_and_calibrate_under_torchrun(profiled, work) -> None:
    spec, out, _ = profiled
    comm = work / "comm.json"
    got = autopar("profile-comm", "--max-bytes", "64KiB", "--repeat", "3", "--out", str(comm), torchrun=2)
    assert got.returncode == 0, got.stderr[-2000:]
    fits = load_comm(comm)
    assert (fits.backend, fits.world_size, fits.gpus_per_node) == ("gloo", 2, 2)
    assert sorted(f.collective for f in fits.fits) == [
        "all_gather",
        "all_reduce",
        "all_reduce_bf16",
        "reduce_scatter",
        "reduce_scatter_bf16",
        "send_recv",
    ]
    assert all(f.latency_s >= 0 and f.seconds_per_byte >= 0 and len(f.times_s) == 8 for f in fits.fits)
    assert 0.0 <= fits.overlap <= 1.0
    plan = work / "plan.json"
    from autopar.cli import main

    common = ["--cluster", "cpu", "--global-batch", "4", "--seq", str(SEQ), "--dtype", "fp32"]
    assert (
        main(
            [
                "plan",
                spec,
                *common,
                "--profile",
                str(out),
                "--comm",
                str(comm),
                "--dp",
                "2",
                "--out",
                str(plan),
            ]
        )
        == 0
    )
    got = autopar(
        "calibrate", spec, "--plan", str(plan), "--steps", "2", "--warmup", "1", "--json", torchrun=2
    )
    assert got.returncode == 0, got.stderr[-2000:]
    rep = json.loads(got.stdout[got.stdout.index("{") :])
    (one,) = rep["plans"]
    predicted = json.loads(plan.read_text())["predicted"]["step_time_s"]
    assert one["predicted_s"] == predicted and one["measured_s"] > 0 and len(one["steps_s"]) == 2
    assert one["error"] == pytest.approx((predicted - one["measured_s"]) / one["measured_s"])
    print(f"calibrate, tiny GPT DP2: predicted {predicted:.4f} s, measured {one['measured_s']:.4f} s")


def test_profile_comm_and_calibrate_need_torchrun() -> None:
    for argv in (["profile-comm", "--out", "x.json"], ["calibrate", "gpt2", "--plan", "p.json"]):
        got = autopar(*argv)
        assert got.returncode == 2 and "torchrun" in got.stderr and got.stderr.count("\n") == 1


def test_profile_an_unmodified_hugging_face_model(tmp_path) -> None:
    out = tmp_path / "hf.json"
    got = autopar(
        "profile", "autopar.zoo.hf:gpt2", "--dtype", "fp32", "--seq", "32", "--batch", "1",
        "--tp-widths", "1,2", "--no-sequence-parallel", "--warmup", "1", "--repeat", "1", "--out", str(out),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    prof = load_compute(out)
    assert {(t.layer_type, t.tp) for t in prof.layers} == {
        (name, t) for name in ("embed", "GPT2Block", "head") for t in (1, 2)
    }


def test_profile_compiled_blocks_prices_compiled_plans_only(work) -> None:
    """``autopar profile --compile`` times each block compiled; plans that compile are priced on
    those timings, eager plans on the roofline (with a note saying so)."""
    spec, out = f"{work}/models.py:tiny", work / "compiled.json"
    got = autopar(
        "profile", spec, "--device", "cpu", "--dtype", "fp32", "--seq", str(SEQ), "--batch", "2",
        "--warmup", "1", "--repeat", "2", "--threads", "1", "--compile", "--out", str(out),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    prof = load_compute(out)
    assert prof.compiled and all(t.forward_s > 0 and t.backward_s > 0 for t in prof.layers)
    plan = ["plan", spec, "--cluster", "cpu", "--global-batch", "4", "--seq", str(SEQ), "--dtype", "fp32"]
    plan += ["--micro-batch", "2", "--profile", str(out), "--json"]
    compiled = json.loads(autopar(*plan, "--compile", "block").stdout)["plan"]["predicted"]
    eager = json.loads(autopar(*plan).stdout)["plan"]["predicted"]
    assert not any("not measured" in n for n in compiled["notes"]), compiled["notes"]
    assert any("eager not measured: roofline used" in n for n in eager["notes"]), eager["notes"]
