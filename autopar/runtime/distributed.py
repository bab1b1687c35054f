"""The process group and what every rank must agree on before a collective runs."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.gpus import arch_of
from autopar.mesh import node_of, simulated
from autopar.plan import Plan
from autopar.runtime.settle import settle_at_exit
from autopar.strategy import Strategy

DEFAULT_TIMEOUT_S = 300.0
"""Process-group timeout: a mismatched collective becomes an error, not a hang."""


def device_type() -> str:
    """Where this rank computes: ``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def local_device() -> torch.device:
    """This rank's device: its current GPU, or the CPU."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_group_timeout(group: Any, timeout_s: float) -> None:
    """``group``'s timeout (not on a simulated world: the fake backend has none)."""
    if not simulated():
        group.set_timeout(datetime.timedelta(seconds=timeout_s))


def init_distributed(timeout_s: float | None = None) -> float:
    """Join the process group from the torchrun environment if there is none (NCCL on GPUs, gloo
    else), with a timeout of ``timeout_s`` (default ``DEFAULT_TIMEOUT_S``). Where the group exists
    already (the caller made it), a ``timeout_s`` given is set on it: asked for, it holds whoever
    made the group. Returns the group's timeout in seconds (what ``group_timeout`` gives the
    groups made later). Either way, at exit gloo's worker threads settle before the interpreter
    finalizes (``settle``)."""
    settle_at_exit()
    if dist.is_initialized():
        if timeout_s is not None:
            set_group_timeout(dist.distributed_c10d._get_default_group(), timeout_s)
        return group_timeout_s()
    if "RANK" not in os.environ:
        raise AutoparError("no process group and no torchrun environment: launch with torchrun")
    backend = "nccl" if device_type() == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend, store=attempt_store(store, os.environ), rank=rank, world_size=world, timeout=timeout
    )
    return timeout.total_seconds()


def group_timeout_s() -> float:
    """The default process group's timeout, seconds: what every group the plan makes (its mesh's,
    an async checkpoint writer's) is given too — torch gives a new group its backend's global
    default (gloo 30 min, NCCL 10 min), not the default group's. ``DEFAULT_TIMEOUT_S`` where the
    backend does not say (its options are torch's private API)."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(local_device())
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else DEFAULT_TIMEOUT_S


def attempt_store(store: dist.Store, env: Mapping[str, str]) -> dist.Store:
    """The store for this incarnation of the group. Under torchrun the workers share the elastic
    agent's store, which lives as long as the agent: a group restarted after a failure would read
    the addresses the dead group published under the same keys (gloo then waits for a peer that
    never connects; torch issue #135712). The keys are scoped by the agent's restart count and the
    world size, which every worker of one agent shares. Agents on several nodes count restarts
    each on their own: elastic multi-node jobs launch torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store every rendezvous round, torch's
    switch), and then nothing is shared to scope."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"autopar/restart-{attempt}/world-{env.get('WORLD_SIZE', '?')}", store)


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Timed out", "timed out", "Broken pipe")
"""What gloo and NCCL say when a peer died, left or stopped answering (its collective's timeout)."""


@contextlib.contextmanager
def peer_failures(what: str) -> Iterator[None]:
    """Turn a collective's failure because another rank died or hung into one line that says so
    and what happens next (the original error stays chained, for its detail)."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        first = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [""])[0])  # gloo's source
        if not any(sign in first for sign in PEER_LOST):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise AutoparError(
            f"rank {rank}: another process died or stopped answering during {what} ({first[:200]}); "
            "under torchrun --max-restarts the group restarts and resumes from its last checkpoint"
        ) from e


def agree_on_plan(plan: Plan) -> None:
    """Every rank must hold the same plan before any other collective runs."""
    if simulated():
        return
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, plan.hash)
    if len(set(hashes)) != 1:
        raise AutoparError(
            f"ranks hold different plans (hashes {sorted(set(hashes))}); plan once and share it"
        )


def agree_on_batch(batch: torch.Tensor, st: Strategy) -> None:
    """Every rank checks every rank's batch size first: a wrong batch on one rank is an error on
    every rank, not a hang in the other ranks' collectives."""
    if simulated():
        return
    dev = local_device()  # NCCL reduces device tensors only
    sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([batch.shape[0]], device=dev))
    for rank, n in enumerate(sizes):
        replica = st.dims.coordinate(rank, "dp")
        start, stop = st.replica_rows(replica)
        if int(n) != stop - start:
            each = (
                f"each of its {st.dp} data-parallel ranks" if not st.dp_shares else f"its replica {replica}"
            )
            raise AutoparError(
                f"rank {rank}'s batch has {int(n)} sequences but the plan gives {each} {stop - start} "
                f"(global batch {st.global_batch})"
            )


def agree_on_rng(group: Any) -> None:
    """Give every rank of ``group`` (a TP group) its first rank's random-number state, CPU and
    GPU. A tensor-parallel graph computes the replicated activations on every TP rank, so their
    dropout masks must be the same draw there, or the ranks' "replicas" of a norm weight drift
    apart step by step (Megatron-LM seeds its default generator the same on all TP ranks for the
    same reason, Shoeybi et al. 2019 §3). Users often seed by rank; this undoes that only within
    the group, so data-parallel replicas keep their own masks."""
    if simulated():
        return
    states = [torch.get_rng_state()]
    if device_type() == "cuda":
        states.append(torch.cuda.get_rng_state())
    src = dist.get_global_rank(group, 0)
    agreed = []
    for state in states:
        on_device = state.to(local_device())
        dist.broadcast(on_device, src, group=group)
        agreed.append(on_device.cpu())
    torch.set_rng_state(agreed[0])
    if len(agreed) > 1:
        torch.cuda.set_rng_state(agreed[1])


@torch.no_grad()
def reduce_partial_grads(params: list[nn.Parameter], group: Any) -> None:
    """Sum the gradients of ``params`` over ``group`` in one bucketed all-reduce (TP-partial
    gradients under sequence parallelism; a tied weight's gradients on several pipeline ranks)."""
    import torch.distributed._functional_collectives as funcol

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flat = funcol.wait_tensor(funcol.all_reduce(torch.cat([x.reshape(-1) for x in local]), "sum", group))
    offset = 0
    for x in local:
        x.copy_(flat[offset : offset + x.numel()].view_as(x))
        offset += x.numel()


def check_plan(model: nn.Module, plan: Plan) -> None:
    """Raise a clear error, on every rank before any collective, when ``plan`` cannot run here:
    another world size, layers this model lacks, a combination the runtime does not execute."""
    st = plan.strategy
    world = dist.get_world_size()
    if st.world_size != world:
        raise AutoparError(
            f"the plan is for {st.world_size} GPUs (tp·pp·dp·cp = {st.tp}·{st.pp}·{st.dp}·{st.cp}) but "
            f"{world} processes were launched; re-plan for this world (autopar plan --nodes/--cluster)"
        )
    check_runnable(plan)
    check_model(model, plan)
    ddp = st.uses_ddp
    if ddp and any(p.is_meta for p in model.parameters()):
        raise AutoparError(
            f"ZeRO-{st.zero} data parallelism (DDP) needs the model's weights, but its parameters are "
            "on the meta device: build it with real weights, or plan ZeRO-2/3 or a pipeline"
        )


def node_group(plan: Plan, rank: int) -> dict[str, Any] | None:
    """On a mixed cluster's plan, the node group (as ``Plan.cluster`` holds it) of ``rank``: its
    node's (``Plan.node_groups``, ranks fill nodes in order); None on one type of node."""
    if not plan.node_groups:
        return None
    groups = {g["name"]: g for g in plan.cluster["groups"]}
    return groups[plan.node_groups[node_of(rank, plan.cluster["groups"][0]["gpus_per_node"])]]


def placement_problem(plan: Plan, rank: int, device_name: str, memory_bytes: float) -> str | None:
    """Why ``rank``'s device (its name and memory, as CUDA reports them) is not the one the plan
    gives its node's group, or None: another GPU generation (``gpus.arch_of``), or a memory
    more than a quarter off the group's (an A100 40GB where the plan says 80GB)."""
    group = node_group(plan, rank)
    if group is None:
        return None
    want = group["device"]
    arch, have = arch_of(want["name"]), arch_of(device_name)
    off = abs(memory_bytes - want["memory_bytes"]) > 0.25 * want["memory_bytes"]
    if (arch and have and arch != have) or off:
        nodes = [i for i, g in enumerate(plan.node_groups) if g == group["name"]]
        return (
            f"rank {rank} runs on a {device_name} ({memory_bytes / 1e9:.0f} GB) but the plan puts its node "
            f"in group {group['name']} ({want['name']}); launch that group's nodes as node ranks {nodes} "
            "(torchrun --node-rank)"
        )
    return None


def check_node_groups(plan: Plan) -> None:
    """Every rank's GPU is its node group's (``placement_problem``), checked on every rank at once
    so that all of them stop with the first rank's reason. CUDA only (CPU ranks carry no type)."""
    if not plan.node_groups or simulated() or not torch.cuda.is_available():
        return
    props = torch.cuda.get_device_properties(local_device())
    mine = placement_problem(plan, dist.get_rank(), props.name, float(props.total_memory))
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    bad = [x for x in found if x]
    if bad:
        raise AutoparError(bad[0] + (f" ({len(bad)} ranks are misplaced)" if len(bad) > 1 else ""))


def check_model(model: nn.Module, plan: Plan) -> None:
    """The plan was made for this model: every block it names is one of the model's modules; and
    a model configured with a sliding window is not split by context parallelism (its attention
    runs causal over the whole sequence; a window shorter than a rank's positions would pass for
    causal where the masks are read)."""
    model_blocks = {n for n, _ in model.named_modules()}
    missing = [n for n in plan.recompute if n not in model_blocks]
    if missing:
        raise AutoparError(
            f"the plan names layers this model lacks (e.g. {missing[0]!r}): it was made for {plan.model}"
        )
    st = plan.strategy
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if st.cp > 1 and isinstance(window, int) and window < st.seq:
        raise AutoparError(
            f"{type(model).__name__} attends within a sliding window of {window} positions; context "
            f"parallelism (cp {st.cp}) runs causal attention over the whole sequence: plan cp 1"
        )


def check_runnable(plan: Plan) -> None:
    """Raise a clear error for a plan this runtime cannot execute (before any process starts)."""
    st = plan.strategy
    if st.pp > 1 and st.dtype == "fp16":
        raise AutoparError(
            "fp16 loss scaling does not run under pipeline schedules yet; plan pipelines with --dtype bf16"
        )


def slowest_s(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a MAX all-reduce): how long a collective step
    took for the world. Collective."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def from_rank0(make: Callable[[], Any]) -> Any:
    """Rank 0's ``make()``, on every rank (picklable values); an ``AutoparError`` there is raised
    on every rank, which would otherwise wait for a value that never comes. Collective."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", make())
        except AutoparError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise AutoparError(value)
    return value


@contextlib.contextmanager
def groups_made() -> Iterator[list[Any]]:
    """The process groups this rank joined inside the block (torch's registry of them), filled in
    when it ends: what a placement (``ParallelModel.groups``) or a link probe must destroy."""
    before = set(dist.distributed_c10d._world.pg_map)
    made: list[Any] = []
    yield made
    made.extend(pg for pg in dist.distributed_c10d._world.pg_map if pg not in before)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "agree_on_batch",
    "agree_on_plan",
    "agree_on_rng",
    "check_model",
    "check_plan",
    "check_runnable",
    "device_type",
    "from_rank0",
    "groups_made",
    "init_distributed",
    "local_device",
    "reduce_partial_grads",
    "slowest_s",
]
