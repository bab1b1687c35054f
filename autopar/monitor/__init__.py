"""Monitoring: a run's metrics against its plan's prediction (``Metrics``), to JSONL,
TensorBoard and Prometheus, with a warning when they drift apart."""

from autopar.monitor.metrics import GAUGES, Metrics, peak_memory_bytes, read_jsonl

__all__ = ["GAUGES", "Metrics", "peak_memory_bytes", "read_jsonl"]
