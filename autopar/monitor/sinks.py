"""Where ``Metrics`` writes (rank 0): a JSONL file, TensorBoard event files, a Prometheus endpoint.

Each sink gets the step's figures (``GAUGES``) and, every ``memory_every`` steps,
``per_rank``: [[peak bytes, predicted peak bytes] for each rank].
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

from autopar.errors import AutoparError

PerRank = list[list[float]] | None

GAUGES = (
    "loss",
    "step_time_s",
    "predicted_step_time_s",
    "step_time_over_predicted",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "mfu",
    "peak_memory_bytes",
    "predicted_peak_memory_bytes",
    "memory_over_predicted",
)
"""The per-step figures every sink gets (rank 0's)."""
OPTIONAL_GAUGES = ("grad_norm", "collective_s", "predicted_comm_s", "expert_imbalance", "expert_dropped_frac")
"""Figures a step has only when measured: ``grad_norm`` when ``train_step`` got
``max_grad_norm``; ``collective_s`` and ``predicted_comm_s`` on the steps profiled
(``Metrics(collectives_every=N)``); ``expert_imbalance`` (the busiest expert's rows over the
mean, worst MoE layer) and ``expert_dropped_frac`` (routed rows dropped over capacity) when the
step counted its experts' rows (``ParallelModel.last_expert_load``)."""

_MISSING = "metrics for {what} need the {package} package: pip install 'autopar[monitor]'"


class Sink(Protocol):
    def write(self, step: int, figures: dict[str, float], per_rank: PerRank) -> None: ...

    def event(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON line per step (``{"step": k, **figures}``), and a ``{"step": k, "ranks": [...]}``
    line when every rank's memory was gathered; appended (a resumed run continues the file),
    flushed per line."""

    def __init__(self, path: Path) -> None:
        try:
            self.file = open(path, "a")  # noqa: SIM115 (kept open for the run; closed in close)
        except OSError as e:
            raise AutoparError(f"can't write metrics to {str(path)!r}: {e.strerror or e}") from None

    def write(self, step: int, figures: dict[str, float], per_rank: PerRank) -> None:
        self.file.write(json.dumps({"step": step, **figures}) + "\n")
        if per_rank is not None:
            ranks = [
                {"rank": r, "peak_memory_bytes": peak, "predicted_peak_memory_bytes": predicted}
                for r, (peak, predicted) in enumerate(per_rank)
            ]
            self.file.write(json.dumps({"step": step, "ranks": ranks}) + "\n")
        self.file.flush()

    def event(self, step: int, record: dict[str, Any]) -> None:
        """A ``{"step": k, "event": kind, …}`` line (``Metrics.event``)."""
        self.file.write(json.dumps({"step": step, **record}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars ``autopar/<figure>`` per step, and ``autopar/peak_memory_bytes/rank<r>``."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise AutoparError(_MISSING.format(what="TensorBoard", package="tensorboard")) from None
        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, step: int, figures: dict[str, float], per_rank: PerRank) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(f"autopar/{name}", value, step)
        for rank, (peak, _) in enumerate(per_rank or []):
            self.writer.add_scalar(f"autopar/peak_memory_bytes/rank{rank}", peak, step)

    def event(self, step: int, record: dict[str, Any]) -> None:
        """The event's line as text under ``autopar/events``."""
        self.writer.add_text("autopar/events", str(record.get("text", record)), step)

    def close(self) -> None:
        self.writer.close()


def prometheus_name(figure: str) -> str:
    """``step_time_s`` → ``autopar_step_time_seconds``; ``tokens_per_s`` → ``…_per_second``."""
    figure = re.sub(r"_per_s(?=_|$)", "_per_second", figure)
    return f"autopar_{re.sub(r'_s$', '_seconds', figure)}"


class PrometheusSink:
    """Gauges on ``http://<addr>:<port>/metrics`` (``prometheus_client``'s server, its own
    registry): one per figure, ``autopar_step``, and per rank
    ``autopar_rank_peak_memory_bytes{rank=…}`` / ``autopar_rank_predicted_peak_memory_bytes``,
    and ``autopar_events_total{event=…, action=…}`` (``Metrics.event``: plan decisions)."""

    def __init__(self, port: int, addr: str) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
        except ImportError:
            raise AutoparError(_MISSING.format(what="Prometheus", package="prometheus_client")) from None
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Any] = {
            name: Gauge(prometheus_name(name), f"autopar {name}", registry=self.registry)
            for name in (*GAUGES, *OPTIONAL_GAUGES)
        }
        self.step = Gauge("autopar_step", "the last step recorded", registry=self.registry)
        self.events = Counter(
            "autopar_events", "autopar events (plan decisions)", ["event", "action"], registry=self.registry
        )
        self.ranks = {
            key: Gauge(f"autopar_rank_{key}", f"autopar {key}, per rank", ["rank"], registry=self.registry)
            for key in ("peak_memory_bytes", "predicted_peak_memory_bytes")
        }
        try:
            self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise AutoparError(
                f"can't serve metrics on {addr}:{port}: {e.strerror or e}; pick another prometheus_port"
            ) from None

    def write(self, step: int, figures: dict[str, float], per_rank: PerRank) -> None:
        self.step.set(step)
        for name, value in figures.items():
            self.gauges[name].set(value)
        for rank, (peak, predicted) in enumerate(per_rank or []):
            self.ranks["peak_memory_bytes"].labels(rank=str(rank)).set(peak)
            self.ranks["predicted_peak_memory_bytes"].labels(rank=str(rank)).set(predicted)

    def event(self, step: int, record: dict[str, Any]) -> None:
        """``autopar_events_total{event=…, action=…}`` counts it."""
        self.events.labels(event=str(record.get("event", "")), action=str(record.get("action", ""))).inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


__all__ = [
    "GAUGES",
    "OPTIONAL_GAUGES",
    "JsonlSink",
    "PrometheusSink",
    "Sink",
    "TensorBoardSink",
    "prometheus_name",
]
