"""A dry run: one rank's real program at the plan's real world size, in this process, on no GPU.

``dry_run(make_model, plan, rank)`` joins torch's ``fake`` process group as ``rank`` of the plan's
world (its collectives move no data), builds the model under ``FakeTensorMode`` (tensors with
shapes, dtypes and storage sizes, no bytes behind them), applies the plan with the same
``parallelize`` a job runs — capture, every pass, DTensor and FSDP2 wrapping, the schedule, the
optimizer — makes the optimizers' state as a first step would (``make_optimizer_state``: zero
gradients, one optimizer step, no forward), and runs a whole training step: every micro-batch,
the gradient reductions, the optimizer step. That step (the last, with ``steps`` > 1) is
measured:

- memory: the bytes alive at once in the storages this rank holds (a DTensor's local shard, not
  its global size), the model states present before the step (parameters, optimizer state)
  plus the peak of what the step makes (gradients, activations, communication buffers,
  temporaries): what a caching allocator's ``max_memory_allocated`` would report, without its
  fragmentation or the CUDA context (the cost model's ``reserve``);
- collectives: count and bytes of every collective, per mesh axis (``ParallelDims``), from the
  operators themselves (c10d and functional collectives).

What differs from a GPU run: kernels run nowhere, so no time is measured; attention's saved
tensors are the CPU kernels' (torch's math/flash CPU paths save what their CUDA counterparts
save for the shapes the zoo uses, but a fused kernel of another library may differ); DDP plans
(tp = pp = 1 at ZeRO 0–1) are refused, as torch's DDP reducer needs real storage. A pipeline
rank can't ask its neighbours for their stage shapes, as torch's schedule does at its first step:
a simulated rank propagates a micro-batch through the whole graph once
(``runtime.steps.propagate_local_shapes``) and hands torch its chunks' shapes (static stage
metadata), and torch's warm-up vote is decided without peers. An expert-parallel rank has no
peer's routing counts: its experts take even shares (``expert_skew`` 1, as the cost model prices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.measure.saved import PeakMode, held, tensors
from autopar.plan import Plan

AXES = ("tp", "cp", "ep", "edp", "dp_shard", "dp_replicate", "dp", "dp_cp", "pp", "stage")
"""The names a collective's group goes by, the most specific first where two are the same
ranks (EP over all of dp is "ep"): the plan's mesh dims, its flattened dims, and a stage."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DryRun:
    """What one rank's dry run found."""

    rank: int
    """The global rank simulated."""
    role: str
    """What the rank holds ("pp 0 of 2 (embedding), dp 0, tp 0")."""
    failure: str = ""
    """One line: the step that failed and why ("" when the rank built and stepped)."""
    seconds: float = 0.0
    """Wall time of the dry run here."""
    peak_bytes: float = 0.0
    """Most bytes alive at once during the measured step (model states included)."""
    parameter_bytes: float = 0.0
    """Of which the parameters this rank keeps between steps (local shards)."""
    optimizer_bytes: float = 0.0
    """Of which the optimizer's state."""
    gradient_bytes: float = 0.0
    """The gradients after backward (local shards)."""
    collectives: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    """"op over axis" → (count, bytes sent in) for the measured step."""
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    """The cost model's memory for this rank's pipeline stage (``Plan.predicted["memory"]``)."""

    @property
    def ok(self) -> bool:
        return not self.failure

    @property
    def predicted_peak_bytes(self) -> float:
        """The predicted peak without the reserve (CUDA context, fragmentation) a dry run has not."""
        return self.predicted.get("peak_bytes", 0.0) - self.predicted.get("reserve", 0.0)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["collectives"] = {k: {"count": n, "bytes": b} for k, (n, b) in self.collectives.items()}
        d["predicted_peak_bytes"] = self.predicted_peak_bytes
        return d


def rank_roles(plan: Plan) -> list[tuple[int, str]]:
    """One rank per distinct program: the first, a middle and the last pipeline rank (each holds
    other chunks: the embedding, blocks, the head), at coordinate 0 of every other axis (the TP,
    DP and EP positions run the same shapes)."""
    dims = plan.strategy.dims
    stages = sorted({0, dims.pp // 2, dims.pp - 1})
    pp = dims.axis("pp")
    return [(k * pp.stride, _role(plan, k * pp.stride)) for k in stages]


def _role(plan: Plan, rank: int) -> str:
    dims, st = plan.strategy.dims, plan.strategy
    k = dims.coordinate(rank, "pp")
    chunks = st.rank_chunks(k)
    edges = [name for c, name in ((0, "embedding"), (st.pp * st.virtual_stages - 1, "head")) if c in chunks]
    what = f" ({' and '.join(edges)})" if edges else ""
    coords = ", ".join(f"{n} {dims.coordinate(rank, n)}" for n, _ in dims.mesh_dims[1:])
    return f"pp {k} of {dims.pp}{what}, {coords}"


def held_bytes(found: list[torch.Tensor]) -> float:
    """Bytes of the distinct storages behind ``found`` (local shards)."""
    storages = [held(t).untyped_storage() for t in found]
    return float(sum({s._cdata: s.nbytes() for s in storages}.values()))


class _Live(PeakMode):
    """``saved.PeakMode``'s peak of the bytes alive, and each collective's count and bytes by the
    mesh axis of its group."""

    def __init__(self, plan: Plan, rank: int) -> None:
        super().__init__()
        dims = plan.strategy.dims
        self.collectives: dict[str, list[float]] = {}
        named = {n for n, _ in dims.mesh_dims} | set(dims.flattened) | {"stage"}
        self._axes: dict[tuple[int, ...], str] = {}
        for n in AXES:
            if n in named and dims.axis(n).size > 1:
                self._axes.setdefault(tuple(dims.group(rank, n)), n)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _count(self, func: Any, args: Any) -> None:
        """One collective: its group's axis (by its ranks) and the bytes it is handed."""
        group = _group(args)
        if group is None:  # not a collective (a wait on one)
            return
        name = func.__name__.split(".")[0].strip("_")
        ranks = dist.get_process_group_ranks(group)
        axis = self._axes.get(tuple(ranks), f"{len(ranks)} ranks")
        sent = tensors(args[1] if name in ("allgather_base", "reduce_scatter_base") else args[0])
        entry = self.collectives.setdefault(f"{name} over {axis}", [0, 0.0])
        entry[0] += 1
        entry[1] += sum(held(t).numel() * held(t).element_size() for t in sent)


def _group(args: Any) -> Any:
    """The process group of a collective's arguments: c10d ops hold it (a ScriptObject), the
    functional ones its name, or the group itself, last (None: no group, not a collective)."""
    boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    if boxed is not None:
        return dist.ProcessGroup.unbox(boxed)
    last = args[-1] if args else None
    if isinstance(last, str):
        return dist.distributed_c10d._resolve_process_group(last)  # type: ignore[arg-type]
    return last if isinstance(last, dist.ProcessGroup) else None


@contextlib.contextmanager
def _real_device_meshes() -> Iterator[None]:
    """Device meshes built with real rank tables under ``FakeTensorMode``: ``init_device_mesh``
    makes its table before the mesh, and torch builds the meshes it concatenates for FSDP2 × TP
    lazily, inside the mode; both run outside it here (the runtime makes its mesh as a job does)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import device_mesh

    real_init, real_make = device_mesh.DeviceMesh.__init__, device_mesh.init_device_mesh

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            real_init(self, *args, **kwargs)

    def make(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return real_make(*args, **kwargs)

    device_mesh.DeviceMesh.__init__ = init  # type: ignore[method-assign]
    device_mesh.init_device_mesh = make
    try:
        yield
    finally:
        device_mesh.DeviceMesh.__init__ = real_init  # type: ignore[method-assign]
        device_mesh.init_device_mesh = real_make


def _refusal(plan: Plan) -> str:
    st = plan.strategy
    if st.uses_ddp:
        return "a DDP plan (tp = pp = 1, ZeRO 0–1) can't be dry-run: torch's DDP reducer needs real storage"
    return ""


def make_optimizer_state(pm: Any) -> None:
    """The optimizers' state made as a first step makes it (AdamW's moments, ZeRO's shards), without
    a forward and backward: every local parameter given a zero gradient, one optimizer step, the
    gradients cleared (a simulated rank's values mean nothing; a real one's are left as trained
    by zeros: weight decay only). The next step is then measured as every later one."""
    for stage in pm.stages:
        for p in stage.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    pm.optimizer.step()
    pm.optimizer.zero_grad(set_to_none=True)


def dry_run(make_model: Callable[[], nn.Module], plan: Plan, rank: int, *, steps: int = 1) -> DryRun:
    """Simulate ``rank`` of ``plan``'s world here (module docstring); never raises for the plan's
    program: a failure is ``DryRun.failure``, one line naming the step."""
    role, start = _role(plan, rank), time.perf_counter()
    predicted = _predicted(plan, rank)
    if why := _refusal(plan):
        return DryRun(rank=rank, role=role, failure=why, predicted=predicted)
    if dist.is_initialized():
        raise AutoparError("a dry run makes its own (fake) process group: run it outside a distributed job")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.strategy.world_size)
    what = "building the model"
    try:
        with _real_device_meshes(), FakeTensorMode(allow_non_fake_inputs=True):
            model = make_model()
            what = "applying the plan (capture, passes, sharding, schedule, optimizer)"
            pm = parallelize(model, plan)
            st = plan.strategy
            first, last = st.replica_rows(pm.dp_rank)
            batch = torch.randint(0, 2, (last - first, st.seq))
            what = "making the optimizer's state"
            make_optimizer_state(pm)
            for step in range(1, steps):
                what = f"training step {step}"
                pm.backward(batch)
                pm.step()
            what = f"training step {steps}"
            found = measure_step(pm, batch, plan, rank)
        return dataclasses.replace(found, role=role, predicted=predicted, seconds=time.perf_counter() - start)
    except Exception as e:  # the plan's program failed: say where, in one line
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return DryRun(rank=rank, role=role, failure=f"{what} failed: {type(e).__name__}: {message}")
    finally:
        dist.destroy_process_group()


def measure_step(pm: Any, batch: torch.Tensor, plan: Plan, rank: int) -> DryRun:
    """One training step of ``pm`` (a ``ParallelModel``: simulated here, or a real rank of a job),
    measured: the model states before it, the peak of what it makes, its collectives."""
    params = [p for stage in pm.stages for p in stage.parameters()]
    states = _optimizer_tensors(pm)
    before = held_bytes(params + states)
    with _Live(plan, rank) as live:
        pm.backward(batch)
        grads = held_bytes([p.grad for p in params if p.grad is not None])
        pm.step()
    return DryRun(
        rank=rank,
        role="",
        peak_bytes=before + live.peak,
        parameter_bytes=held_bytes(params),
        optimizer_bytes=held_bytes(states),
        gradient_bytes=grads,
        collectives={k: (int(n), float(b)) for k, (n, b) in sorted(live.collectives.items())},
    )


def _optimizer_tensors(pm: Any) -> list[torch.Tensor]:
    """Every tensor of every local optimizer's state."""
    optimizers = getattr(pm.optimizer, "optimizers", [pm.optimizer])
    return [t for opt in optimizers for state in opt.state.values() for t in tensors(state)]


def _predicted(plan: Plan, rank: int) -> dict[str, float]:
    """The cost model's memory of ``rank``'s pipeline stage, as the plan recorded it."""
    k = plan.strategy.dims.coordinate(rank, "pp")
    memory = plan.predicted.get("memory") or []
    return {key: float(v) for key, v in (memory[k] if k < len(memory) else {}).items() if key != "stage"}


__all__ = ["DryRun", "dry_run", "held_bytes", "make_optimizer_state", "measure_step", "rank_roles"]
