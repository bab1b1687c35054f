"""The corpus of measured runs (benchmarks/runs/*.yaml, format in benchmarks/runs/README.md),
read into rows autopar can price.

Every row's published figure is turned into the seconds of one optimizer step the source
measured (``measured_step_s``), so that every row is compared the same way: the error of a
prediction is the throughput error, measured step ÷ predicted step − 1 (positive: predicted
faster than measured). Conversions, by the row's metric and convention:

    step_time_s              T
    tokens_per_s_per_gpu     B·s / (value · G)           (B sequences of s tokens, G GPUs)
    tokens_per_s             B·s / value
    samples_per_s            B / value
    hardware_tflops_per_gpu  F₃ / (value · 10¹² · G),  F₃ = 96·B·s·l·h²·(1 + s/6h + V/16lh)
                             (Narayanan et al. SC'21 Eq. 3, full recomputation counted)
    model_tflops_per_gpu     F / (value · 10¹² · G), F by ``convention``:
                             6N       6·N·B·s (N parameters)
                             6N+12lhs (6N + 12·l·h·s)·B·s (Chowdhery et al. 2022, PaLM App. B)
                             megatron 72·B·s·l·h²·(1 + s/6h + V/12lh) (Korthikanti et al. 2022 §6)
    mfu                      model_tflops_per_gpu with value · peak_tflops
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import yaml

from autopar.cluster import Cluster
from autopar.cost_models.estimate import estimate
from autopar.gpus import arch_of
from autopar.planner import ModelProfiles, Pricer
from autopar.recompute_policy import RecomputePolicy
from autopar.strategy import Strategy
from autopar.zoo.configs import GPTConfig, LlamaConfig, MixtralConfig
from autopar.zoo.gpt import GPT
from autopar.zoo.llama import Llama
from autopar.zoo.mixtral import Mixtral
from autopar.zoo.registry import ZOO

RUNS_DIR = pathlib.Path(__file__).resolve().parent / "runs"

TORCHTITAN_OP_SAC = ("mm#0", "mm#2", "sdpa#0", "mm#4", "mm#6")
"""torchtitan's per-op selective AC on a Llama block (``_apply_op_sac``): every matmul output
but every second one (wq and wv kept, wk and wo recomputed; w1 and w2 kept, w3 recomputed), and
the attention kernel's outputs; everything else recomputed (``recompute: op-sac`` in a row)."""

_FAMILIES: dict[str, tuple[type, type]] = {
    "gpt": (GPTConfig, GPT),
    "llama": (LlamaConfig, Llama),
    "mixtral": (MixtralConfig, Mixtral),
}


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measured run, ready to price."""

    source: str
    """The source's id: the unit leave-one-source-out holds out."""
    name: str
    where: str
    model: tuple[str, tuple[tuple[str, Any], ...]]
    """(family or ``zoo``, its fields sorted): hashable, so profiles are shared between rows."""
    cluster: Cluster
    strategy: Strategy
    keep: tuple[str, ...]
    """A per-operator recompute policy (the calls each block keeps), or ()."""
    metric: str
    value: float
    measured_step_s: float
    peak_memory_gib: float | None
    not_priced: str

    @property
    def arch(self) -> str:
        """The GPU generation, for the efficiency fitted per generation."""
        return arch_of(self.cluster.device.name) or "other"


def _shape(model: tuple[str, tuple[tuple[str, Any], ...]], seq: int) -> Any:
    family, fields = model
    if family == "zoo":
        return ZOO[dict(fields)["name"]].config
    cfg_cls, _ = _FAMILIES[family]
    kwargs = dict(fields)
    if family == "gpt":
        kwargs["block_size"] = max(int(kwargs.get("block_size", 2048)), seq)
    else:
        kwargs["max_seq_len"] = max(int(kwargs.get("max_seq_len", 8192)), seq)
    return cfg_cls(**kwargs)


@cache
def profiles(model: tuple[str, tuple[tuple[str, Any], ...]], seq: int) -> ModelProfiles:
    """The row's model captured at its sequence length, once per process."""
    family, fields = model
    if family == "zoo":
        return ModelProfiles.of(dict(fields)["name"], dtype="bf16", seq=seq)
    _, module_cls = _FAMILIES[family]
    with torch.device("meta"):
        module = module_cls(_shape(model, seq)).to(torch.bfloat16)
    return ModelProfiles.of(module, dtype="bf16", seq=seq)


def _flops(row_model: Any, measured: dict[str, Any], b: int, s: int, params: Callable[[], float]) -> float:
    """The FLOPs one step counts under the row's metric and convention (module doc)."""
    cfg = row_model
    l = cfg.n_layer  # noqa: E741
    h = getattr(cfg, "n_embd", None) or cfg.dim
    v = cfg.vocab_size
    if measured["metric"] == "hardware_tflops_per_gpu":
        return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    convention = str(measured.get("convention", "")).split()[0].rstrip(",;:(")
    if convention == "megatron":
        return 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    if convention == "6N+12lhs":
        return (6 * params() + 12 * l * h * s) * b * s
    if convention == "6N":
        return 6 * params() * b * s
    raise ValueError(f"unknown FLOP convention {measured.get('convention')!r}")


def measured_step_s(
    row_model: Any, measured: dict[str, Any], st: Strategy, params: Callable[[], float]
) -> float:
    """Seconds per optimizer step the source measured (module doc); ``params``: the model's
    parameter count, asked only by the conventions that count 6 FLOPs per parameter."""
    metric, value = measured["metric"], float(measured["value"])
    b, s, g = st.global_batch, st.seq, st.world_size
    if metric == "step_time_s":
        return value
    if metric == "tokens_per_s_per_gpu":
        return b * s / (value * g)
    if metric == "tokens_per_s":
        return b * s / value
    if metric == "samples_per_s":
        return b / value
    if metric == "mfu":
        value *= float(measured["peak_tflops"])
    flops = _flops(row_model, measured, b, s, params)
    return flops / (value * 1e12 * g)


def _strategy(layout: dict[str, Any]) -> Strategy:
    dp = int(layout.get("dp", 1))
    shard = layout.get("hsdp_shard")
    recompute = layout.get("recompute", "none")
    return Strategy(
        tp=int(layout.get("tp", 1)),
        pp=int(layout.get("pp", 1)),
        dp=dp,
        zero=int(layout.get("zero", 0)),
        micro_batch=int(layout.get("micro_batch", 1)),
        global_batch=int(layout["global_batch"]),
        seq=int(layout["seq"]),
        recompute="full" if recompute == "op-sac" else recompute,  # replaced by the policy
        schedule=str(layout.get("schedule", "1f1b")) if int(layout.get("pp", 1)) > 1 else "1f1b",
        virtual_stages=int(layout.get("virtual_stages", 1) or 1),
        sequence_parallel=bool(layout.get("sequence_parallel", False)),
        ep=int(layout.get("ep", 1) or 1),
        cp=int(layout.get("cp", 1) or 1),
        grad_reduce=str(layout.get("grad_reduce", "fp32")),
        dp_replicate=dp // int(shard) if shard else 1,
    )


@cache
def _cluster(name: str, nodes: int) -> Cluster:
    if name.endswith(".yaml"):
        return dataclasses.replace(Cluster.from_yaml(str(RUNS_DIR / name)), num_nodes=nodes)
    return Cluster.preset(name, nodes=nodes)


def _row(source: str, raw: dict[str, Any]) -> Row:
    ((family, fields),) = raw["model"].items()
    model = (family, tuple(sorted(({"name": fields} if family == "zoo" else fields).items())))
    st = _strategy(raw["layout"])
    hw = raw["hardware"]
    not_priced = str(raw.get("not_priced") or "")
    step = 0.0
    if not not_priced:
        shape = _shape(model, st.seq)
        step = measured_step_s(shape, raw["measured"], st, lambda: profiles(model, st.seq).base.total_params)
    return Row(
        source=source,
        name=str(raw["name"]),
        where=str(raw.get("where", "")),
        model=model,
        cluster=_cluster(str(hw["cluster"]), int(hw["nodes"])),
        strategy=st,
        keep=TORCHTITAN_OP_SAC if raw["layout"].get("recompute") == "op-sac" else (),
        metric=str(raw["measured"]["metric"]),
        value=float(raw["measured"]["value"]),
        measured_step_s=step,
        peak_memory_gib=float(raw["peak_memory_gib"]) if raw.get("peak_memory_gib") else None,
        not_priced=not_priced,
    )


def load(directory: pathlib.Path = RUNS_DIR) -> list[Row]:
    """Every row of every source file, in file then row order."""
    rows: list[Row] = []
    for path in sorted(directory.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        source = str(data["source"]["id"])
        rows.extend(_row(source, raw) for raw in data["runs"])
    return rows


def with_policy(st: Strategy, profs: ModelProfiles, keep: tuple[str, ...]) -> Strategy:
    """``st`` recomputing per operator, keeping ``keep`` in every block (``sac1``)."""
    block = profs.base.layer_types[profs.base.layers[1]]
    own = RecomputePolicy(name="sac1", keep=keep, calls=sum(c.keepable for c in block.calls))
    return dataclasses.replace(st, recompute="sac1", policies=(own,))


def priced_strategy(row: Row) -> Strategy:
    """The row's strategy as autopar prices it (its own per-operator policy where it has one)."""
    st = row.strategy
    return with_policy(st, profiles(row.model, st.seq), row.keep) if row.keep else st


REFERENCE = {"matmul_efficiency": 0.70, "overlap_slowdown": 0.0}
"""Constants no fit produced (the hand-set efficiency the presets had before the corpus): the
per-operator TP layout is chosen at them, so that a held-out row's layout owes nothing to a fit
that saw it."""


def predictor(row: Row) -> Callable[[Cluster], float]:
    """Seconds per step for the row on a variant of its cluster (fitted constants replaced),
    the per-operator TP layout held at the one the planner picks at ``REFERENCE``."""
    profs = profiles(row.model, row.strategy.seq)
    st = priced_strategy(row)
    reference = dataclasses.replace(row.cluster, device=dataclasses.replace(row.cluster.device, **REFERENCE))
    layout = Pricer(profs, reference, dtype="bf16").layouts(st)
    prof = profs.at(st.rank_sequences)
    return lambda cluster: estimate(prof, cluster, st, tp_layout=layout).step_time_s


def predict_peak_gib(row: Row) -> float:
    """autopar's peak memory per GPU for the row (the largest stage's, with the reserve), GiB."""
    profs = profiles(row.model, row.strategy.seq)
    est = Pricer(profs, row.cluster, dtype="bf16").estimate(priced_strategy(row))
    return max(m.peak_bytes for m in est.memory) / 2**30


def predict_step_s(row: Row, cluster: Cluster | None = None) -> float:
    """autopar's seconds per step for the row (``planner.Pricer``, the path of ``autopar plan``
    and ``autopar estimate``), on ``cluster`` (the row's, with fitted constants) if given."""
    profs = profiles(row.model, row.strategy.seq)
    pricer = Pricer(profs, cluster or row.cluster, dtype="bf16")
    return pricer.estimate(priced_strategy(row)).step_time_s


__all__ = [
    "REFERENCE",
    "RUNS_DIR",
    "Row",
    "load",
    "measured_step_s",
    "predict_peak_gib",
    "predict_step_s",
    "predictor",
    "priced_strategy",
    "profiles",
]
