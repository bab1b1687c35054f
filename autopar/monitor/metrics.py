"""A run's metrics next to what its plan predicted: ``autopar.Metrics``.

    metrics = autopar.Metrics(pm, jsonl="run.jsonl", tensorboard="tb/", prometheus_port=9400)
    for step in range(steps):
        loss = pm.train_step(batch)
        metrics.step_done(step, loss)          # no collective, except every ``memory_every`` steps
    metrics.close()

Each step, from rank 0's timing of ``train_step`` (``ParallelModel.last_step_s``: it ends with
the loss's all-reduce, so every rank has finished the step) and the plan's prediction:

- tokens/s = global batch · seq / step time, and per GPU (÷ world);
- TFLOP/s per GPU and MFU: the plan's predicted figures × predicted step / measured step (the
  plan counts the model FLOPs once, from the captured graph: ``Plan.predicted``);
- the gradient norm, when ``train_step`` got ``max_grad_norm`` (``ParallelModel.last_grad_norm``);
- a MoE model's expert load, when the step counted it (``ParallelModel.last_expert_load``): the
  busiest expert's rows over the mean in the worst layer, the fraction of rows dropped;
- measured / predicted step time; peak memory of this rank (CUDA allocator peak on a GPU, peak
  RSS on the CPU) against its stage's predicted peak.

With ``collectives_every=N`` one step in N runs under ``torch.profiler`` and gets
``collective_s`` (time in collectives, ``monitor.collectives``) next to ``predicted_comm_s``.

Every ``memory_every`` steps every rank's peak memory is gathered (one small collective) for a
per-rank JSONL line and Prometheus gauges labelled by rank. Sinks: a JSONL file (one line per
step), TensorBoard event files (``torch.utils.tensorboard``), a Prometheus endpoint
(``prometheus_client``, served by rank 0 on 127.0.0.1 unless ``prometheus_addr`` names another
address). Drift: when measured / predicted step time stays beyond ``drift`` (or below its
inverse) for ``drift_steps`` steps, one warning names the plan's largest predicted term and the
command that measures it (``monitor.drift``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.monitor.collectives import CollectiveTimer, predicted_comm_s
from autopar.monitor.drift import Drift
from autopar.monitor.sinks import GAUGES, JsonlSink, PrometheusSink, Sink, TensorBoardSink


def peak_memory_bytes() -> float:
    """This process's peak memory: the CUDA allocator's peak on a GPU, else peak RSS (Linux
    reports ``ru_maxrss`` in KiB)."""
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def expert_figures(loads: dict[str, Any]) -> dict[str, float]:
    """The step's MoE load (``runtime.expert_load.ExpertLoad`` per layer): the worst layer's
    imbalance and the fraction of routed rows dropped over capacity; none without counts."""
    if not loads:
        return {}
    routed = sum(sum(load.routed) for load in loads.values())
    dropped = sum(sum(load.dropped) for load in loads.values())
    return {
        "expert_imbalance": max(load.imbalance for load in loads.values()),
        "expert_dropped_frac": dropped / max(1, routed),
    }


def stage_of_rank(pm: Any) -> int:
    """The pipeline stage index of this rank's first stage."""
    return pm.plan.strategy.dims.coordinate(dist.get_rank(), "pp")


class Metrics:
    """Per-step figures of ``pm``'s run against its plan, to the sinks given (see the module
    docstring). Construct and call on every rank; only rank 0 writes or serves."""

    def __init__(
        self,
        pm: Any,
        *,
        jsonl: str | os.PathLike[str] | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
        prometheus_port: int | None = None,
        prometheus_addr: str = "127.0.0.1",
        memory_every: int = 10,
        drift: float = 1.5,
        drift_steps: int = 5,
        warmup_steps: int = 2,
        collectives_every: int = 0,
    ) -> None:
        if memory_every < 1 or drift <= 1.0 or drift_steps < 1 or warmup_steps < 0:
            raise AutoparError(
                f"memory_every={memory_every}, drift={drift}, drift_steps={drift_steps}, "
                f"warmup_steps={warmup_steps}: need memory_every ≥ 1, drift > 1, drift_steps ≥ 1, warmup ≥ 0"
            )
        if collectives_every == 1 or collectives_every < 0:
            raise AutoparError(
                f"collectives_every={collectives_every}: give 0 (off) or N ≥ 2 (one step in N profiled, "
                "the one before it warms the profiler up)"
            )
        self.collectives = CollectiveTimer(collectives_every) if collectives_every else None
        self.pm, self.memory_every, self.warmup_steps = pm, memory_every, warmup_steps
        self.rank = dist.get_rank()
        self.last: dict[str, float] = {}
        """The last step's figures (every rank computes its own)."""
        self.drift = Drift(pm.plan, ratio=drift, steps=drift_steps)
        self.sinks: list[Sink] = []
        if self.rank == 0:
            if jsonl is not None:
                self.sinks.append(JsonlSink(Path(jsonl)))
            if tensorboard is not None:
                self.sinks.append(TensorBoardSink(Path(tensorboard)))
            if prometheus_port is not None:
                self.sinks.append(PrometheusSink(prometheus_port, prometheus_addr))

    def figures(self, loss: float) -> dict[str, float]:
        """The step's figures on this rank (``GAUGES``)."""
        plan, st = self.pm.plan, self.pm.plan.strategy
        measured = max(self.pm.last_step_s, 1e-12)
        predicted = float(plan.predicted["step_time_s"])
        tokens = st.global_batch * st.seq / measured
        stage = plan.stages[stage_of_rank(self.pm)]
        peak = peak_memory_bytes()
        grad_norm = {} if self.pm.last_grad_norm is None else {"grad_norm": float(self.pm.last_grad_norm)}
        return {
            **grad_norm,
            **expert_figures(getattr(self.pm, "last_expert_load", {})),
            "loss": float(loss),
            "step_time_s": measured,
            "predicted_step_time_s": predicted,
            "step_time_over_predicted": measured / predicted,
            "tokens_per_s": tokens,
            "tokens_per_s_per_gpu": tokens / st.world_size,
            "tflops_per_gpu": float(plan.predicted["tflops_per_gpu"]) * predicted / measured,
            "mfu": float(plan.predicted["mfu"]) * predicted / measured,
            "peak_memory_bytes": peak,
            "predicted_peak_memory_bytes": float(stage.peak_bytes),
            "memory_over_predicted": peak / float(stage.peak_bytes),
        }

    def step_done(self, step: int, loss: float) -> dict[str, float]:
        """Record step ``step`` (just trained by ``pm.train_step``, which returned ``loss``);
        returns this rank's figures. Collective every ``memory_every`` steps."""
        collective_s = self.collectives.step() if self.collectives is not None else None
        self.last = self.figures(loss)
        if collective_s is not None:
            self.last |= {"collective_s": collective_s, "predicted_comm_s": predicted_comm_s(self.pm.plan)}
        per_rank = None
        if (step + 1) % self.memory_every == 0:
            peaks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(
                peaks, (self.last["peak_memory_bytes"], self.last["predicted_peak_memory_bytes"])
            )
            per_rank = [list(p) for p in peaks]
        if self.rank == 0:
            for sink in self.sinks:
                sink.write(step, self.last, per_rank)
            if step >= self.warmup_steps and (warning := self.drift.observe(self.last)):
                print(f"autopar: {warning}", file=sys.stderr, flush=True)
        return self.last

    def rebind(self, pm: Any) -> None:
        """Follow ``pm`` from now on (a running job moved to another plan: ``autopar.Adaptive``);
        drift is judged against its plan afresh."""
        self.pm = pm
        self.drift = Drift(pm.plan, ratio=self.drift.ratio, steps=self.drift.steps)

    def event(self, step: int, record: dict[str, Any]) -> None:
        """Something that happened after step ``step`` (``record["event"]`` names its kind, ``text``
        the line to show), to every sink (rank 0)."""
        if self.rank == 0:
            for sink in self.sinks:
                sink.event(step, record)

    def close(self) -> None:
        """Flush and close the files, stop the endpoint and the profiler."""
        if self.collectives is not None:
            self.collectives.close()
            self.collectives = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a metrics JSONL file (``autopar report --metrics``, tests)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["GAUGES", "Metrics", "peak_memory_bytes", "read_jsonl"]
