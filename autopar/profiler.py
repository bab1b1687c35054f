"""``autopar profile``: measure each layer type of a model on the local device.

One representative of each layer type (the embedding, the first block, the head with the
loss) runs forward and backward at every micro-batch size and tensor-parallel width asked
for, with warm-up and repeated timing (medians; CUDA events on a GPU). The layers are the
very graphs training runs: the model is captured, rewritten for TP width t exactly as the
runtime does, and cut into per-layer stages (``passes/pipeline_split``). A TP-sharded layer
runs its local shard shapes: the TP pass runs on a single-process "fake" process group of
t ranks whose collectives do nothing, so the time is the compute of one rank (the
collectives are priced from ``autopar profile-comm``). Only the representatives' weights
are allocated: a 70B model's block profiles on one GPU.

Memory: the bytes saved for backward (saved-tensor hooks, weights excluded) on every device,
and on a GPU the allocator's peak during forward + backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.measurements import ComputeProfile, LayerTiming

Progress = Callable[[int, int, str], None]
"""(done, total, what is being measured now)."""
FLUSH_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}
"""Bytes written between timed regions to evict the caches (CPU LLC up to 32 MiB here; H200 L2
about 60 MB)."""


def build_meta_model(spec: str) -> nn.Module:
    """MODEL ``spec`` in fp32 with its parameters on meta (buffers real): nothing is allocated
    until a stage is materialised."""
    from autopar.models import meta_parameters
    from autopar.verify import build_model

    with meta_parameters():
        return build_model(spec)


@contextlib.contextmanager
def fake_tp_mesh(t: int, device_type: str = "cpu") -> Iterator[Any]:
    """A one-process device mesh of ``t`` ranks whose collectives are no-ops (None for t = 1)."""
    if t == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise AutoparError("autopar profile runs in its own process, not inside a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
    try:
        yield init_device_mesh(device_type, (t,))
    finally:
        dist.destroy_process_group()


class RankBarrier:
    """Under torchrun, a barrier over the launched ranks through torchrun's store (no process
    group: each rank profiles inside its own one-process fake group). Every rank profiles the
    same layers in the same order, so a barrier before each measurement makes their timed
    windows coincide: each layer is timed while the other ranks of the machine run the same
    layer, as in training (on a CPU they share caches and memory bandwidth: measured here, two
    concurrent ranks ran a GPT step 33–50% slower than one alone). A no-op outside torchrun."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.count = 0
        self.store: Any = None
        if self.world > 1 and "MASTER_ADDR" in os.environ:
            from torch.distributed import TCPStore

            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            self.store = TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                self.world,
                is_master=not agent and os.environ.get("RANK") == "0",
                timeout=datetime.timedelta(minutes=10),
            )

    def __call__(self) -> None:
        if self.store is None:
            return
        self.count += 1
        key = f"autopar-profile/{self.count}"
        if self.store.add(key, 1) == self.world:
            self.store.set(f"{key}/done", "1")
        self.store.wait([f"{key}/done"])


def _plan_for_width(model: nn.Module, source: Any, *, t: int, sp: bool, b: int, seq: int, dtype: str) -> Any:
    """A single-stage plan of width t at micro-batch b: its per-operator TP layout is the one the
    planner chooses, so the profiled shard is the one training would run."""
    from autopar.planner import Constraints, make_plan

    base = Cluster.preset("dgx-h100" if torch.cuda.is_available() else "cpu", gpus_per_node=t)
    roomy = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=2**60))
    fixed = Constraints(tp=t, pp=1, dp=1, micro_batch=b, sequence_parallel=sp, recompute=("none",))
    return make_plan(
        type(model).__name__, source, roomy, global_batch=b, seq=seq, dtype=dtype, constraints=fixed, top_k=1
    ).plan


def representative_layers(gm: fx.GraphModule, names: Sequence[str]) -> dict[str, fx.GraphModule]:
    """Layer type → a stage graph of one layer of it: the embedding, the first block, the head
    (the blocks in between form one uncompiled chunk, so the head reads what a block gives)."""
    from autopar.passes.pipeline_split import split_stages

    if len(names) < 4:
        raise AutoparError(f"profiling needs at least two blocks; the model has {len(names) - 2}")
    chunks = [[names[0]], [names[1]], list(names[2:-1]), [names[-1]]]
    parts = split_stages(gm, lambda n: names[n.meta["autopar.layer"]], chunks, keep=[0, 1, 3])
    return {"embed": parts[0], "block": parts[1], "head": parts[3]}


def _materialise(stage: fx.GraphModule, device: torch.device) -> None:
    """Allocate the stage's meta parameters on ``device`` with small random values, and point the
    devices baked into its operators by the capture on meta (``arange(device=meta)``) there."""
    from autopar.graph.trace import retarget
    from autopar.runtime_pp import materialize

    retarget(stage, device)
    materialize(stage, device)
    with torch.no_grad():
        for p in stage.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point():
                local.normal_(0.0, 0.02)


def _logits(out: Any) -> Any:
    """The (batch, seq, vocab) logits among a model's outputs."""
    leaves, _ = tree_flatten(out.logits if hasattr(out, "logits") else out)
    found = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point()]
    if not found:
        raise AutoparError("profiling the head needs logits of shape (batch, seq, vocab) among its outputs")
    return found[0]


class _Timer:
    """Seconds between marks: CUDA events on a GPU, perf_counter after a sync elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def spans_s(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


@contextlib.contextmanager
def _count_saved(stage: nn.Module, total: list[int]) -> Iterator[None]:
    """Add the bytes of the distinct tensors autograd saves (weights excluded) to total[0]."""
    weights = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
        for p in stage.parameters()
    }
    seen: set[int] = set()

    def pack(x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if hasattr(x, "to_local") else x
        ptr = local.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in seen:
            seen.add(ptr)
            total[0] += local.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield


def time_layer(
    stage: nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    tokens: torch.Tensor | None,
    half: torch.dtype | None,
    warmup: int,
    repeat: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[LayerTimingParts, list[torch.Tensor]]:
    """Median forward and backward seconds of ``stage`` on ``inputs``; with ``tokens`` the
    stage is the head and its forward includes the next-token loss. Also returns one forward's
    outputs (detached), the next stage's inputs. ``sync`` runs after each (untimed) cache
    flush: under torchrun, a barrier, so that no rank's flush overlaps another's timed region."""
    from autopar.runtime import lm_loss

    device = next(stage.parameters()).device
    # Training runs the other layers between this layer's forward and backward, so its weights
    # and activations are not in cache: overwrite a buffer twice the last-level cache before
    # each timed region (as Triton's do_bench does), or the profile is optimistic.
    flush = torch.empty(FLUSH_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    fwd, bwd = [], []
    saved = [0]
    peak: int | None = None
    outputs: list[torch.Tensor] = []
    for i in range(warmup + repeat):
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        timer = _Timer(device)
        counting = i == warmup
        flush.zero_()
        sync()
        if counting and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        timer.mark()
        with (
            torch.autocast(device.type, dtype=half) if half else contextlib.nullcontext(),
            _count_saved(stage, saved) if counting else contextlib.nullcontext(),
            _vocab_parallel(tokens is not None),
        ):
            out = stage(*xs)
            if tokens is not None:
                out = lm_loss(_logits(out), tokens)
        timer.mark()
        flush.zero_()
        sync()
        timer.mark()
        if tokens is not None:
            with _vocab_parallel(True):
                out.backward()
        else:
            leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
            torch.autograd.backward(leaves, [torch.randn_like(x) for x in leaves])
        timer.mark()
        f, _, b = timer.spans_s()
        if counting and device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated() - base)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
        if i == 0:
            outputs = [x.detach() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        stage.zero_grad(set_to_none=True)
    return LayerTimingParts(statistics.median(fwd), statistics.median(bwd), saved[0], peak), outputs


@dataclasses.dataclass(frozen=True)
class LayerTimingParts:
    """What ``time_layer`` measures: forward s, backward s, saved bytes, GPU peak bytes."""

    forward_s: float
    backward_s: float
    saved_bytes: int
    peak_bytes: int | None


@contextlib.contextmanager
def _vocab_parallel(on: bool) -> Iterator[None]:
    """``loss_parallel`` while a process group exists (logits split over the vocabulary)."""
    import torch.distributed as dist

    if not on or not dist.is_initialized():
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def optimizer_s_per_param(
    params: Sequence[nn.Parameter], *, warmup: int, repeat: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median AdamW step seconds per parameter (the runtime's default optimizer, foreach), per
    parameter of the tensors given (local shards of DTensors)."""
    plain = [nn.Parameter(p.detach().clone()) for p in params]  # DTensors stay DTensors
    for p in plain:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(plain, lr=1e-3)
    device = plain[0].device
    times = []
    flush = torch.empty(FLUSH_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    for i in range(warmup + repeat):
        flush.zero_()  # a step's states are not in cache: the model's are larger than one block's
        sync()
        timer = _Timer(device)
        timer.mark()
        opt.step()
        timer.mark()
        if i >= warmup:
            times.append(timer.spans_s()[0])
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in plain)
    return statistics.median(times) / local


def profile_compute(
    spec: str,
    *,
    batches: Sequence[int],
    seq: int,
    tp_widths: Sequence[int] = (1,),
    sequence_parallel: bool = True,
    dtype: str = "fp32",
    warmup: int = 2,
    repeat: int = 5,
    device: str = "cpu",
    progress: Progress | None = None,
) -> ComputeProfile:
    """Measure every layer type of MODEL ``spec`` (see the module doc). With
    ``sequence_parallel`` each width > 1 is measured with and without it."""
    from autopar.costing import profile_fn
    from autopar.runtime_pp import rewritten_graph

    if device == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: no CUDA device is visible; use --device cpu")
    dev = torch.device(device)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if device == "cpu":
        torch.set_flush_denormal(True)  # random weights must not hit slow denormal paths
    model = build_meta_model(spec)
    source = profile_fn(model, dtype=dtype, seq=seq)
    base = source(1)
    layer_params = {name: lc.params for name, lc in base.layer_types.items()}
    if 1 not in tp_widths:
        raise AutoparError("--tp-widths must include 1 (the optimizer step is measured there)")
    for t in tp_widths:
        if base.heads and base.heads % t:
            raise AutoparError(f"--tp-widths {t}: {base.heads} attention heads do not split {t} ways")
    block_type = base.layers[1]
    jobs = [
        (t, sp, b)
        for t in tp_widths
        for sp in ((False, True) if t > 1 and sequence_parallel else (False,))
        for b in batches
    ]
    total = len(jobs) * 3 + 1 + any(t > 1 for t in tp_widths)
    done = 0
    timings: list[LayerTiming] = []
    barrier = RankBarrier()
    opt_s = 0.0
    opt_dtensor_s: float | None = None
    for t in tp_widths:
        with fake_tp_mesh(t, dev.type) as mesh:
            for t_, sp, b in jobs:
                if t_ != t:
                    continue
                plan = _plan_for_width(model, source, t=t, sp=sp, b=b, seq=seq, dtype=dtype)
                gm, names, _ = rewritten_graph(model, plan, mesh)
                stages = representative_layers(gm, names)
                tokens = torch.randint(0, base.vocab, (b, seq), device=dev)
                inputs: list[torch.Tensor] = [tokens]
                for role, stage in stages.items():
                    kind = {"embed": "embed", "block": block_type, "head": "head"}[role]
                    what = f"{kind} micro-batch {b} tp {t}{' sp' if sp else ''}"
                    if progress:
                        progress(done, total, what)
                    _materialise(stage, dev)
                    parts, outputs = time_layer(
                        stage,
                        inputs,
                        tokens=tokens if role == "head" else None,
                        half=half,
                        warmup=warmup,
                        repeat=repeat,
                        sync=barrier,
                    )
                    timings.append(
                        LayerTiming(
                            layer_type=kind,
                            micro_batch=b,
                            tp=t,
                            sequence_parallel=sp,
                            forward_s=parts.forward_s,
                            backward_s=parts.backward_s,
                            saved_bytes=parts.saved_bytes,
                            peak_bytes=parts.peak_bytes,
                        )
                    )
                    if role == "block" and b == batches[0] and (t == 1 or opt_dtensor_s is None):
                        if progress:
                            progress(done, total, f"optimizer step tp {t}")
                        got = optimizer_s_per_param(
                            list(stage.parameters()), warmup=warmup, repeat=repeat, sync=barrier
                        )
                        if t == 1:
                            opt_s = got
                        else:
                            opt_dtensor_s = got
                        done += 1
                    inputs = outputs
                    done += 1
    if progress:
        progress(total, total, "done")
    timings.sort(key=lambda x: (x.layer_type, x.micro_batch, x.tp, x.sequence_parallel))
    return ComputeProfile(
        model=spec,
        layer_params=tuple(sorted(layer_params.items())),
        seq=seq,
        dtype=dtype,
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        warmup=warmup,
        repeat=repeat,
        layers=tuple(timings),
        optimizer_s_per_param=opt_s,
        optimizer_dtensor_s_per_param=opt_dtensor_s,
    )


__all__ = ["build_meta_model", "fake_tp_mesh", "profile_compute", "representative_layers", "time_layer"]
