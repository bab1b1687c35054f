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
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.graph.objective import LOGITS, Objective, objective_of
from autopar.measure.saved import call_bytes
from autopar.measure.timing import forward_once, next_token_loss, optimizer_s_per_param, time_layer
from autopar.measurements import ComputeProfile, LayerTiming
from autopar.passes.compile import compile_blocks
from autopar.passes.loss_split import split_loss
from autopar.planner.profiles import ModelProfiles
from autopar.request import Constraints, PlanRequest
from autopar.runtime.loss import tail_loss

Progress = Callable[[int, int, str], None]
"""(done, total, what is being measured now)."""


def build_meta_model(spec: str) -> nn.Module:
    """MODEL ``spec`` in fp32 with its parameters on meta (buffers real): nothing is allocated
    until a stage is materialised."""
    from autopar.zoo.spec import build_model, meta_parameters

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


def _plan_for_width(
    profiles: ModelProfiles, model: nn.Module, *, t: int, sp: bool, b: int, seq: int, dtype: str
) -> Any:
    """A single-stage plan of width t at micro-batch b: its per-operator TP layout is the one the
    planner chooses, so the profiled shard is the one training would run."""
    from autopar.planner import make_plan

    base = Cluster.preset("dgx-h100" if torch.cuda.is_available() else "cpu", gpus_per_node=t)
    roomy = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=2**60))
    fixed = Constraints(tp=t, pp=1, dp=1, micro_batch=b, sequence_parallel=sp, recompute=("none",))
    request = PlanRequest(
        model=model, cluster=roomy, global_batch=b, seq=seq, dtype=dtype, constraints=fixed, top_k=1
    )
    return make_plan(request, profiles).plan


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
    from autopar.graph.meta import materialize
    from autopar.graph.trace import retarget

    retarget(stage, device)
    materialize(stage, device)
    with torch.no_grad():
        for p in stage.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point():
                local.normal_(0.0, 0.02)


@dataclasses.dataclass
class _Session:
    """One ``profile_compute`` run: what every measurement shares, and the progress so far."""

    dev: torch.device
    half: torch.dtype | None
    warmup: int
    repeat: int
    total: int
    progress: Progress | None
    compiled: bool = False
    """Blocks timed compiled (``torch.compile``, as a plan with ``compile = block`` runs them)."""
    barrier: RankBarrier = dataclasses.field(default_factory=RankBarrier)
    done: int = 0

    def tick(self, what: str) -> None:
        if self.progress:
            self.progress(self.done, self.total, what)

    def layers(
        self,
        gm: fx.GraphModule,
        names: list[str],
        kinds: dict[str, str],
        *,
        t: int,
        sp: bool,
        b: int,
        vocab: int,
        seq: int,
        objective: Objective = LOGITS,
        own: tuple[nn.Module, int] | None = None,
    ) -> tuple[list[LayerTiming], nn.Module]:
        """Time the embedding, the first block and the head of ``gm`` at micro-batch b; returns
        their timings and the block's stage (whose parameters the optimizer step is timed on).
        ``own``: the model's own loss cut out of ``gm`` (``passes.loss_split``) and the outputs
        it skips; else the head's loss is next-token cross-entropy."""
        stages = representative_layers(gm, names)
        tokens = torch.randint(0, vocab, (b, seq), device=self.dev)
        args, kwargs = objective.inputs(tokens)
        inputs: list[torch.Tensor] = list(args)
        loss = next_token_loss(tokens) if own is None else _head_loss(own, next(iter(kwargs.values())))
        timings = []
        for role, stage in stages.items():
            self.tick(f"{kinds[role]} micro-batch {b} tp {t}{' sp' if sp else ''}")
            _materialise(stage, self.dev)
            calls = (
                call_bytes(functools.partial(forward_once, stage, inputs, self.half))
                if role == "block"
                else {}
            )  # eager ATen calls: what a per-operator recompute policy keeps
            if role == "block" and self.compiled:  # compiled in the first warm-up iteration
                compile_blocks(stage, [""])
            parts, inputs = time_layer(
                stage,
                inputs,
                loss=loss if role == "head" else None,
                half=self.half,
                warmup=self.warmup,
                repeat=self.repeat,
                sync=self.barrier,
            )
            timings.append(
                LayerTiming(
                    layer_type=kinds[role],
                    micro_batch=b,
                    tp=t,
                    sequence_parallel=sp,
                    forward_s=parts.forward_s,
                    backward_s=parts.backward_s,
                    saved_bytes=parts.saved_bytes,
                    peak_bytes=parts.peak_bytes,
                    call_bytes=tuple(calls.items()),
                )
            )
            self.done += 1
        return timings, stages["block"]

    def optimizer(self, stage: nn.Module, t: int) -> float:
        self.tick(f"optimizer step tp {t}")
        got = optimizer_s_per_param(
            list(stage.parameters()), warmup=self.warmup, repeat=self.repeat, sync=self.barrier
        )
        self.done += 1
        return got


def _head_loss(own: tuple[nn.Module, int], targets: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """The model's own loss (cut out of its graph) on the head's outputs and ``targets``."""
    loss = tail_loss(*own)
    return lambda out: loss(out, targets)


def _check_widths(tp_widths: Sequence[int], heads: int | None) -> None:
    if 1 not in tp_widths:
        raise AutoparError("--tp-widths must include 1 (the optimizer step is measured there)")
    for t in tp_widths:
        if heads and heads % t:
            raise AutoparError(f"--tp-widths {t}: {heads} attention heads do not split {t} ways")


def _measure_widths(
    run: _Session,
    model: nn.Module,
    profiles: ModelProfiles,
    jobs: list[tuple[int, bool, int]],
    kinds: dict[str, str],
    *,
    first_batch: int,
    seq: int,
    dtype: str,
) -> tuple[list[LayerTiming], dict[int, float]]:
    """Every (tp, sp, micro-batch) job: the planner's layout at that width, the model captured
    and rewritten for it as the runtime does, its representative layers timed; the optimizer
    step at tp 1 and at the first width above 1 (s/param by width)."""
    from autopar.runtime.steps import apply_tensor_parallel, capture_graph

    timings: list[LayerTiming] = []
    opt: dict[int, float] = {}
    for t in dict.fromkeys(t for t, _, _ in jobs):
        with fake_tp_mesh(t, run.dev.type) as mesh:
            for b, sp in ((b, sp) for t_, sp, b in jobs if t_ == t):
                plan = _plan_for_width(profiles, model, t=t, sp=sp, b=b, seq=seq, dtype=dtype)
                stages = capture_graph(model, plan)
                apply_tensor_parallel(stages, plan, mesh)
                assert stages.gm is not None
                objective, own = objective_of(model), None
                if objective.target is not None:  # its own loss: timed with the head, as trained
                    stages.gm, loss_graph, kept = split_loss(stages.gm, objective.target)
                    own = (loss_graph, kept)
                vocab = profiles.base.vocab
                got, block = run.layers(
                    stages.gm,
                    stages.names,
                    kinds,
                    t=t,
                    sp=sp,
                    b=b,
                    vocab=vocab,
                    seq=seq,
                    objective=objective,
                    own=own,
                )
                timings += got
                if b == first_batch and (t == 1 or not any(w > 1 for w in opt)):
                    opt[t] = run.optimizer(block, t)
    return timings, opt


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
    compiled: bool = False,
) -> ComputeProfile:
    """Measure every layer type of MODEL ``spec`` (see the module doc). With
    ``sequence_parallel`` each width > 1 is measured with and without it; ``compiled``: each
    block compiled by ``torch.compile`` (``passes.compile``; the embedding and head eager)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: no CUDA device is visible; use --device cpu")
    dev = torch.device(device)
    if device == "cpu":
        torch.set_flush_denormal(True)  # random weights must not hit slow denormal paths
    model = build_meta_model(spec)
    profiles = ModelProfiles.of(model, dtype=dtype, seq=seq)
    base = profiles.base
    _check_widths(tp_widths, base.heads)
    kinds = {"embed": "embed", "block": base.layers[1], "head": "head"}
    sps = {t: (False, True) if t > 1 and sequence_parallel else (False,) for t in tp_widths}
    jobs = [(t, sp, b) for t in tp_widths for sp in sps[t] for b in batches]
    run = _Session(
        dev=dev,
        half={"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype),
        warmup=warmup,
        repeat=repeat,
        total=len(jobs) * 3 + 1 + any(t > 1 for t in tp_widths),
        progress=progress,
        compiled=compiled,
    )
    timings, opt = _measure_widths(
        run, model, profiles, jobs, kinds, first_batch=batches[0], seq=seq, dtype=dtype
    )
    if progress:
        progress(run.total, run.total, "done")
    timings.sort(key=lambda x: (x.layer_type, x.micro_batch, x.tp, x.sequence_parallel))
    return ComputeProfile(
        model=spec,
        layer_params=tuple(sorted((name, lc.params) for name, lc in base.layer_types.items())),
        seq=seq,
        dtype=dtype,
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        warmup=warmup,
        repeat=repeat,
        layers=tuple(timings),
        optimizer_s_per_param=opt[1],
        optimizer_dtensor_s_per_param=next((v for w, v in opt.items() if w > 1), None),
        compiled=compiled,
    )


__all__ = ["build_meta_model", "fake_tp_mesh", "profile_compute", "representative_layers"]
