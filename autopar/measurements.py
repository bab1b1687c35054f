"""Measured hardware numbers: what ``autopar profile`` and ``autopar profile-comm`` write.

Two versioned, deterministic JSON files (sorted keys, entries in a fixed order):

- ``ComputeProfile`` (profile.json): per layer type of one model, forward and backward
  seconds at each micro-batch size and tensor-parallel width measured on one device, the
  bytes saved for backward, and the optimizer's seconds per parameter. It names the model
  it was measured for (its layer types and their parameter counts) and the sequence
  length: using it for another model or shape is an error, not a silent misprediction.
- ``CommProfile`` (comm.json): per collective and group size, the fit
  time(S) = latency_s + seconds_per_byte · S of the timings measured over message sizes,
  with the points kept. S is the full tensor (gathered size for all-gather, input size
  for reduce-scatter), the convention of ``cost_models/comm.py``.

``Cluster.from_profile`` attaches them to a cluster; the cost models then use a measured
number wherever one exists for exactly that layer type, micro-batch, width and dtype (or
collective and group size) and the analytic model elsewhere, and the estimate says which.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from autopar.errors import AutoparError
from autopar.files import write_atomic

FORMAT_VERSION = 1
"""Version of both file formats; a file of another version is refused."""
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "send_recv",
    "all_reduce_bf16",
    "reduce_scatter_bf16",
)
"""Collectives ``profile-comm`` measures (send_recv: one message between two ranks; ``_bf16``:
the reduction on bf16 tensors, as a bf16 gradient reduction issues it — a backend may add
bf16 more slowly per byte than fp32, e.g. gloo in software; S in bytes either way)."""
GROUP_COLLECTIVES = tuple(c for c in COLLECTIVES if c != "send_recv")
"""The collectives ``profile-comm`` measures on groups of every size."""


@dataclass(frozen=True, kw_only=True)
class LayerTiming:
    """One layer type at one shape on one device (medians of the repeats)."""

    layer_type: str
    """Layer type name as capture gives it (``embed``, ``Block``, ``head``, …)."""
    micro_batch: int
    """Sequences per micro-batch."""
    tp: int
    """Tensor-parallel width: the layer ran its local shard shapes for this many ranks."""
    sequence_parallel: bool
    """Whether the norms and residual ran split over the sequence (tp > 1 only)."""
    forward_s: float
    """Median forward seconds (the head includes the loss)."""
    backward_s: float
    """Median backward seconds."""
    saved_bytes: int
    """Bytes the forward saved for backward (saved-tensor hooks, parameters excluded)."""
    peak_bytes: int | None
    """Allocator peak above the layer's inputs and weights during forward + backward (GPU);
    None where the device has no allocator statistics (CPU)."""
    call_bytes: tuple[tuple[str, int], ...] = ()
    """Blocks: the bytes each forward call (``op#k``) makes its outputs own, measured (what a
    per-operator recompute policy that keeps it holds, ``measure.saved.call_bytes``)."""

    def __post_init__(self) -> None:
        assert self.micro_batch >= 1 and self.tp >= 1, self
        assert self.forward_s > 0 and self.backward_s > 0, self


@dataclass(frozen=True, kw_only=True)
class ComputeProfile:
    """Measured compute of one model's layer types on one device (``autopar profile``)."""

    model: str
    """The MODEL argument it was measured for."""
    layer_params: tuple[tuple[str, int], ...]
    """(layer type, parameters of one layer): the model's fingerprint."""
    seq: int
    """Sequence length of every measurement."""
    dtype: str
    """Training dtype policy (fp32, bf16 autocast, …)."""
    device: str
    """Device name (``cpu`` or the CUDA device's name)."""
    threads: int
    """CPU threads torch used (``torch.get_num_threads()``)."""
    torch_version: str
    """``torch.__version__`` of the run."""
    warmup: int
    """Untimed iterations before timing."""
    repeat: int
    """Timed iterations per measurement (the median is kept)."""
    layers: tuple[LayerTiming, ...]
    """Every measurement, sorted by (layer type, micro-batch, tp, sp)."""
    optimizer_s_per_param: float
    """AdamW step seconds per parameter (median, measured on one block's parameters)."""
    optimizer_dtensor_s_per_param: float | None = None
    """The same on DTensor parameters (TP-sharded, as under TP and FSDP2, where each tensor
    pays DTensor's dispatch); None when no TP width > 1 was profiled."""
    compiled: bool = False
    """Each layer was timed compiled by ``torch.compile`` (``autopar profile --compile``): it
    prices plans that compile their blocks (``Strategy.compile``), the eager ones only eager."""
    version: int = FORMAT_VERSION
    """File format version."""

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise AutoparError(
                f"compute profile format version {self.version}; this autopar reads version "
                f"{FORMAT_VERSION}: re-run `autopar profile`"
            )

    def timing(
        self,
        layer_type: str,
        *,
        micro_batch: int,
        seq: int,
        tp: int,
        sp: bool,
        dtype: str,
        compiled: bool = False,
    ) -> LayerTiming | None:
        """The measurement of exactly this layer type and shape, compiled or eager, or None."""
        if seq != self.seq or dtype != self.dtype or compiled != self.compiled:
            return None
        sp = sp and tp > 1
        for t in self.layers:
            key = (t.layer_type, t.micro_batch, t.tp, t.sequence_parallel)
            if key == (layer_type, micro_batch, tp, sp):
                return t
        return None

    def covers(
        self, *, micro_batch: int, seq: int, tp: int, sp: bool, dtype: str, compiled: bool = False
    ) -> bool:
        """Whether this shape was measured (for any layer type)."""
        return any(
            self.timing(
                t.layer_type, micro_batch=micro_batch, seq=seq, tp=tp, sp=sp, dtype=dtype, compiled=compiled
            )
            is not None
            for t in self.layers
        )

    def check_model(self, layer_params: Mapping[str, int], *, seq: int) -> None:
        """Raise a clear error when the profile was measured for another model or length."""
        mine = dict(self.layer_params)
        if mine != dict(layer_params):
            theirs = ", ".join(f"{k} {v:,}" for k, v in sorted(layer_params.items()))
            ours = ", ".join(f"{k} {v:,}" for k, v in sorted(mine.items()))
            raise AutoparError(
                f"the compute profile was measured for {self.model} (parameters per layer: {ours}); "
                f"this model has {theirs}: run `autopar profile` for this model"
            )
        if seq != self.seq:
            raise AutoparError(
                f"the compute profile was measured at sequence length {self.seq}, the plan is for "
                f"{seq}: run `autopar profile … --seq {seq}`"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_params"] = [list(x) for x in self.layer_params]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ComputeProfile:
        _check_version(d, "compute profile", "autopar profile")
        try:
            return cls(
                **{
                    **d,
                    "layer_params": tuple((str(k), int(v)) for k, v in d["layer_params"]),
                    "layers": tuple(
                        LayerTiming(
                            **{**x, "call_bytes": tuple((str(k), int(n)) for k, n in x.get("call_bytes", ()))}
                        )
                        for x in d["layers"]
                    ),
                }
            )
        except (TypeError, KeyError, AssertionError) as e:
            raise AutoparError(f"not a compute profile ({e}): re-run `autopar profile`") from None


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """time(S) = latency_s + seconds_per_byte · S for one collective on groups of one size."""

    collective: str
    """One of ``COLLECTIVES``."""
    group_size: int
    """Ranks per group (2 for send_recv)."""
    crosses_nodes: bool
    """Whether the groups spanned nodes (ranks gpus_per_node apart)."""
    latency_s: float
    """Fitted time of an empty message."""
    seconds_per_byte: float
    """Fitted time per byte of S."""
    sizes_bytes: tuple[int, ...]
    """Message sizes measured."""
    times_s: tuple[float, ...]
    """Median time per size (slowest rank)."""

    def __post_init__(self) -> None:
        assert self.collective in COLLECTIVES, self.collective
        assert len(self.sizes_bytes) == len(self.times_s)

    def time_s(self, size_bytes: float) -> float:
        """Fitted seconds for a message of ``size_bytes``."""
        return self.latency_s + self.seconds_per_byte * size_bytes

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """The ring bandwidth β this fit implies (all-reduce: 2(n−1)/n·S/β; all-gather and
        reduce-scatter: (n−1)/n·S/β; send/recv: S/β), comparable with a LinkSpec's."""
        n = self.group_size
        base = self.collective.removesuffix("_bf16")
        factor = {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(base, (n - 1) / n)
        return factor / self.seconds_per_byte if self.seconds_per_byte > 0 else float("inf")


@dataclass(frozen=True, kw_only=True)
class CommProfile:
    """Measured collectives of one cluster (``autopar profile-comm``)."""

    backend: str
    """Process-group backend (nccl, gloo)."""
    device: str
    """Device name of rank 0."""
    world_size: int
    """Ranks launched."""
    gpus_per_node: int
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE)."""
    torch_version: str
    """``torch.__version__`` of the run."""
    fits: tuple[CollectiveFit, ...]
    """Sorted by (collective, crosses nodes, group size)."""
    overlap: float = 1.0
    """Share of a collective's time that compute running at the same moment hides, in [0, 1]:
    (t_compute + t_comm − t_both) / min(t_compute, t_comm) with an all-reduce issued
    asynchronously during matmuls. About 1 where the collective has its own engine (NCCL);
    near 0 where it needs the cores the compute uses (gloo with one rank per core)."""
    version: int = FORMAT_VERSION
    """File format version."""

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise AutoparError(
                f"comm profile format version {self.version}; this autopar reads version "
                f"{FORMAT_VERSION}: re-run `autopar profile-comm`"
            )

    def fit(self, collective: str, *, group_size: int, crosses_nodes: bool) -> CollectiveFit | None:
        """The fit for exactly this collective and group, or None."""
        for f in self.fits:
            if (f.collective, f.group_size, f.crosses_nodes) == (collective, group_size, crosses_nodes):
                return f
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CommProfile:
        _check_version(d, "comm profile", "autopar profile-comm")
        try:
            fits = tuple(
                CollectiveFit(**{**f, "sizes_bytes": tuple(f["sizes_bytes"]), "times_s": tuple(f["times_s"])})
                for f in d["fits"]
            )
            return cls(**{**d, "fits": fits})
        except (TypeError, KeyError, AssertionError) as e:
            raise AutoparError(f"not a comm profile ({e}): re-run `autopar profile-comm`") from None


def _check_version(d: Mapping[str, Any], what: str, command: str) -> None:
    if not isinstance(d, Mapping) or "version" not in d:
        raise AutoparError(f"not a {what} (no version field): write one with `{command}`")


def dumps(obj: ComputeProfile | CommProfile) -> str:
    """Deterministic JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(obj.to_dict(), sort_keys=True, indent=2) + "\n"


def write(obj: ComputeProfile | CommProfile, path: str | os.PathLike[str]) -> None:
    """Write atomically (a temporary file renamed into place: nothing half-written on failure)."""
    write_atomic(path, dumps(obj))


def _read(path: str | os.PathLike[str], what: str) -> Mapping[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise AutoparError(f"{what} {os.fspath(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise AutoparError(f"{os.fspath(path)}: not JSON ({e})") from None
    if not isinstance(data, Mapping):
        raise AutoparError(f"{os.fspath(path)}: expected a JSON object")
    return data


def load_compute(path: str | os.PathLike[str]) -> ComputeProfile:
    """Read a profile.json (clear errors for a missing, malformed or other-version file)."""
    return ComputeProfile.from_dict(_read(path, "compute profile"))


def load_comm(path: str | os.PathLike[str]) -> CommProfile:
    """Read a comm.json."""
    return CommProfile.from_dict(_read(path, "comm profile"))


__all__ = [
    "COLLECTIVES",
    "FORMAT_VERSION",
    "GROUP_COLLECTIVES",
    "CollectiveFit",
    "CommProfile",
    "ComputeProfile",
    "LayerTiming",
    "dumps",
    "load_comm",
    "load_compute",
    "write",
]
