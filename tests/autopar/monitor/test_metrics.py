"""autopar.Metrics on a 2-process gloo run with all three sinks: the JSONL has every figure for
every step, TensorBoard's reader reads the same values back, the Prometheus endpoint is scraped
over HTTP on 127.0.0.1 and every gauge parses and equals the last JSONL line. The run clips its
gradient norm: each step's norm equals single-process training's with ``clip_grad_norm_``."""

from __future__ import annotations

import datetime
import json
import socket
import urllib.request
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from autopar.measure.launch import launch
from autopar.measure.verify import run_reference
from autopar.monitor import GAUGES, read_jsonl
from autopar.monitor.drift import Drift
from autopar.zoo import GPT, GPTConfig


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))


STEPS, CLIP = 4, 0.5


def _batch(step: int) -> torch.Tensor:
    """The global batch of step ``step`` (rank r trains rows 2r, 2r + 1)."""
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, init: str, folder: str, port: int) -> None:
    import torch.distributed as dist

    import autopar

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    cluster = autopar.Cluster.preset("cpu", gpus_per_node=2)
    cons = autopar.Constraints(tp=1, pp=1, dp=2, micro_batch=2, recompute=("none",))
    pm = autopar.parallelize(
        _gpt(), cluster, global_batch=4, seq=16, constraints=cons, optimizer_kwargs={"lr": 1e-2}
    )
    metrics = autopar.Metrics(
        pm,
        jsonl=f"{folder}/run.jsonl",
        tensorboard=f"{folder}/tb",
        prometheus_port=port,
        memory_every=2,
        collectives_every=2,
    )
    try:
        for step in range(STEPS):
            metrics.step_done(step, pm.train_step(_batch(step)[2 * rank : 2 * rank + 2], max_grad_norm=CLIP))
        if rank == 0:  # scraped while the run is live
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                Path(f"{folder}/scrape.txt").write_text(r.read().decode())
        dist.barrier()
    finally:
        metrics.close()
        dist.destroy_process_group()


@pytest.mark.slow
def test_jsonl_tensorboard_and_prometheus_agree(tmp_path) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    port = _free_port()
    launch(worker, args=(f"file://{tmp_path}/init", str(tmp_path), port), nprocs=2, join=True)
    lines = read_jsonl(tmp_path / "run.jsonl")
    steps = [line for line in lines if "ranks" not in line]
    assert [line["step"] for line in steps] == list(range(STEPS))
    for line in steps:
        assert set(GAUGES) <= set(line), set(GAUGES) - set(line)
        assert all(line[k] > 0 for k in GAUGES if k != "loss"), line
        assert line["tokens_per_s"] == pytest.approx(4 * 16 / line["step_time_s"])
        assert line["mfu"] == pytest.approx(
            line["tflops_per_gpu"] * 1e12 / 54e9
        )  # the cpu preset's fp32 peak
    ranks = [line for line in lines if "ranks" in line]
    assert [line["step"] for line in ranks] == [1, 3] and len(ranks[0]["ranks"]) == 2
    assert all(r["peak_memory_bytes"] > 0 for r in ranks[-1]["ranks"])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name in ("mfu", "peak_memory_bytes", "step_time_over_predicted", "loss"):
        got = [e.value for e in events.Scalars(f"autopar/{name}")]
        assert got == pytest.approx([line[name] for line in steps], rel=1e-6), name  # float32 in TB
    assert len(events.Scalars("autopar/peak_memory_bytes/rank1")) == 2
    families = {f.name: f for f in text_string_to_metric_families((tmp_path / "scrape.txt").read_text())}
    last = steps[-1]
    assert families["autopar_step"].samples[0].value == STEPS - 1
    assert families["autopar_mfu"].samples[0].value == pytest.approx(last["mfu"])
    assert families["autopar_step_time_seconds"].samples[0].value == pytest.approx(last["step_time_s"])
    assert families["autopar_tokens_per_second"].samples[0].value == pytest.approx(last["tokens_per_s"])
    per_rank = {s.labels["rank"]: s.value for s in families["autopar_rank_peak_memory_bytes"].samples}
    assert per_rank == {
        "0": ranks[-1]["ranks"][0]["peak_memory_bytes"],
        "1": ranks[-1]["ranks"][1]["peak_memory_bytes"],
    }
    json.dumps(lines)  # plain JSON all through
    profiled = [line["step"] for line in steps if "collective_s" in line]
    assert profiled == [1, 3] and all(steps[k]["collective_s"] > 0 for k in profiled)  # DDP's all-reduce
    assert steps[1]["predicted_comm_s"] > 0
    assert families["autopar_collective_seconds"].samples[0].value == steps[3]["collective_s"]
    data = torch.stack([_batch(step) for step in range(STEPS)])
    ref = run_reference(_gpt, data, STEPS, max_grad_norm=CLIP)
    assert all(n > CLIP for n in ref.norms)  # every step clips
    assert [line["grad_norm"] for line in steps] == pytest.approx(list(ref.norms), rel=1e-5)
    assert [line["loss"] for line in steps] == pytest.approx(ref.losses, rel=1e-5)


class _Plan:
    predicted: ClassVar[dict] = {
        "breakdown_s": {"compute": 0.1, "dp_comm": 0.4, "bubble": 0.0},
        "memory": [{"stage": 0, "peak_bytes": 10.0, "weights": 1.0, "activations": 7.0, "reserve": 2.0}],
    }


def _figures(time_ratio: float, memory_ratio: float = 1.0) -> dict[str, float]:
    return {
        "step_time_s": 0.5 * time_ratio,
        "predicted_step_time_s": 0.5,
        "step_time_over_predicted": time_ratio,
        "peak_memory_bytes": 10.0 * memory_ratio,
        "predicted_peak_memory_bytes": 10.0,
        "memory_over_predicted": memory_ratio,
    }


def test_drift_warns_once_after_k_steps_naming_the_largest_term() -> None:
    drift = Drift(_Plan(), ratio=1.5, steps=3)
    assert [drift.observe(_figures(r)) for r in (2.0, 2.0, 1.0, 2.0, 2.0)] == [None] * 5  # not in a row
    warning = drift.observe(_figures(2.0))
    assert warning is not None and "largest term is dp_comm (0.4 s)" in warning and "profile-comm" in warning
    assert drift.observe(_figures(2.0)) is None  # once
    fast = Drift(_Plan(), ratio=1.5, steps=1).observe(_figures(0.5))
    assert fast is not None and "(0.50×)" in fast  # far faster than predicted is drift too
    memory = Drift(_Plan(), ratio=1.5, steps=2)
    assert memory.observe(_figures(1.0, 2.0)) is None
    said = memory.observe(_figures(1.0, 2.0))
    assert said is not None and "largest predicted part is activations" in said


def test_the_grafana_dashboard_reads_only_gauges_the_endpoint_serves() -> None:
    from autopar.monitor.sinks import prometheus_name

    dashboard = json.loads((Path(__file__).parents[3] / "examples" / "grafana" / "autopar.json").read_text())
    served = {prometheus_name(g) for g in GAUGES} | {"autopar_step"}
    served |= {f"autopar_rank_{k}" for k in ("peak_memory_bytes", "predicted_peak_memory_bytes")}
    used = {t["expr"].split("{")[0] for p in dashboard["panels"] for t in p["targets"]}
    assert used <= served, used - served
    assert {prometheus_name(g) for g in ("step_time_s", "mfu", "tokens_per_s")} <= used
