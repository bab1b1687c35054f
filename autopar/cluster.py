"""Cluster descriptions: the one place for every hardware number.

A ``Cluster`` comes from a preset (``Cluster.preset("dgx-h100", nodes=4)``),
a YAML file (``Cluster.from_yaml(path)``) or a dict, and round-trips through
YAML and JSON. Numbers come from vendor datasheets and the measurements listed
in ``shared/REFERENCES.md``; each preset says where its numbers come from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from autopar.errors import ClusterSpecError
from autopar.gpus import arch_of
from autopar.measurements import CommProfile, ComputeProfile, load_comm, load_compute
from autopar.spec_fields import (
    check,
    check_positive,
    check_positive_int,
    deep_merge,
    is_number,
    mapping,
    number,
    positive_int,
    quantity,
    quantity_of,
    read_yaml,
    reject_unknown,
    require,
    string,
)

DTYPES = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU rank for the ``cpu`` preset)."""

    name: str
    """Human-readable device name, e.g. ``"H100-SXM5-80GB"``."""
    memory_bytes: int
    """Device memory in bytes, as the datasheet gives it (the planner keeps a reserve)."""
    peak_flops: Mapping[str, float]
    """Peak dense FLOP/s per dtype (keys among fp32, tf32, bf16, fp16); bf16 is required."""
    hbm_bandwidth_bytes_per_s: float
    """Device-memory bandwidth in bytes/s (roofline's memory roof)."""
    matmul_efficiency: float
    """Achievable fraction of peak on a training step's matmuls, in (0, 1] (calibrated)."""
    attention_efficiency: float | None = None
    """Achievable fraction of peak in fused attention kernels (``scaled_dot_product_attention``'s
    flash / memory-efficient / cuDNN kernels), in (0, 1]; None: ``matmul_efficiency``."""
    overlap_slowdown: float = 0.0
    """Compute time lost per second of communication that compute hides, in [0, 1]: the SMs and
    memory bandwidth concurrent NCCL kernels take from the kernels they overlap (0: hidden
    communication is free, 1: overlapping gains nothing). The presets carry the value fitted on
    the corpus of measured runs (``OVERLAP_SLOWDOWN``)."""

    def __post_init__(self) -> None:
        check(isinstance(self.name, str) and self.name != "", "device.name", "a non-empty string")
        check_positive(self.memory_bytes, "device.memory_bytes")
        check(isinstance(self.peak_flops, Mapping), "device.peak_flops", "a mapping dtype → FLOP/s")
        check("bf16" in self.peak_flops, "device.peak_flops.bf16", "a positive FLOP/s value")
        for dtype, flops in self.peak_flops.items():
            check(dtype in DTYPES, f"device.peak_flops.{dtype}", f"a dtype among {DTYPES}")
            check_positive(flops, f"device.peak_flops.{dtype}")
        check_positive(self.hbm_bandwidth_bytes_per_s, "device.hbm_bandwidth_bytes_per_s")
        fraction = "a fraction in (0, 1]"
        efficiency = self.matmul_efficiency
        check(is_number(efficiency) and 0 < efficiency <= 1, "device.matmul_efficiency", fraction, efficiency)
        attention = self.attention_efficiency
        ok = attention is None or (is_number(attention) and 0 < attention <= 1)
        check(ok, "device.attention_efficiency", f"{fraction} (or absent: the matmul efficiency)", attention)
        slowdown = self.overlap_slowdown
        check(
            is_number(slowdown) and 0 <= slowdown <= 1,
            "device.overlap_slowdown",
            "a fraction in [0, 1]",
            slowdown,
        )

    def achievable_flops(self, dtype: str, *, attention: bool = False) -> float:
        """Large-matmul FLOP/s for ``dtype``: peak × matmul_efficiency; with ``attention``, a fused
        attention kernel's: peak × attention_efficiency (where the device states one)."""
        if dtype not in self.peak_flops:
            raise ClusterSpecError(
                f"device {self.name} has no peak FLOP/s for {dtype}; "
                f"it has {sorted(self.peak_flops)} (add device.peak_flops.{dtype})"
            )
        if attention and self.attention_efficiency is not None:
            return self.peak_flops[dtype] * self.attention_efficiency
        return self.peak_flops[dtype] * self.matmul_efficiency


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A link in the alpha-beta model: time(S bytes) = latency_s + S / bandwidth."""

    bandwidth_bytes_per_s: float
    """Achievable unidirectional bandwidth in bytes/s (per GPU inside a node, per node across)."""
    latency_s: float
    """Per-message latency (alpha) in seconds; >= 0."""

    def __post_init__(self) -> None:
        check_positive(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s")
        check(
            is_number(self.latency_s) and self.latency_s >= 0,
            "latency_s",
            "a number >= 0",
            self.latency_s,
        )


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of identical devices joined by an intra-node link and an inter-node network."""

    name: str
    """Preset or user name of the cluster, e.g. ``"dgx-h100"``."""
    num_nodes: int
    """Number of nodes (machines)."""
    gpus_per_node: int
    """Devices (ranks) per node."""
    device: DeviceSpec
    """The device every rank has."""
    intra_node: LinkSpec
    """Per-GPU link inside a node (NVLink; loopback for ``cpu``)."""
    inter_node: LinkSpec
    """Per-node network between nodes (InfiniBand), shared by the node's GPUs."""
    compute_profile: ComputeProfile | None = None
    """Measured layer times (``autopar profile``): used in place of the roofline where they
    cover a layer type, micro-batch, TP width and dtype."""
    comm_profile: CommProfile | None = None
    """Measured collectives (``autopar profile-comm``): used in place of the alpha-beta
    link model for the collectives and group sizes measured."""

    def __post_init__(self) -> None:
        check(isinstance(self.name, str) and self.name != "", "name", "a non-empty string")
        check_positive_int(self.num_nodes, "num_nodes")
        check_positive_int(self.gpus_per_node, "gpus_per_node")

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks): num_nodes × gpus_per_node."""
        return self.num_nodes * self.gpus_per_node

    # ---- constructors -------------------------------------------------

    @classmethod
    def preset(cls, name: str, *, nodes: int = 1, gpus_per_node: int | None = None) -> Cluster:
        """A built-in cluster: ``Cluster.preset("dgx-a100-80g", nodes=16)``."""
        if name not in PRESETS:
            raise ClusterSpecError(
                f"unknown cluster preset {name!r}; choose one of {', '.join(PRESETS)} "
                "or give a YAML file (see `autopar clusters`)"
            )
        base = PRESETS[name](gpus_per_node)
        return dataclasses.replace(base, num_nodes=nodes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """Build from a dict (as read from YAML/JSON); ``preset:`` may supply defaults."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"cluster: expected a mapping of fields, got {type(data).__name__}")
        data = dict(data)
        if "preset" in data:
            preset = data.pop("preset")
            if not isinstance(preset, str) or preset not in PRESETS:
                raise ClusterSpecError(
                    f"preset: unknown cluster preset {preset!r}; expected one of {', '.join(PRESETS)}"
                )
            data = deep_merge(PRESETS[preset](data.get("gpus_per_node")).to_dict(), data)
        try:
            reject_unknown(data, _CLUSTER_FIELDS, "")
            device = mapping(require(data, "device", ""), "device")
            reject_unknown(device, _DEVICE_FIELDS, "device.")
            peak = mapping(require(device, "peak_flops", "device."), "device.peak_flops")
            return cls(
                name=string(data.get("name", "custom"), "name"),
                num_nodes=positive_int(require(data, "num_nodes", ""), "num_nodes"),
                gpus_per_node=positive_int(require(data, "gpus_per_node", ""), "gpus_per_node"),
                device=DeviceSpec(
                    name=string(require(device, "name", "device."), "device.name"),
                    memory_bytes=int(quantity(device, "memory_bytes", "bytes", "device.", "80 GB")),
                    peak_flops={
                        str(k): quantity_of(v, "flops", f"device.peak_flops.{k}", "989 TFLOP/s")
                        for k, v in peak.items()
                    },
                    hbm_bandwidth_bytes_per_s=quantity(
                        device, "hbm_bandwidth_bytes_per_s", "bytes_per_s", "device.", "3.35 TB/s"
                    ),
                    matmul_efficiency=number(
                        require(device, "matmul_efficiency", "device."),
                        "device.matmul_efficiency",
                    ),
                    attention_efficiency=None
                    if device.get("attention_efficiency") is None
                    else number(device["attention_efficiency"], "device.attention_efficiency"),
                    overlap_slowdown=number(
                        device.get("overlap_slowdown", OVERLAP_SLOWDOWN), "device.overlap_slowdown"
                    ),
                ),
                intra_node=link_spec(require(data, "intra_node", ""), "intra_node"),
                inter_node=link_spec(require(data, "inter_node", ""), "inter_node"),
                compute_profile=_profile(data.get("compute_profile"), load_compute, ComputeProfile),
                comm_profile=_profile(data.get("comm_profile"), load_comm, CommProfile),
            )
        except ClusterSpecError:
            raise
        except ValueError as e:  # from a quantity's parse: already names the field
            raise ClusterSpecError(str(e)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster YAML file (see README for the format)."""
        data = read_yaml(path, "cluster file")
        if data is None:
            raise ClusterSpecError(f"cluster file {os.fspath(path)!r} is empty")
        if isinstance(data, dict):  # profile paths are relative to the YAML file
            for key in ("compute_profile", "comm_profile"):
                if isinstance(data.get(key), str):
                    data[key] = os.path.join(os.path.dirname(os.fspath(path)), data[key])
        try:
            return cls.from_dict(data)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{os.fspath(path)}: {e}") from None

    def from_profile(
        self,
        *,
        compute: str | os.PathLike[str] | ComputeProfile | None = None,
        comm: str | os.PathLike[str] | CommProfile | None = None,
    ) -> Cluster:
        """This cluster with measured numbers attached (paths or loaded profiles):
        ``Cluster.preset("cpu").from_profile(compute="profile.json", comm="comm.json")``."""
        if isinstance(compute, (str, os.PathLike)):
            compute = load_compute(compute)
        if isinstance(comm, (str, os.PathLike)):
            comm = load_comm(comm)
        return dataclasses.replace(
            self,
            compute_profile=compute if compute is not None else self.compute_profile,
            comm_profile=comm if comm is not None else self.comm_profile,
        )

    @classmethod
    def load(cls, spec: str, *, nodes: int | None = None, gpus_per_node: int | None = None) -> Cluster:
        """A preset name or a YAML path (as the CLI's CLUSTER argument), with overrides."""
        if spec.endswith((".yaml", ".yml")) or os.path.sep in spec or os.path.exists(spec):
            cluster = cls.from_yaml(spec)
            if gpus_per_node is not None:
                cluster = dataclasses.replace(cluster, gpus_per_node=gpus_per_node)
            if nodes is not None:
                cluster = dataclasses.replace(cluster, num_nodes=nodes)
            return cluster
        return cls.preset(spec, nodes=nodes or 1, gpus_per_node=gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of base-unit numbers; ``Cluster.from_dict(c.to_dict()) == c``."""
        d = {
            f.name: dataclasses.asdict(getattr(self, f.name))
            if dataclasses.is_dataclass(getattr(self, f.name))
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        d["device"]["peak_flops"] = dict(self.device.peak_flops)
        for key in ("compute_profile", "comm_profile"):
            profile = getattr(self, key)
            if profile is None:
                del d[key]
            else:
                d[key] = profile.to_dict()
        return d

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write the cluster as YAML (written to a temporary file, then renamed)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)


# ---- validation helpers ----------------------------------------------------

_CLUSTER_FIELDS = {f.name for f in dataclasses.fields(Cluster)}
_DEVICE_FIELDS = {f.name for f in dataclasses.fields(DeviceSpec)}
_LINK_FIELDS = {f.name for f in dataclasses.fields(LinkSpec)}


def link_spec(x: object, field: str) -> LinkSpec:
    """A link as a YAML mapping gives it (``field``: where, for the one-line errors)."""
    d = mapping(x, field)
    reject_unknown(d, _LINK_FIELDS, f"{field}.")
    bw = quantity(d, "bandwidth_bytes_per_s", "bytes_per_s", f"{field}.", "400 GB/s")
    lat = quantity(d, "latency_s", "seconds", f"{field}.", "10 us")
    try:
        return LinkSpec(bandwidth_bytes_per_s=bw, latency_s=lat)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{field}.{e}") from None


def _profile(x: object, load: Callable[[str], Any], cls: Any) -> Any:
    """A measured profile given inline (a mapping, as ``to_dict`` writes it) or as a path."""
    if x is None:
        return None
    if isinstance(x, str):
        return load(x)
    return cls.from_dict(mapping(x, cls.__name__))


# ---- presets ---------------------------------------------------------------
#
# Sources (shared/REFERENCES.md): NVIDIA A100 / H100 / H200 datasheets for
# memory, dense bf16/fp16/tf32/fp32 peaks and HBM bandwidth; nccl-tests bus
# bandwidth for the achievable NVLink figure (A100 ~230 GB/s, H100 ~370 GB/s
# ring; H200 has the same NVLink 4 as H100); DGX network 8×200 Gb/s HDR
# (≈200 GB/s per node) for A100 and 8×400 Gb/s NDR (≈400 GB/s) for H100/H200.
# matmul_efficiency (per GPU generation) and overlap_slowdown: fitted by code, never by hand, on
# the corpus of measured runs (benchmarks/runs/, `python benchmarks/published_runs.py`: least
# squares over every source; the held-out errors it prints are the figures to trust).
# Latencies (5 µs NVLink, 10 µs IB) are assumptions for α-β rings; NVIDIA GPUs' collectives are
# priced by NCCL's own tuning model (cost_models/nccl.py); `autopar profile-comm` replaces both.
# attention_efficiency: sdpa's FlashAttention-2 kernels reach 50–73% of peak on A100 (Dao 2023, §4.1:
# up to 225 TFLOP/s of 312), about the matmul efficiency (left unset), but "only 35% utilization on
# the H100" (Shah et al. 2024, FlashAttention-3, abstract): 0.35 on H100 and
# H200 (the same SMs). A measured profile replaces it with the layer's own times.

#
# h100-96g-500w: H100 96 GB HBM2e capped at 500 W (Meta's Grand Teton, torchtitan's runs). Stated
# assumptions, no datasheet: the dense peak is the SXM5's (989 TFLOP/s at 700 W) × 500/700 = 706
# (a capped GPU lowers its clock to fit; training's GEMMs draw the full 700 W), and HBM2e at 2.4 TB/s
# (six stacks at 3.2 Gb/s per pin). A measured profile (`autopar profile`) replaces both.
_POWER_CAP = 500 / 700

MATMUL_EFFICIENCY = {"ampere": 0.64, "hopper": 0.64}  # per generation, fitted on every source
OVERLAP_SLOWDOWN = 0.10
HOPPER_FLASH_ATTENTION_EFFICIENCY = 0.35
_NVLINK_LATENCY_S = 5e-6
_IB_LATENCY_S = 10e-6


def _node(
    name: str,
    device: str,
    memory_gb: float,
    peaks_tflops: tuple[float, float, float],
    hbm_tb_s: float,
    nvlink_gb_s: float,
    ib_gb_s: float,
    attention_efficiency: float | None = None,
    *,
    intra_latency_s: float = _NVLINK_LATENCY_S,
    inter_latency_s: float = _IB_LATENCY_S,
) -> Callable[[int | None], Cluster]:
    """A preset of 8 GPUs per node (by default): peaks (fp32, tf32, bf16 = fp16) in TFLOP/s, HBM
    in TB/s, the intra-node link per GPU and the network per node in GB/s."""
    fp32, tf32, bf16 = peaks_tflops

    def make(gpus_per_node: int | None) -> Cluster:
        return Cluster(
            name=name,
            num_nodes=1,
            gpus_per_node=gpus_per_node or 8,
            device=DeviceSpec(
                name=device,
                memory_bytes=int(memory_gb * 1e9),
                peak_flops={
                    "fp32": fp32 * 1e12,
                    "tf32": tf32 * 1e12,
                    "bf16": bf16 * 1e12,
                    "fp16": bf16 * 1e12,
                },
                hbm_bandwidth_bytes_per_s=hbm_tb_s * 1e12,
                matmul_efficiency=MATMUL_EFFICIENCY.get(arch_of(device) or "", MATMUL_EFFICIENCY["ampere"]),
                attention_efficiency=attention_efficiency,
                overlap_slowdown=OVERLAP_SLOWDOWN,
            ),
            intra_node=LinkSpec(bandwidth_bytes_per_s=nvlink_gb_s * 1e9, latency_s=intra_latency_s),
            inter_node=LinkSpec(bandwidth_bytes_per_s=ib_gb_s * 1e9, latency_s=inter_latency_s),
        )

    return make


# Commodity PCIe clusters (private clouds): GPUs without NVLink on PCIe 4.0 x16, nodes on Ethernet.
# Datasheets: NVIDIA L40S (48 GB GDDR6 at 864 GB/s; dense fp32 91.6, tf32 183, bf16/fp16 362
# TFLOP/s — the datasheet's 733 is with sparsity) and A100 80GB PCIe (19.5 / 156 / 312 TFLOP/s,
# HBM2e 1.935 TB/s). Links, stated assumptions until `autopar profile-comm` measures them:
# PCIe 4.0 x16 moves 31.5 GB/s each way (16 GT/s × 16 lanes × 128/130 bits, PCI-SIG); a ring
# over 8 GPUs behind two CPU sockets reaches well below it, taken as 20 GB/s per GPU with 10 µs
# per message, so tensor parallelism inside a node is priced at PCIe's rate, not NVLink's; the
# network at 90% of the Ethernet line rate (100 GbE: 11.25 GB/s per node; 25 GbE: 2.8 GB/s) with
# 30 µs per message (a switch hop, RoCE or TCP).
_PCIE_GB_S = 20.0
_PCIE_LATENCY_S = 10e-6
_ETHERNET_LATENCY_S = 30e-6


def _cpu(gpus_per_node: int | None) -> Cluster:
    """This 2-core, 24 GiB machine, one gloo rank per core by default.

    Measured here (torch 2.13 CPU, one thread): fp32 1024³ matmul 54 GFLOP/s,
    bf16 0.86 GFLOP/s (no bf16 matmul units), fp16 1.3 GFLOP/s (512³), tensor copy 14 GB/s (read +
    write). Memory: 20 GiB of the 24 GiB shared by the ranks. The loopback
    gloo link (2 GB/s, 50 µs) is an assumption until `autopar profile-comm`
    measures it.
    """
    ranks = gpus_per_node or 2
    return Cluster(
        name="cpu",
        num_nodes=1,
        gpus_per_node=ranks,
        device=DeviceSpec(
            name="cpu-rank",
            memory_bytes=(20 * 2**30) // ranks,
            peak_flops={"fp32": 54e9, "bf16": 0.86e9, "fp16": 1.3e9},
            hbm_bandwidth_bytes_per_s=14e9,
            matmul_efficiency=1.0,
        ),
        intra_node=LinkSpec(bandwidth_bytes_per_s=2e9, latency_s=50e-6),
        inter_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=100e-6),
    )


PRESETS: dict[str, Callable[[int | None], Cluster]] = {
    "dgx-a100-40g": _node("dgx-a100-40g", "A100-SXM4-40GB", 40, (19.5, 156, 312), 1.555, 230, 200),
    "dgx-a100-80g": _node("dgx-a100-80g", "A100-SXM4-80GB", 80, (19.5, 156, 312), 2.039, 230, 200),
    "dgx-h100": _node(
        "dgx-h100", "H100-SXM5-80GB", 80, (67, 494.5, 989), 3.35, 370, 400, HOPPER_FLASH_ATTENTION_EFFICIENCY
    ),
    "dgx-h200": _node(
        "dgx-h200", "H200-SXM-141GB", 141, (67, 494.5, 989), 4.8, 370, 400, HOPPER_FLASH_ATTENTION_EFFICIENCY
    ),
    "h100-96g-500w": _node(
        "h100-96g-500w",
        "H100-96GB-HBM2e-500W",
        96,
        (67 * _POWER_CAP, 494.5 * _POWER_CAP, 989 * _POWER_CAP),
        2.4,
        370,
        400,
        HOPPER_FLASH_ATTENTION_EFFICIENCY,
    ),
    "l40s-100gbe": _node(
        "l40s-100gbe",
        "L40S-48GB-PCIe",
        48,
        (91.6, 183, 362),
        0.864,
        _PCIE_GB_S,
        100 / 8 * 0.9,
        intra_latency_s=_PCIE_LATENCY_S,
        inter_latency_s=_ETHERNET_LATENCY_S,
    ),
    "a100-pcie-25gbe": _node(
        "a100-pcie-25gbe",
        "A100-PCIe-80GB",
        80,
        (19.5, 156, 312),
        1.935,
        _PCIE_GB_S,
        25 / 8 * 0.9,
        intra_latency_s=_PCIE_LATENCY_S,
        inter_latency_s=_ETHERNET_LATENCY_S,
    ),
    "cpu": _cpu,
}
"""Built-in clusters by name; each factory takes an optional gpus_per_node."""


def preset_names() -> list[str]:
    """Names of the built-in clusters, in listing order."""
    return list(PRESETS)


__all__ = ["PRESETS", "Cluster", "DeviceSpec", "LinkSpec", "link_spec", "preset_names"]
